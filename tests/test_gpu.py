"""CUDA checks: skipped without a GPU (CI and CPU machines); run on a GPU node with `scripts/gpu_check.sh`."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_fingerprint import _layouts, _sample, reference_digest

from taxbench import fingerprint
from taxbench.config import policy
from taxbench.config.schema import Device, ModelConfig, PolicyConfig
from taxbench.runtime import determinism

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run scripts/gpu_check.sh on one)"),
]

DETERMINISTIC = PolicyConfig(
    name="deterministic", deterministic=True, cudnn_benchmark=False, allow_tf32=False,
    cublas_workspace_config=":4096:8", nccl_algo="Ring", nvte_allow_nondeterministic_algo=False,
    deterministic_kernels=True,
)


GPU_KERNELS = ["triton", "torch"] if fingerprint.triton is not None else ["torch"]


@pytest.mark.parametrize("kernel", GPU_KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn,
                                   torch.float8_e5m2, torch.int8, torch.int32, torch.int64, torch.bool], ids=str)
@pytest.mark.parametrize("numel", [0, 1, 1000, 1027, (1 << 20) + 3])
def test_digest_is_identical_on_cpu_and_cuda(kernel: fingerprint.Kernel, dtype: torch.dtype, numel: int) -> None:
    tensor = _sample(dtype, numel)
    assert int(fingerprint.tensor_digest(tensor.cuda(), kernel)) == int(fingerprint.tensor_digest(tensor))


@pytest.mark.parametrize("kernel", GPU_KERNELS)
def test_cuda_views_and_batches_digest_like_the_host_reference(kernel: fingerprint.Kernel) -> None:
    host, device = _layouts("cpu"), _layouts("cuda")
    for name, (view, _) in device.items():
        assert int(fingerprint.tensor_digest(view, kernel)) & ((1 << 64) - 1) == reference_digest(host[name][1]), name
    views = [view for view, _ in device.values()]
    batch = fingerprint.tensors_digest(views, kernel)
    assert batch is not None and int(batch) == int(fingerprint.tensors_digest([v for v, _ in host.values()]))


def test_cuda_digests_stay_on_the_device_without_a_host_sync() -> None:
    tensors = [torch.randn(n, device="cuda") for n in (5, 4099, 1 << 20)] + [torch.ones(7, device="cuda").half()]
    fingerprint.tensors_digest(tensors)  # warm up: kernel compilation
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        single, batch = fingerprint.tensor_digest(tensors[1]), fingerprint.tensors_digest(tensors)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert single.device.type == "cuda" and batch is not None and batch.device.type == "cuda"
    assert int(batch) == int(fingerprint.tensors_digest([t.cpu() for t in tensors]))


def test_deterministic_policy_makes_torch_refuse_a_nondeterministic_cuda_kernel() -> None:
    values = torch.rand(1000, device="cuda")
    with determinism.active(DETERMINISTIC), pytest.raises(RuntimeError, match="deterministic"):
        torch.histc(values, bins=10)
    torch.histc(values, bins=10)  # the baseline (flags restored) may use it


def test_workspace_config_set_after_cuda_init_is_refused(tmp_path: Path) -> None:
    """cuBLAS reads CUBLAS_WORKSPACE_CONFIG once: taxbench must refuse, not silently apply it too late."""
    script = (
        "import os, torch\n"
        "os.environ.pop('CUBLAS_WORKSPACE_CONFIG', None)\n"
        "torch.ones(1, device='cuda') @ torch.ones(1, 1, device='cuda')\n"
        "from taxbench.config import policy\n"
        "from taxbench.runtime import determinism\n"
        "from taxbench.config.schema import Device, PolicyConfig\n"
        "p = PolicyConfig(name='d', deterministic=True, cudnn_benchmark=False, allow_tf32=False,\n"
        "                 cublas_workspace_config=':4096:8', nccl_algo='Ring',\n"
        "                 nvte_allow_nondeterministic_algo=False)\n"
        "try:\n"
        "    determinism.prepare_process_env([p], Device.cuda)\n"
        "except policy.PolicyError as exc:\n"
        "    print('refused:', exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert "refused: CUDA was initialized before taxbench could set" in out.stdout, out.stderr


def test_moe_fast_combine_differs_on_cuda_and_fixed_order_path_does_not() -> None:
    from taxbench.workloads import build_model

    cfg = ModelConfig(kind="moe", vocab_size=256, seq_len=128, d_model=128, n_layers=2, n_heads=4, d_ff=256,
                      n_experts=8, top_k=2, moe_d_ff=256, n_shared_experts=1)

    def step_bytes(deterministic_kernels: bool) -> torch.Tensor:
        torch.manual_seed(0)
        model = build_model(cfg, deterministic_kernels, seed=0).cuda()
        tokens = torch.randint(0, 256, (16, cfg.seq_len), device="cuda")
        logits = model(tokens)
        logits.float().logsumexp(-1).mean().backward()
        return torch.cat([logits.detach().float().flatten()] + [p.grad.flatten() for p in model.parameters()])

    torch.manual_seed(1)
    with determinism.active(replace(DETERMINISTIC, deterministic=False, deterministic_kernels=False)):
        fast = [step_bytes(False) for _ in range(8)]
    with determinism.active(DETERMINISTIC):
        fixed = [step_bytes(True) for _ in range(8)]
    assert all(torch.equal(fixed[0], other) for other in fixed[1:])
    assert any(not torch.equal(fast[0], other) for other in fast[1:]), "CUDA fast path was bitwise stable 8 times"


@pytest.mark.parametrize(
    "recipe_args",
    [
        ["recipe.precision=bf16"],
        ["+recipe=moe_tiny", "recipe.precision=bf16"],
    ],
)
def test_single_gpu_experiment_passes_the_strict_gates(taxbench_cli, tmp_path: Path, recipe_args: list[str]) -> None:
    result = taxbench_cli(*recipe_args, "cluster=inprocess", "cluster.device=cuda", "cluster.gpus=1",
                          "experiment.steps=24", "experiment.block_steps=6", "experiment.warmup_steps=4",
                          "experiment.resume_step=12", f"experiment.out_dir={tmp_path}", "experiment.name=gpu",
                          "report.wandb=false", cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads((tmp_path / "gpu" / "summary.json").read_text())
    assert summary["deterministic_ok"], summary["verdicts"]
    manifest = json.loads((tmp_path / "gpu" / "deterministic-0" / "manifest.json").read_text())
    assert manifest["stack"]["gpu"] and manifest["stack"]["cuda"]
    assert manifest["policy_applied"]["env"]["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert manifest["policy_applied"]["matmul_allow_tf32"] is False
    print(json.dumps(summary["tax"], indent=1))  # the tax on this GPU, for the check's log


def test_policy_validation_reads_this_cuda_build() -> None:
    policy.validate_policy(DETERMINISTIC, Device.cuda)


def test_the_planted_spin_kernel_runs_for_the_seconds_asked() -> None:
    from taxbench.train.planted import SpinKernel

    spinner = SpinKernel(torch.device("cuda"))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    spinner.spin(0.005)
    end.record()
    end.synchronize()
    assert start.elapsed_time(end) / 1000 == pytest.approx(0.005, rel=0.1)


def test_a_planted_tax_on_gpu_is_recovered_by_a_calibration_pair(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "taxbench", "cluster=inprocess", "cluster.device=cuda", "cluster.gpus=1",
         "experiment.calibration=true", "experiment.planted_tax=0.2", "experiment.steps=120",
         f"experiment.out_dir={tmp_path}", "experiment.name=planted", "report.wandb=false", "report.html=false"],
        capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    tax = json.loads((tmp_path / "planted" / "summary.json").read_text())["tax"]
    assert abs(tax["tax"] - 0.2) <= max(2 * tax["half_width"], 0.02), tax


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="float8 matmuls need compute capability 8.9+")
def test_fp8_recipe_trains_float8_linears_and_its_deterministic_arm_repeats(taxbench_cli, tmp_path: Path) -> None:
    pytest.importorskip("torchao")
    result = taxbench_cli("recipe.precision=fp8", "recipe.model.d_model=128", "recipe.model.d_ff=512",
                          "cluster=inprocess", "cluster.device=cuda", "cluster.gpus=1", "experiment.steps=12",
                          "experiment.block_steps=6", "experiment.warmup_steps=2", "experiment.resume_step=6",
                          f"experiment.out_dir={tmp_path}", "experiment.name=fp8", "report.wandb=false",
                          cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads((tmp_path / "fp8" / "summary.json").read_text())
    assert summary["deterministic_ok"], summary["verdicts"]
