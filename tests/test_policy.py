"""Determinism policy: validated before use, applied per arm, recorded as torch reports it."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from taxbench.config import policy
from taxbench.config.schema import Device, PolicyConfig

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


# ------------------------------------------------------------------ the environment the deterministic arm runs in
BAD_ENV = [
    ("NCCL_ALGO", "Tree"),
    ("NCCL_ALGO", "Ring,Tree"),
    ("CUBLAS_WORKSPACE_CONFIG", ":1024:2"),
    ("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "1"),
]


@pytest.mark.parametrize("device", [Device.cuda, Device.cpu])
@pytest.mark.parametrize(("name", "value"), BAD_ENV)
def test_bad_value_already_in_the_environment_is_refused(name: str, value: str, device: Device) -> None:
    with pytest.raises(policy.PolicyError) as excinfo:
        policy.validate_policy(DETERMINISTIC, device, env={name: value})
    message = str(excinfo.value)
    assert f"{name}={value!r} is set in the environment" in message
    assert f"accepted: {list(policy.DETERMINISTIC_ENV_ACCEPTED[name])}" in message
    assert ("inactive on CPU" in message) is (device is Device.cpu)
    policy.validate_policy(BASELINE, device, env={name: value})  # the baseline makes no determinism promise


def test_refusal_reads_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NCCL_ALGO", "Tree")
    with pytest.raises(policy.PolicyError, match=r"NCCL_ALGO='Tree' .*unset it \(taxbench then sets Ring\)"):
        policy.validate_policy(DETERMINISTIC, Device.cuda)
    with pytest.raises(policy.PolicyError, match="NCCL_ALGO='Tree'"):
        policy.prepare_process_env([BASELINE, DETERMINISTIC], Device.cpu)  # the ranks check it again


@pytest.mark.parametrize(
    "env",
    [{"NCCL_ALGO": "CollnetDirect,CollnetChain"}, {"NCCL_ALGO": "^NVLS"}, {"CUBLAS_WORKSPACE_CONFIG": ":16:8"},
     {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}, {"NCCL_ALGO": ""}],
)
def test_accepted_environment_values_pass(env: dict[str, str]) -> None:
    policy.validate_policy(DETERMINISTIC, Device.cuda, env=env)


def test_valid_environment_values_are_kept_and_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NCCL_ALGO", "CollnetDirect")
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    monkeypatch.delenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", raising=False)
    assert policy.prepare_process_env([BASELINE, DETERMINISTIC], Device.cpu) == {}  # nothing overwritten
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    with policy.active(DETERMINISTIC):
        env = policy.applied_state(Device.cpu)["env"]
    # The user's values are kept; the unset one is filled from the policy.
    assert env["NCCL_ALGO"] == "CollnetDirect" and env["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    assert env["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] == "0"
    with policy.active(BASELINE):  # the baseline runs its own policy: NCCL's default algorithm
        assert "NCCL_ALGO" not in os.environ
        with policy.arm_environment(DETERMINISTIC):  # nested: the user's value, not the baseline's unset one
            assert os.environ["NCCL_ALGO"] == "CollnetDirect"
            assert os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] == "0"
    assert os.environ["NCCL_ALGO"] == "CollnetDirect" and "NVTE_ALLOW_NONDETERMINISTIC_ALGO" not in os.environ


def test_empty_environment_value_counts_as_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "")
    assert policy.prepare_process_env([DETERMINISTIC], Device.cpu) == {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def test_cli_refuses_a_bad_environment_value_before_launch(tmp_path, taxbench_cli) -> None:
    done = taxbench_cli("cluster=inprocess", f"experiment.out_dir={tmp_path}", "experiment.name=env",
                        "experiment.steps=12", "experiment.block_steps=6", "experiment.warmup_steps=2",
                        "experiment.resume_step=6", cwd=tmp_path, timeout=120, env={"NCCL_ALGO": "Tree"})
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("taxbench: error: NCCL_ALGO='Tree' is set in the environment")
    assert not (tmp_path / "env" / "deterministic-0").exists()  # no rank started
