"""The software/hardware stack a run executed on, gathered from every rank where torch is, for the manifest that
taxbench.rundir.manifest assembles."""

from __future__ import annotations

import platform
import socket
import subprocess
from functools import cache
from importlib import metadata
from typing import Any

import torch
import torch.distributed as dist

from taxbench.parallel.distributed import DistContext

# Training stacks and kernel libraries whose version changes what a step computes: recorded where installed, so that
# `taxbench verify` can name an upgrade among the suspects.
STACK_PACKAGES = ("torchtitan", "megatron-core", "deepspeed", "transformer-engine", "torchao", "triton")


@cache
def package_versions() -> dict[str, str]:
    versions = {}
    for name in STACK_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions


@cache
def _driver_version() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10, check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else None


def local_stack(device: torch.device) -> dict[str, Any]:
    stack: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "nccl": None,
        "gpu": None,
        "driver": None,
        "cpu_threads": torch.get_num_threads(),
        "packages": package_versions(),
    }
    if device.type == "cuda":
        stack["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
        stack["gpu"] = torch.cuda.get_device_name(device)
        stack["driver"] = _driver_version()
    return stack


def gather_stack(ctx: DistContext) -> dict[str, Any]:
    """Rank 0's stack plus every rank's hostname and GPU; a collective, so every rank must call it."""
    mine = local_stack(ctx.device)
    everyone: list[Any] = [None] * ctx.world_size
    if dist.is_initialized() and ctx.world_size > 1:
        dist.all_gather_object(everyone, {"hostname": mine["hostname"], "gpu": mine["gpu"]})
    else:
        everyone = [{"hostname": mine["hostname"], "gpu": mine["gpu"]}]
    return {**mine, "ranks": everyone, "hostnames": sorted({r["hostname"] for r in everyone})}
