"""The determinism policy: validate it, say what it sets, and audit a stack's own switch against it (torch-free;
applying it to a process and reading torch's flags back is taxbench.runtime.determinism).

As in Megatron (megatron/training/determinism.py), the deterministic arm refuses a value already in the environment
that it cannot vouch for (`validate_policy_env`, on every device: the same environment goes to the cluster job), keeps
a valid one, and fills its policy's value only where the variable is unset (`arm_env_values`); manifests record what
was used.

Two NCCL policies are deterministic, each on a fixed topology: Megatron's (NCCL_ALGO=Ring, refusing Tree, whose
reduction order depends on the topology) and torchtitan's batch-invariant one (a Tree all-reduce on one channel with
the Simple protocol, torchtitan PR 2994: pinned, an element's reduction order no longer depends on the message size).
taxbench's Tree value is per collective, `Ring;allreduce:Tree`: NCCL has Tree only for all-reduce, and a bare Tree
leaves broadcast and all-gather without an algorithm (NVIDIA/nccl#317), as `allreduce:tree` with NCCL_PROTO=Simple does
on NCCL 2.31 (vllm-project/vllm#58179); the other collectives stay on Ring, never on NVLS.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from importlib import resources
from typing import Any

from omegaconf import OmegaConf

from taxbench.config.schema import ConfigError, Device, PolicyConfig

VALID_CUBLAS_WORKSPACE_CONFIGS = (":4096:8", ":16:8")
VALID_DETERMINISTIC_NCCL_ALGOS = ("Ring", "CollnetDirect", "CollnetChain", "^NVLS")
# Tree all-reduce, deterministic only with the protocol and channel count pinned (PINNED_NCCL_PROTOS, nccl_channels).
TREE_NCCL_ALGOS = ("Ring;allreduce:Tree",)
# LL and LL128 pack data in flags and chunk by message size; Simple is the protocol torchtitan pins for Tree.
PINNED_NCCL_PROTOS = ("Simple",)
NCCL_CHANNEL_VARS = ("NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS")

# Environment variables that determinism or its cost depends on; recorded in every manifest.
RECORDED_ENV_VARS = (
    "CUBLAS_WORKSPACE_CONFIG",
    "NCCL_ALGO",
    "NCCL_PROTO",
    "NCCL_MIN_NCHANNELS",
    "NCCL_MAX_NCHANNELS",
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO",
    "CUDA_LAUNCH_BLOCKING",
    "CUDA_VISIBLE_DEVICES",
    "OMP_NUM_THREADS",
    "PYTHONHASHSEED",
    "TORCH_NCCL_USE_COMM_NONBLOCKING",
    "TORCHINDUCTOR_DETERMINISTIC",
)


# What the deterministic arm accepts in the environment (NCCL_ALGO: a comma-separated list, every token accepted);
# a policy that pins the NCCL algorithm to Tree, the protocol or the channels accepts its own values only
# (`env_accepted`).
DETERMINISTIC_ENV_ACCEPTED: dict[str, tuple[str, ...]] = {
    "CUBLAS_WORKSPACE_CONFIG": VALID_CUBLAS_WORKSPACE_CONFIGS,
    "NCCL_ALGO": VALID_DETERMINISTIC_NCCL_ALGOS,
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO": ("0",),
}


class PolicyError(ConfigError):
    """The requested policy cannot be applied or vouched for."""


def env_accepted(policy: PolicyConfig) -> dict[str, tuple[str, ...]]:
    """What the deterministic arm of this policy accepts in the environment: what it would set itself, and for the
    variables it does not pin, every value it can vouch for (a Ring arm keeps a user's CollnetDirect)."""
    accepted = dict(DETERMINISTIC_ENV_ACCEPTED)
    if policy.nccl_algo in TREE_NCCL_ALGOS:
        accepted["NCCL_ALGO"] = (policy.nccl_algo,)
    if policy.nccl_proto is not None:
        accepted["NCCL_PROTO"] = (policy.nccl_proto,)
    if policy.nccl_channels is not None:
        accepted.update({name: (str(policy.nccl_channels),) for name in NCCL_CHANNEL_VARS})
    return accepted


def _env_value_accepted(name: str, value: str, accepted: tuple[str, ...]) -> bool:
    if value in accepted:
        return True
    tokens = [t.strip() for t in value.split(",")] if name == "NCCL_ALGO" else [value]
    return all(token in accepted for token in tokens)


def policy_env(policy: PolicyConfig) -> dict[str, str | None]:
    """The values this policy puts in the environment (None: unset), before any value the user already set."""
    channels = None if policy.nccl_channels is None else str(policy.nccl_channels)
    return {
        "CUBLAS_WORKSPACE_CONFIG": policy.cublas_workspace_config,
        "NCCL_ALGO": policy.nccl_algo,
        "NCCL_PROTO": policy.nccl_proto,
        **dict.fromkeys(NCCL_CHANNEL_VARS, channels),
        "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "1" if policy.nvte_allow_nondeterministic_algo else "0",
    }


def validate_policy_env(policy: PolicyConfig, device: Device, env: Mapping[str, str] | None = None) -> None:
    """Refuse a value in the environment (default os.environ) that would break the deterministic arm.

    An empty value counts as unset (taxbench fills it). Refused on CPU too, where these variables are inactive: the
    same environment is what a cluster job inherits, and the fix (unset it) costs nothing.
    """
    if not policy.deterministic:
        return
    env = os.environ if env is None else env
    defaults = policy_env(policy)
    for name, accepted in env_accepted(policy).items():
        value = env.get(name)
        if not value or _env_value_accepted(name, value, accepted):
            continue
        fill = f"unset it (taxbench then sets {defaults[name]})" if defaults[name] else "unset it"
        inactive = " (inactive on CPU, but nondeterministic on CUDA)" if device is Device.cpu else ""
        raise PolicyError(
            f"{name}={value!r} is set in the environment{inactive} and mode {policy.name!r} cannot vouch for it; "
            f"accepted: {list(accepted)}; {fill} or export an accepted value"
        )


def validate_policy(policy: PolicyConfig, device: Device, env: Mapping[str, str] | None = None) -> None:
    """Refuse deterministic policies whose settings, or the environment (default os.environ) they would run in, are
    known not to give bitwise determinism. A stack-native arm is the stack's switch: audited (`audit`), not refused.
    The torch build is checked where torch is: taxbench.runtime.determinism.validate_on_this_build."""
    if not policy.deterministic or policy.stack_native:
        return
    validate_policy_env(policy, device, env)
    _validate_nccl(policy, device)
    if device is Device.cuda:  # whether this torch build is one taxbench vouches for: runtime.determinism
        if policy.cublas_workspace_config not in VALID_CUBLAS_WORKSPACE_CONFIGS:
            raise PolicyError(
                f"mode {policy.name!r}: cublas_workspace_config={policy.cublas_workspace_config!r} does not make "
                f"cuBLAS deterministic; use one of {list(VALID_CUBLAS_WORKSPACE_CONFIGS)}"
            )
        if policy.allow_tf32 or policy.cudnn_benchmark:
            raise PolicyError(
                f"mode {policy.name!r}: allow_tf32={policy.allow_tf32}, cudnn_benchmark={policy.cudnn_benchmark}; "
                "deterministic mode needs both false (autotuning picks kernels per run)"
            )
        if policy.nvte_allow_nondeterministic_algo:
            raise PolicyError(
                f"mode {policy.name!r}: nvte_allow_nondeterministic_algo=true lets Transformer Engine pick "
                "nondeterministic attention kernels; set it to false"
            )


def _validate_nccl(policy: PolicyConfig, device: Device) -> None:
    """The NCCL fields of a deterministic policy, on every device (inert under gloo, but the same config goes to a
    GPU job); only an unset algorithm is left to NCCL on CPU."""
    name, algo = policy.name, policy.nccl_algo
    pinned = f"nccl_proto={PINNED_NCCL_PROTOS[0]} and nccl_channels=1 (mode@arms.deterministic=deterministic_tree)"
    if policy.nccl_channels is not None and policy.nccl_channels < 1:
        raise PolicyError(f"mode {name!r}: nccl_channels={policy.nccl_channels} must be >= 1 (it sets "
                          "NCCL_MIN_NCHANNELS=NCCL_MAX_NCHANNELS) or null (NCCL chooses)")
    if policy.nccl_proto is not None and policy.nccl_proto not in PINNED_NCCL_PROTOS:
        raise PolicyError(f"mode {name!r}: nccl_proto={policy.nccl_proto!r} cannot be vouched for (LL and LL128 "
                          f"pack data by message size); use one of {list(PINNED_NCCL_PROTOS)} or null")
    if algo in TREE_NCCL_ALGOS and (policy.nccl_proto is None or policy.nccl_channels is None):
        raise PolicyError(f"mode {name!r}: nccl_algo={algo!r} with nccl_proto={policy.nccl_proto!r}, "
                          f"nccl_channels={policy.nccl_channels!r}: a Tree all-reduce is deterministic only pinned "
                          f"to a fixed channel count and protocol; set {pinned}")
    if algo is None:
        accepted = device is Device.cpu
    else:
        accepted = algo in TREE_NCCL_ALGOS or _env_value_accepted("NCCL_ALGO", algo, VALID_DETERMINISTIC_NCCL_ALGOS)
    if not accepted:
        tree = " (a bare Tree leaves broadcast and all-gather without an algorithm)" if algo == "Tree" else ""
        raise PolicyError(
            f"mode {name!r}: nccl_algo={algo!r} is not accepted for deterministic runs{tree}; "
            f"use one of {list(VALID_DETERMINISTIC_NCCL_ALGOS)} (Megatron's Ring), or "
            f"{TREE_NCCL_ALGOS[0]!r} with {pinned}"
        )


def full_policy() -> PolicyConfig:
    """taxbench's full deterministic policy, as conf/mode/deterministic.yaml has it (what stack-native arms are
    audited against)."""
    node = OmegaConf.load(str(resources.files("taxbench.conf").joinpath("mode", "deterministic.yaml")))
    fields = {k: v for k, v in OmegaConf.to_container(node).items() if k != "defaults"}  # type: ignore[union-attr]
    return PolicyConfig(**fields)


# What each policy field controls, as the audit of a stack-native arm names it.
AUDITED = {
    "deterministic": "torch.use_deterministic_algorithms and cudnn.deterministic",
    "cudnn_benchmark": "cudnn.benchmark",
    "allow_tf32": "TF32 (matmul and cuDNN)",
    "cublas_workspace_config": "CUBLAS_WORKSPACE_CONFIG",
    "nccl_algo": "NCCL_ALGO",
    "nccl_proto": "NCCL_PROTO",
    "nccl_channels": "NCCL_MIN_NCHANNELS/NCCL_MAX_NCHANNELS",
    "nvte_allow_nondeterministic_algo": "NVTE_ALLOW_NONDETERMINISTIC_ALGO",
    "fill_uninitialized_memory": "torch.utils.deterministic.fill_uninitialized_memory",
    "deterministic_kernels": "taxbench's fixed-order kernels (its own workloads' MoE routing, dispatch and combine)",
}


def _shown(field: str, value: Any) -> str:
    if field == "allow_tf32" and value is None:
        return "as the process has it (torch's defaults: matmul off, cuDNN on)"
    if field == "nvte_allow_nondeterministic_algo":
        return "unset (Transformer Engine's default: 1)" if value else "0"
    if isinstance(value, bool):
        return "on" if value else "off"
    return "unset" if value is None else str(value)


def audit(native: PolicyConfig, stack: str) -> list[str]:
    """What taxbench's full policy would add or change over a stack's own switch, one line each."""
    full = full_policy()
    lines = []
    for field, what in AUDITED.items():
        theirs, ours = getattr(native, field), getattr(full, field)
        if theirs != ours:
            left = theirs is None or theirs is False or (field == "nvte_allow_nondeterministic_algo" and theirs)
            verb = "leaves" if left else "sets"
            lines.append(f"{stack}'s switch {verb} {what} {_shown(field, theirs)}; taxbench's policy sets "
                         f"{_shown(field, ours)}")
    return lines


PER_ARM_ENV_VARS = ("NCCL_ALGO", "NCCL_PROTO", *NCCL_CHANNEL_VARS, "NVTE_ALLOW_NONDETERMINISTIC_ALGO")
# Set by an arm only where its policy pins them; otherwise the user's values (a site's NCCL_PROTO=^LL128) stay, for
# both arms.
PINNED_ONLY_ENV_VARS = ("NCCL_PROTO", *NCCL_CHANNEL_VARS)


def arm_env_values(policy: PolicyConfig, user_env: Mapping[str, str | None]) -> dict[str, str | None]:
    """The baseline arm sets its policy's values (None: unset); the deterministic arm keeps a value the user set
    (validated by validate_policy_env) and fills its own only where the variable is unset. NCCL's protocol and
    channel bounds are set only by a policy that pins them."""
    wanted = policy_env(policy)
    return {
        name: (user_env.get(name) or wanted[name]) if policy.deterministic or name in PINNED_ONLY_ENV_VARS
        else wanted[name]
        for name in PER_ARM_ENV_VARS
    }
