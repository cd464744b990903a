"""Determinism policy: validated before use, applied per arm, recorded as torch reports it."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from taxbench import policy
from taxbench.config import Device, PolicyConfig

DETERMINISTIC = PolicyConfig(
    name="deterministic", deterministic=True, cudnn_benchmark=False, allow_tf32=False,
    cublas_workspace_config=":4096:8", nccl_algo="Ring", nvte_allow_nondeterministic_algo=False,
    deterministic_kernels=True,
)
BASELINE = PolicyConfig(name="baseline")


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"cublas_workspace_config": ":1024:2"}, "cublas_workspace_config=':1024:2'"),
        ({"cublas_workspace_config": None}, "cublas_workspace_config=None"),
        ({"nccl_algo": "Tree"}, "nccl_algo='Tree' is not accepted"),
        ({"nccl_algo": None}, "nccl_algo=None"),
        ({"allow_tf32": True}, "allow_tf32=True"),
        ({"nvte_allow_nondeterministic_algo": True}, "nvte_allow_nondeterministic_algo=true"),
    ],
)
def test_deterministic_cuda_policy_refuses_settings_it_cannot_vouch_for(change: dict, expected: str) -> None:
    with pytest.raises(policy.PolicyError, match="use one of|needs both false|set it to false") as excinfo:
        policy.validate_policy(replace(DETERMINISTIC, **change), Device.cuda)
    assert expected in str(excinfo.value)


@pytest.mark.parametrize("algo", ["Ring", "CollnetDirect", "CollnetChain", "^NVLS"])
@pytest.mark.parametrize("workspace", [":4096:8", ":16:8"])
def test_accepted_values_pass(algo: str, workspace: str) -> None:
    policy.validate_policy(replace(DETERMINISTIC, nccl_algo=algo, cublas_workspace_config=workspace), Device.cuda)


def test_cpu_deterministic_mode_is_allowed_and_recorded_as_cpu() -> None:
    policy.validate_policy(replace(DETERMINISTIC, nccl_algo=None, cublas_workspace_config=None), Device.cpu)
    with policy.active(DETERMINISTIC):
        state = policy.applied_state(Device.cpu)
    assert state["use_deterministic_algorithms"] is True
    assert state["cudnn_deterministic"] is True and state["cudnn_benchmark"] is False
    assert state["matmul_allow_tf32"] is False
    assert "CPU execution" in state["note"]


def test_prepare_process_env_sets_workspace_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    applied = policy.prepare_process_env([BASELINE, DETERMINISTIC], Device.cpu)
    assert applied == {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


def test_prepare_process_env_refuses_conflicting_workspaces() -> None:
    other = replace(BASELINE, cublas_workspace_config=":16:8")
    with pytest.raises(policy.PolicyError, match="process-wide"):
        policy.prepare_process_env([other, DETERMINISTIC], Device.cpu)


def test_arms_switch_flags_and_environment_and_restore_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NCCL_ALGO", raising=False)
    with policy.active(DETERMINISTIC):
        assert torch.are_deterministic_algorithms_enabled()
        assert os.environ["NCCL_ALGO"] == "Ring"
        assert os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] == "0"
    assert "NCCL_ALGO" not in os.environ
    with policy.active(BASELINE):
        assert not torch.are_deterministic_algorithms_enabled()
        assert torch.backends.cudnn.benchmark is True
        assert "NCCL_ALGO" not in os.environ


def test_fill_uninitialized_memory_is_applied_only_when_the_policy_asks() -> None:
    with policy.active(replace(DETERMINISTIC, fill_uninitialized_memory=True)):
        assert torch.empty(64).isnan().all()
        assert policy.applied_state(Device.cpu)["fill_uninitialized_memory"] is True
    with policy.active(DETERMINISTIC):
        assert policy.applied_state(Device.cpu)["fill_uninitialized_memory"] is False
