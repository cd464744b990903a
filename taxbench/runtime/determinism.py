"""Apply a determinism policy to this process and read back what was applied (taxbench.config.policy says what the
policy is and whether it can be vouched for; this module needs torch and the live environment).

Two layers:
- process environment (CUBLAS_WORKSPACE_CONFIG): must be in place before the first CUDA op; `prepare_process_env`
  validates and sets it and refuses when CUDA is already initialized with other values;
- per arm: the variables read at use (`arm_environment`: NCCL_ALGO at communicator creation, NVTE_* at kernel
  selection) and torch's flags (deterministic algorithms, cuDNN, TF32, fill_uninitialized_memory), switched by
  `active` so that both arms can be interleaved in one process; `applied_state` reads them back for the manifest.
NCCL_ALGO is read when a communicator is created, so each arm gets its own process group created under its value
(see taxbench.parallel.distributed).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from taxbench.config.policy import (
    NCCL_CHANNEL_VARS,
    PER_ARM_ENV_VARS,
    RECORDED_ENV_VARS,
    PolicyError,
    arm_env_values,
    validate_policy,
)
from taxbench.config.schema import Device, PolicyConfig


def validate_on_this_build(policy: PolicyConfig, device: Device, env: Mapping[str, str] | None = None) -> None:
    """validate_policy, and refuse a deterministic CUDA arm on a torch build that taxbench cannot vouch for (ROCm/HIP
    reports itself as CUDA)."""
    if policy.deterministic and not policy.stack_native and device is Device.cuda and torch.version.hip is not None:
        raise PolicyError(
            f"mode {policy.name!r}: deterministic execution on ROCm/HIP (torch {torch.__version__}) cannot be "
            "vouched for by taxbench; run the deterministic arm on NVIDIA CUDA or on cluster.device=cpu"
        )
    validate_policy(policy, device, env)


def _cuda_initialized() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def prepare_process_env(policies: Iterable[PolicyConfig], device: Device) -> dict[str, str]:
    """Validate and set the process-wide environment that the policies need; call before the first CUDA op.

    The arms share one process, so a variable one arm requires (the cuBLAS workspace size) applies to both; it only
    fixes the workspace size, and the manifest records it as shared.
    """
    policies = list(policies)
    for policy in policies:
        validate_on_this_build(policy, device)
    wanted: dict[str, str] = {}
    workspaces = {p.cublas_workspace_config for p in policies if p.cublas_workspace_config}
    if len(workspaces) > 1:
        raise PolicyError(
            f"the arms ask for different cublas_workspace_config values {sorted(workspaces)}; it is process-wide, "
            "so both arms must use the same one"
        )
    if workspaces and not os.environ.get("CUBLAS_WORKSPACE_CONFIG"):  # a value already set was validated: kept
        wanted["CUBLAS_WORKSPACE_CONFIG"] = workspaces.pop()
    if device is Device.cuda and _cuda_initialized():
        stale = {k: v for k, v in wanted.items() if os.environ.get(k) != v}
        if stale:
            raise PolicyError(
                f"CUDA was initialized before taxbench could set {stale}; cuBLAS reads them once. Set them in the "
                "job environment or avoid CUDA work before taxbench starts"
            )
    os.environ.update(wanted)
    return wanted


# The per-arm variables as they were before the outermost arm_environment: the user's values, which nested or
# interleaved arm blocks must not mistake for their own.
_outer_env: list[dict[str, str | None]] = []


@contextmanager
def arm_environment(policy: PolicyConfig) -> Iterator[None]:
    """Per-arm variables read at use (NCCL_ALGO at communicator creation, NVTE_* at kernel selection)."""
    saved = {k: os.environ.get(k) for k in PER_ARM_ENV_VARS}
    _outer_env.append(_outer_env[0] if _outer_env else saved)
    values = arm_env_values(policy, _outer_env[0])
    try:
        put_env(values)
        yield
    finally:
        _outer_env.pop()
        put_env(saved)


def put_env(values: Mapping[str, str | None]) -> None:
    """Set each environment variable to its value; None unsets it."""
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def apply_flags(policy: PolicyConfig) -> None:
    """Switch torch's global determinism flags to this arm's policy."""
    torch.use_deterministic_algorithms(policy.deterministic, warn_only=False)
    torch.utils.deterministic.fill_uninitialized_memory = policy.fill_uninitialized_memory  # type: ignore[attr-defined]
    torch.backends.cudnn.deterministic = policy.deterministic
    torch.backends.cudnn.benchmark = policy.cudnn_benchmark
    if policy.allow_tf32 is not None:  # None: a stack-native switch that leaves TF32 as the process has it
        torch.backends.cuda.matmul.allow_tf32 = policy.allow_tf32
        torch.backends.cudnn.allow_tf32 = policy.allow_tf32


def _current_flags() -> dict[str, Any]:
    return {
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "fill": torch.utils.deterministic.fill_uninitialized_memory,  # type: ignore[attr-defined]
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "matmul_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_tf32": torch.backends.cudnn.allow_tf32,
    }


def _restore_flags(flags: dict[str, Any]) -> None:
    torch.use_deterministic_algorithms(flags["deterministic"], warn_only=flags["warn_only"])
    torch.utils.deterministic.fill_uninitialized_memory = flags["fill"]  # type: ignore[attr-defined]
    torch.backends.cudnn.deterministic = flags["cudnn_deterministic"]
    torch.backends.cudnn.benchmark = flags["cudnn_benchmark"]
    torch.backends.cuda.matmul.allow_tf32 = flags["matmul_tf32"]
    torch.backends.cudnn.allow_tf32 = flags["cudnn_tf32"]


@contextmanager
def active(policy: PolicyConfig) -> Iterator[None]:
    """Run a block of this arm's work under its flags and per-arm environment; the previous flags come back after."""
    saved = _current_flags()
    with arm_environment(policy):
        apply_flags(policy)
        try:
            yield
        finally:
            _restore_flags(saved)


def applied_state(device: Device) -> dict[str, Any]:
    """What torch reports right now: recorded in the manifest, read back rather than assumed."""
    state: dict[str, Any] = {
        "device": device.value,
        "use_deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "fill_uninitialized_memory": bool(torch.utils.deterministic.fill_uninitialized_memory),  # type: ignore[attr-defined]
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
        "env": {k: os.environ[k] for k in RECORDED_ENV_VARS if k in os.environ},
    }
    state["nccl"] = {
        "algo": os.environ.get("NCCL_ALGO"),
        "proto": os.environ.get("NCCL_PROTO"),
        "channels": [os.environ.get(name) for name in NCCL_CHANNEL_VARS],
        # NCCL reads them when the arm's communicator is created; gloo never reads them.
        "active": device is Device.cuda,
    }
    if device is Device.cpu:
        state["note"] = (
            "CPU execution: determinism is vouched for by torch's deterministic algorithms and fixed thread counts; "
            "CUDA-only settings are recorded but inactive (the NCCL_* variables too: gloo runs the collectives)"
        )
        state["cpu_threads"] = torch.get_num_threads()
    return state
