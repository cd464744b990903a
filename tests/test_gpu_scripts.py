"""scripts/gpu_check.sh without a GPU: its dry mode (GPU_CHECK_DRY=1) prints the plan a GPU node would run (its
budget, the order of its steps, the commands they would launch), checked here before a lent GPU's minutes are spent;
and its helpers: the wheels check (gpu_imports.py), the image list both scripts read, the table (gpu_table.py)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, compose_typed

SCRIPT = REPO / "scripts" / "gpu_check.sh"
PAIRS = ["deepspeed_dense", "deepspeed_moe", "titan_llama3", "megatron_gpt", "megatron_moe", "fp8"]


def dry_run(tmp_path: Path, gpus: int, only: str = "", budget: int | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "GPU_CHECK_DRY": "1", "GPU_CHECK_GPUS": str(gpus), "OUT": str(tmp_path / "out"),
           "GPU_STEPS": only}
    if budget is not None:
        env["GPU_CHECK_BUDGET"] = str(budget)
    done = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    return done


def dry_steps(tmp_path: Path, gpus: int, only: str = "", budget: int | None = None) -> dict[str, str]:
    """Step name -> the command the script would run, as printed by its dry mode; other lines under '-'."""
    steps = {}
    for line in dry_run(tmp_path, gpus, only, budget).stdout.splitlines():
        if line.startswith("step "):
            name, command = line.removeprefix("step ").split(": ", 1)
            steps[name.split()[0]] = command
        else:
            steps.setdefault("-", "")
            steps["-"] += line + "\n"
    return steps


def planned(text: str) -> int:
    match = re.search(r"^planned device time: (\d+) s", text, re.MULTILINE)
    assert match is not None, text
    return int(match[1])


def limits(text: str) -> dict[str, int]:
    return {m[1]: int(m[2]) for m in re.finditer(r"^step (\S+) (\d+)s: ", text, re.MULTILINE)}


@pytest.mark.parametrize("gpus", [1, 2, 8])
def test_the_default_plan_fits_one_device_command_and_is_printed_first(tmp_path: Path, gpus: int) -> None:
    text = dry_run(tmp_path, gpus).stdout
    assert text.splitlines()[0].startswith("planned device time: ")
    assert sum(limits(text).values()) + 25 == planned(text) <= 600  # the steps' limits and the device check
    # nothing a real run reads: no resume log, no table, no folder at all
    assert not (tmp_path / "out").exists()


def test_the_steps_come_in_order_of_value(tmp_path: Path) -> None:
    """wheels first, then the never-run stack pairs (Megatron's MoE and its distributed optimizer first), moe_tiny,
    fp8; what an H200 already ran comes last and is left out of the default budget."""
    order = list(limits(dry_run(tmp_path, gpus=1).stdout))
    assert order[:4] == ["wheels", "megatron_moe_policy", "megatron_moe_native", "megatron_moe_distopt"]
    assert order.index("titan_llama3_native") < order.index("deepspeed_dense_policy") < order.index("moe_tiny_bf16") \
        < order.index("fp8_policy")
    assert "megatron_gpt_policy" not in order and "pytest_gpu" not in order


def test_steps_beyond_the_budget_are_named_with_how_to_run_them(tmp_path: Path) -> None:
    steps = dry_steps(tmp_path, gpus=1, budget=200)
    text = steps["-"]
    assert planned(text) <= 200 and set(steps) - {"-"} == {"wheels", "megatron_moe_policy", "megatron_moe_native"}
    assert "skip megatron_moe_distopt: over the 200 s budget (55 s; GPU_STEPS=megatron_moe_distopt runs it)" in text


def test_the_dry_mode_lists_every_stack_under_its_own_switch_and_taxbench_policy(tmp_path: Path) -> None:
    pairs = " ".join(f"{pair}_{arm}" for pair in PAIRS for arm in ("policy", "native"))
    steps = dry_steps(tmp_path, gpus=2, only=pairs + " nccl_policies megatron_tests megatron_moe_distopt")
    for pair in PAIRS:
        assert "mode@arms.deterministic=stack_native" not in steps[f"{pair}_policy"]
        assert "mode@arms.deterministic=stack_native" in steps[f"{pair}_native"]
    assert "+recipe=deepspeed_moe_debug" in steps["deepspeed_moe_policy"] and "cluster.gpus=2" in steps[
        "deepspeed_moe_policy"]
    assert "recipe.precision=fp8" in steps["fp8_native"]
    assert "use_distributed_optimizer=true" in steps["megatron_moe_distopt"]
    assert {"nccl_policies", "megatron_tests"} <= set(steps)
    assert "over the budget" in steps["-"]  # GPU_STEPS named more than 600 s: said, and planned anyway


def test_one_gpu_skips_the_two_rank_steps_with_a_message(tmp_path: Path) -> None:
    steps = dry_steps(tmp_path, gpus=1, only="deepspeed_moe_policy deepspeed_moe_native nccl_policies")
    assert "deepspeed_moe_policy" not in steps and "deepspeed_moe_native" not in steps
    assert "skip deepspeed_moe_policy: fewer than 2 GPUs (its ep=2 needs 2 ranks)" in steps["-"]
    assert "skip nccl_policies: fewer than 2 GPUs" in steps["-"]


def test_taxbench_run_over_torchtitan_has_its_slot_and_says_why_it_is_skipped(tmp_path: Path) -> None:
    helped = subprocess.run([sys.executable, "-m", "taxbench", "run", "--help"], capture_output=True, text=True,
                            timeout=60)
    available = helped.returncode == 0 and "taxbench run" in "\n".join(helped.stdout.splitlines()[:3])
    steps = dry_steps(tmp_path, gpus=1, only="titan_run", budget=1000)
    if available:
        assert " run " in steps["titan_run"] and "torchtitan" in steps["titan_run"]
    else:
        assert "titan_run" not in steps and "skip titan_run: taxbench run not available" in steps["-"]


def test_every_experiment_step_composes(tmp_path: Path) -> None:
    """Each `python3 -m taxbench ...` step (not the multirun nor a subcommand) is a config Hydra composes and types."""
    every = "wheels megatron_moe_policy megatron_moe_native megatron_moe_distopt titan_llama3_policy " \
            "titan_llama3_native deepspeed_dense_policy deepspeed_dense_native deepspeed_moe_policy " \
            "deepspeed_moe_native moe_tiny_bf16 fp8_policy fp8_native megatron_gpt_policy megatron_gpt_native " \
            "interleave_policy planted_5pct"
    composed = 0
    for name, command in dry_steps(tmp_path, gpus=2, only=every).items():
        if name == "-":  # the plan's other lines
            continue
        argv = shlex.split(command)
        if argv[1:3] != ["-m", "taxbench"] or argv[3] in ("-m", "scan", "run"):
            continue
        cfg = compose_typed(*argv[3:])
        assert cfg.cluster.device.value == "cuda", name
        assert cfg.experiment.name == name, name  # the table finds each step's summary by its name
        composed += 1
    assert composed == len(every.split()) - 1


def test_the_wheels_check_imports_taxbench_and_names_each_stack(tmp_path: Path) -> None:
    out = tmp_path / "imports.txt"
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_imports.py"), str(out)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr  # taxbench imports here
    lines = out.read_text().splitlines()
    assert [line.split()[0] for line in lines] == ["deepspeed", "titan", "megatron", "fp8"]
    assert all(line.split()[1] in ("ok", "missing") for line in lines)
    assert "imports checked in" in done.stdout


def test_the_image_list_is_one_file_that_both_scripts_read(tmp_path: Path) -> None:
    image = (REPO / "scripts" / "gpu_image.txt").read_text()
    assert re.search(r"^python\s+-\s+3\.12\.3$", image, re.MULTILINE)
    assert re.search(r"^torch\s+torch\s+2\.11\+cu130$", image, re.MULTILINE)
    done = subprocess.run(["bash", str(REPO / "scripts" / "gpu_wheels.sh")], capture_output=True, text=True,
                          env={**os.environ, "GPU_WHEELS_DRY": "1"}, timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("wheels for Python 3.12, torch 2.11 (torchao 0.17.0)")
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import gpu_imports
    finally:
        sys.path.pop(0)
    assert {"numpy", "pandas", "yaml", "transformers", "accelerate"} <= set(gpu_imports.image_modules())


def test_the_table_is_written_from_what_has_finished(tmp_path: Path) -> None:
    """A cut run's table: the device, finished steps with tax and gates from their summaries, skips with why."""
    (tmp_path / "device.txt").write_text("NVIDIA H100 80GB HBM3 x 1 - torch 2.11.0+cu130 CUDA 13.0\n")
    (tmp_path / "steps.txt").write_text(
        "wheels                 rc=0      9s limit=60s\n"
        "megatron_moe_policy    rc=0     41s limit=55s\n"
        "megatron_moe_native    rc=124   55s limit=55s\n"
        "skip titan_llama3_policy: titan missing torchtitan.trainer: ModuleNotFoundError: No module named 'tyro'\n")
    summary = tmp_path / "runs" / "megatron_moe_policy" / "summary.json"
    summary.parent.mkdir(parents=True)
    summary.write_text(json.dumps({
        "tax": {"tax": 0.031, "half_width": 0.012, "baseline_median_s": 0.0315, "deterministic_median_s": 0.0325},
        "verdicts": [{"gate": "repeatability", "outcome": "identical"},
                     {"gate": "restart_replay", "outcome": "identical"}],
        "outcome": "passed"}))
    subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_table.py"), str(tmp_path)], check=True, timeout=30)
    table = (tmp_path / "gpu_table.md").read_text()
    assert "Device: NVIDIA H100 80GB HBM3 x 1" in table
    assert ("| megatron_moe_policy | ok | 41 / 55 | +3.1% +/-1.2% (31.5 vs 32.5 ms) | repeatability identical, "
            "restart_replay identical | passed |") in table
    assert "| megatron_moe_native | TIMED OUT | 55 / 55 | - | - | see megatron_moe_native.log |" in table
    assert "| titan_llama3_policy | skipped |" in table and "No module named 'tyro'" in table


@pytest.mark.parametrize("script", ["gpu_check.sh", "gpu_wheels.sh"])
def test_the_gpu_scripts_parse_and_pass_shellcheck(script: str) -> None:
    path = REPO / "scripts" / script
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True).returncode == 0
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed")
    done = subprocess.run(["shellcheck", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


def test_taxbench_run_over_megatron_lm_needs_its_checkout(tmp_path: Path) -> None:
    steps = dry_steps(tmp_path, gpus=1, only="megatron_run")
    assert "megatron_run" not in steps and "skip megatron_run: no Megatron-LM checkout" in steps["-"]
    env = {**os.environ, "GPU_CHECK_DRY": "1", "GPU_CHECK_GPUS": "1", "OUT": str(tmp_path / "out"),
           "GPU_STEPS": "megatron_run", "MEGATRON_LM": "/opt/Megatron-LM"}
    done = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=60)
    line = next(line for line in done.stdout.splitlines() if line.startswith("step megatron_run"))
    assert "/opt/Megatron-LM/pretrain_gpt.py" in line and "--deterministic-mode" in line and "--mock-data" in line
