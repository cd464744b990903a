"""Stack-native arms (mode@arms.deterministic=stack_native): the deterministic arm is the training stack's own switch
and nothing else, recorded and audited against taxbench's full policy instead of refused where they disagree."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import compose_config
from test_deepspeed import needs_deepspeed
from test_megatron import needs_megatron

from taxbench.config.policy import audit, full_policy, validate_policy
from taxbench.config.schema import ConfigError, Device
from taxbench.preflight import stack_native_audits
from taxbench.runtime import determinism

NATIVE = "mode@arms.deterministic=stack_native"


def test_taxbenchs_own_stack_native_arm_is_its_full_policy_with_nothing_to_audit() -> None:
    cfg = compose_config(NATIVE)
    arm = cfg.arms["deterministic"]
    assert arm.stack_native
    assert {**vars(arm), "stack_native": False} == vars(full_policy())
    assert stack_native_audits(cfg) == {"deterministic": []}
    assert not cfg.arms["baseline"].stack_native


@needs_deepspeed
def test_deepspeeds_native_arm_is_its_switch_alone_and_the_audit_names_what_taxbench_would_add() -> None:
    cfg = compose_config("+recipe=deepspeed_moe_debug", NATIVE)
    arm = cfg.arms["deterministic"]
    assert arm.stack_native and arm.deterministic and not arm.allow_tf32 and not arm.cudnn_benchmark
    assert arm.nccl_algo is None and not arm.deterministic_kernels  # DeepSpeed's switch changes no NCCL algorithm
    lines = stack_native_audits(cfg)["deterministic"]
    assert "deepspeed's switch leaves NCCL_ALGO unset; taxbench's policy sets Ring" in lines
    assert any(line.startswith("deepspeed's switch leaves NVTE_ALLOW_NONDETERMINISTIC_ALGO unset") for line in lines)
    # Under taxbench's policy the same arm would be refused on CUDA (NCCL_ALGO unset): the native arm is audited.
    validate_policy(arm, Device.cuda)
    with pytest.raises(ConfigError, match="nccl_algo=None"):
        validate_policy(cfg.arms["deterministic"].__class__(**{**vars(arm), "stack_native": False}), Device.cuda)


@needs_megatron
def test_megatrons_native_arm_is_its_deterministic_mode_with_the_environment_it_requires() -> None:
    cfg = compose_config("+recipe=megatron_moe_debug", NATIVE, "cluster=slurm", "cluster.device=cuda", "cluster.gpus=1")
    arm = cfg.arms["deterministic"]
    assert arm.stack_native and arm.deterministic and arm.nccl_algo == "Ring"
    assert not arm.nvte_allow_nondeterministic_algo
    # Megatron's mode leaves TF32 and cuDNN's autotuner as the process has them: torch's defaults, autotuner off
    assert arm.allow_tf32 is None and not arm.cudnn_benchmark
    lines = stack_native_audits(cfg)["deterministic"]
    assert ("megatron-core's switch leaves TF32 (matmul and cuDNN) as the process has it (torch's defaults: matmul "
            "off, cuDNN on); taxbench's policy sets off") in lines
    assert not any("cudnn.benchmark" in line for line in lines)
    assert not any("NCCL_ALGO" in line for line in lines)  # Megatron requires Ring, as taxbench's policy does


def test_the_audit_lists_every_field_where_a_switch_differs_from_taxbenchs_policy() -> None:
    weaker = full_policy().__class__(**{**vars(full_policy()), "allow_tf32": True, "cublas_workspace_config": None})
    assert audit(weaker, "mystack") == [
        "mystack's switch sets TF32 (matmul and cuDNN) on; taxbench's policy sets off",
        "mystack's switch leaves CUBLAS_WORKSPACE_CONFIG unset; taxbench's policy sets :4096:8",
    ]


def test_torchtitans_native_arm_is_debug_deterministic_alone() -> None:
    cfg = compose_config("+recipe=titan_llama3_debug", NATIVE)
    arm = cfg.arms["deterministic"]
    assert arm.stack_native and arm.deterministic and not arm.cudnn_benchmark and not arm.fill_uninitialized_memory
    assert arm.cublas_workspace_config == ":4096:8" and arm.nccl_algo is None
    lines = stack_native_audits(cfg)["deterministic"]
    assert "torchtitan's switch leaves NCCL_ALGO unset; taxbench's policy sets Ring" in lines
    # set_determinism does not touch TF32: the arm leaves it as the process has it, as plain torchtitan runs.
    assert arm.allow_tf32 is None
    assert ("torchtitan's switch leaves TF32 (matmul and cuDNN) as the process has it (torch's defaults: matmul off, "
            "cuDNN on); taxbench's policy sets off") in lines
    assert not any("TF32" in line and " sets TF32" in line for line in lines)


def test_a_native_arm_that_leaves_tf32_runs_the_processs_tf32_flags_and_taxbenchs_arms_set_theirs() -> None:
    cfg = compose_config("+recipe=titan_llama3_debug", NATIVE)
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        for process in ((False, True), (True, False)):  # torch's defaults, and a process that set its own
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = process
            with determinism.active(cfg.arms["deterministic"]):
                assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == process
            with determinism.active(cfg.arms["baseline"]):  # taxbench's baseline sets TF32 on
                assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


@needs_deepspeed
@pytest.mark.slow
def test_a_deepspeed_native_arm_runs_prints_the_audit_and_exits_with_the_gates_verdict(tmp_path: Path,
                                                                                     taxbench_cli) -> None:
    result = taxbench_cli("+recipe=deepspeed_moe_debug", NATIVE, "experiment.steps=6", "experiment.warmup_steps=1",
                          "experiment.resume_step=3", "experiment.checkpoint_every_steps=3", "report.wandb=false",
                          f"experiment.out_dir={tmp_path}", "experiment.name=native", cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "deepspeed's switch leaves NCCL_ALGO unset; taxbench's policy sets Ring" in result.stdout
    summary = json.loads((tmp_path / "native" / "summary.json").read_text())
    assert summary["outcome"] == "passed"
    manifest = json.loads((tmp_path / "native" / "deterministic-0" / "manifest.json").read_text())
    assert manifest["policy"]["stack_native"] is True and manifest["policy"]["nccl_algo"] is None
    assert "NCCL_ALGO" not in manifest["policy_applied"]["env"]
    assert manifest["stack_switch"]["arm"].startswith("the stack's own switch only")
    assert manifest["stack_switch"]["deterministic_mode"].startswith("documented equivalent")
    assert any("NCCL_ALGO" in line for line in manifest["stack_native_audit"])
    baseline = json.loads((tmp_path / "native" / "baseline-0" / "manifest.json").read_text())
    assert baseline["stack_native_audit"] is None
