"""scripts/gpu_check.sh without a GPU: its dry mode (GPU_CHECK_DRY=1) lists the steps a GPU node would run, so the
steps of every stack, and the commands they would launch, are checked here before a lent GPU's minutes are spent."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import REPO, compose_typed

SCRIPT = REPO / "scripts" / "gpu_check.sh"
PAIRS = ["deepspeed_dense", "deepspeed_moe", "titan_llama3", "megatron_gpt", "megatron_moe", "fp8"]


def dry_steps(tmp_path: Path, gpus: int, only: str = "") -> dict[str, str]:
    """Step name -> the command the script would run, as printed by its dry mode; skipped steps under '-'."""
    env = {**os.environ, "GPU_CHECK_DRY": "1", "GPU_CHECK_GPUS": str(gpus), "OUT": str(tmp_path), "GPU_STEPS": only}
    done = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=30)
    assert done.returncode == 0, done.stderr
    steps = {}
    for line in done.stdout.splitlines():
        if line.startswith("step "):
            name, command = line.removeprefix("step ").split(": ", 1)
            steps[name.split()[0]] = command
        else:
            steps.setdefault("-", "")
            steps["-"] += line + "\n"
    return steps


def test_the_dry_mode_lists_every_stack_under_its_own_switch_and_taxbench_policy(tmp_path: Path) -> None:
    steps = dry_steps(tmp_path, gpus=2)
    for pair in PAIRS:
        assert "mode@arms.deterministic=stack_native" not in steps[f"{pair}_policy"]
        assert "mode@arms.deterministic=stack_native" in steps[f"{pair}_native"]
    assert "+recipe=deepspeed_moe_debug" in steps["deepspeed_moe_policy"] and "cluster.gpus=2" in steps[
        "deepspeed_moe_policy"]
    assert "recipe.precision=fp8" in steps["fp8_native"]
    assert {"install", "pytest_gpu", "nccl_policies", "megatron_tests"} <= set(steps)


def test_one_gpu_skips_the_two_rank_steps_with_a_message(tmp_path: Path) -> None:
    steps = dry_steps(tmp_path, gpus=1)
    assert "deepspeed_moe_policy" not in steps and "deepspeed_moe_native" not in steps
    assert "deepspeed_moe_policy and deepspeed_moe_native not run (its ep=2 needs 2 ranks)" in steps["-"]
    assert "nccl_policies not run" in steps["-"]


def test_gpu_steps_stacks_runs_only_the_install_and_the_stack_pairs(tmp_path: Path) -> None:
    steps = dry_steps(tmp_path, gpus=2, only="stacks")
    pairs = {f"{pair}_{arm}" for pair in PAIRS for arm in ("policy", "native")}
    assert set(steps) - {"-"} == {"install"} | pairs


def test_every_experiment_step_composes(tmp_path: Path) -> None:
    """Each `python3 -m taxbench ...` step (not the multirun nor a subcommand) is a config Hydra composes and types."""
    for name, command in dry_steps(tmp_path, gpus=2).items():
        argv = shlex.split(command)
        if argv[1:3] != ["-m", "taxbench"] or argv[3] in ("-m", "scan"):
            continue
        cfg = compose_typed(*argv[3:])
        assert cfg.cluster.device.value == "cuda", name


@pytest.mark.parametrize("script", ["gpu_check.sh", "gpu_wheels.sh"])
def test_the_gpu_scripts_parse_and_pass_shellcheck(script: str) -> None:
    path = REPO / "scripts" / script
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True).returncode == 0
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed")
    done = subprocess.run(["shellcheck", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout
