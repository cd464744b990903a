"""Determinism policy: validated before use, applied per arm, recorded as torch reports it."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest
import torch
from helpers import compose_config

from taxbench.config import policy
from taxbench.config.schema import Device, PolicyConfig
from taxbench.runtime import determinism

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
    with determinism.active(DETERMINISTIC):
        state = determinism.applied_state(Device.cpu)
    assert state["use_deterministic_algorithms"] is True
    assert state["cudnn_deterministic"] is True and state["cudnn_benchmark"] is False
    assert state["matmul_allow_tf32"] is False
    assert "CPU execution" in state["note"]


def test_prepare_process_env_sets_workspace_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    applied = determinism.prepare_process_env([BASELINE, DETERMINISTIC], Device.cpu)
    assert applied == {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


def test_prepare_process_env_refuses_conflicting_workspaces() -> None:
    other = replace(BASELINE, cublas_workspace_config=":16:8")
    with pytest.raises(policy.PolicyError, match="process-wide"):
        determinism.prepare_process_env([other, DETERMINISTIC], Device.cpu)


def test_arms_switch_flags_and_environment_and_restore_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NCCL_ALGO", raising=False)
    with determinism.active(DETERMINISTIC):
        assert torch.are_deterministic_algorithms_enabled()
        assert os.environ["NCCL_ALGO"] == "Ring"
        assert os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] == "0"
    assert "NCCL_ALGO" not in os.environ
    with determinism.active(BASELINE):
        assert not torch.are_deterministic_algorithms_enabled()
        assert torch.backends.cudnn.benchmark is True
        assert "NCCL_ALGO" not in os.environ


def test_fill_uninitialized_memory_is_applied_only_when_the_policy_asks() -> None:
    with determinism.active(replace(DETERMINISTIC, fill_uninitialized_memory=True)):
        assert torch.empty(64).isnan().all()
        assert determinism.applied_state(Device.cpu)["fill_uninitialized_memory"] is True
    with determinism.active(DETERMINISTIC):
        assert determinism.applied_state(Device.cpu)["fill_uninitialized_memory"] is False


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
        determinism.prepare_process_env([BASELINE, DETERMINISTIC], Device.cpu)  # the ranks check it again


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
    assert determinism.prepare_process_env([BASELINE, DETERMINISTIC], Device.cpu) == {}  # nothing overwritten
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    with determinism.active(DETERMINISTIC):
        env = determinism.applied_state(Device.cpu)["env"]
    # The user's values are kept; the unset one is filled from the policy.
    assert env["NCCL_ALGO"] == "CollnetDirect" and env["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    assert env["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] == "0"
    with determinism.active(BASELINE):  # the baseline runs its own policy: NCCL's default algorithm
        assert "NCCL_ALGO" not in os.environ
        with determinism.arm_environment(DETERMINISTIC):  # nested: the user's value, not the baseline's unset one
            assert os.environ["NCCL_ALGO"] == "CollnetDirect"
            assert os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] == "0"
    assert os.environ["NCCL_ALGO"] == "CollnetDirect" and "NVTE_ALLOW_NONDETERMINISTIC_ALGO" not in os.environ


def test_empty_environment_value_counts_as_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "")
    assert determinism.prepare_process_env([DETERMINISTIC], Device.cpu) == {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def test_cli_refuses_a_bad_environment_value_before_launch(tmp_path, taxbench_cli) -> None:
    done = taxbench_cli("cluster=inprocess", f"experiment.out_dir={tmp_path}", "experiment.name=env",
                        "experiment.steps=12", "experiment.block_steps=6", "experiment.warmup_steps=2",
                        "experiment.resume_step=6", cwd=tmp_path, timeout=120, env={"NCCL_ALGO": "Tree"})
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("taxbench: error: NCCL_ALGO='Tree' is set in the environment")
    assert not (tmp_path / "env" / "deterministic-0").exists()  # no rank started


# ------------------------------------------------------ the two NCCL policies: Megatron's Ring, torchtitan's Tree
TREE = replace(DETERMINISTIC, nccl_algo="Ring;allreduce:Tree", nccl_proto="Simple", nccl_channels=1)


@pytest.mark.parametrize("device", [Device.cuda, Device.cpu])
@pytest.mark.parametrize("pinned", [TREE, replace(TREE, nccl_channels=4), replace(DETERMINISTIC, nccl_proto="Simple")])
def test_ring_and_the_pinned_tree_are_accepted(pinned: PolicyConfig, device: Device) -> None:
    policy.validate_policy(DETERMINISTIC, device, env={})
    policy.validate_policy(pinned, device, env={})


@pytest.mark.parametrize("device", [Device.cuda, Device.cpu])
@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"nccl_proto": None}, "nccl_proto=None, nccl_channels=1: a Tree all-reduce is deterministic only pinned"),
        ({"nccl_channels": None}, "nccl_proto='Simple', nccl_channels=None: a Tree all-reduce is deterministic only"),
        ({"nccl_algo": "Tree"}, "nccl_algo='Tree' is not accepted for deterministic runs (a bare Tree leaves"),
        ({"nccl_algo": "allreduce:tree"}, "nccl_algo='allreduce:tree' is not accepted"),
        ({"nccl_proto": "LL128"}, "nccl_proto='LL128' cannot be vouched for"),
        ({"nccl_channels": 0}, "nccl_channels=0 must be >= 1"),
    ],
)
def test_an_unpinned_tree_and_bad_nccl_values_are_refused_with_the_fix(change: dict, expected: str,
                                                                       device: Device) -> None:
    with pytest.raises(policy.PolicyError) as excinfo:
        policy.validate_policy(replace(TREE, **change), device, env={})
    message = str(excinfo.value)
    assert expected in message and "\n" not in message
    assert "nccl_proto=Simple and nccl_channels=1" in message or "or null" in message
    policy.validate_policy(replace(BASELINE, **change), device, env={})  # the baseline makes no determinism promise


def test_a_tree_arm_gets_its_pinned_environment_and_the_baseline_does_not(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in policy.PER_ARM_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    with determinism.active(TREE):
        env = determinism.applied_state(Device.cpu)
    assert env["env"]["NCCL_ALGO"] == "Ring;allreduce:Tree" and env["env"]["NCCL_PROTO"] == "Simple"
    assert env["env"]["NCCL_MIN_NCHANNELS"] == env["env"]["NCCL_MAX_NCHANNELS"] == "1"
    assert env["nccl"] == {"algo": "Ring;allreduce:Tree", "proto": "Simple", "channels": ["1", "1"], "active": False}
    assert "gloo runs the collectives" in env["note"]
    with determinism.active(BASELINE):
        assert not any(name in os.environ for name in policy.PER_ARM_ENV_VARS[:-1])
    # A site's protocol setting stays for the arms that do not pin one (the baseline, Megatron's Ring).
    monkeypatch.setenv("NCCL_PROTO", "^LL128")
    for unpinned in (BASELINE, DETERMINISTIC):
        with determinism.active(unpinned):
            assert os.environ["NCCL_PROTO"] == "^LL128" and "NCCL_MIN_NCHANNELS" not in os.environ


@pytest.mark.parametrize(
    ("arm", "name", "value"),
    [(TREE, "NCCL_ALGO", "Ring"), (TREE, "NCCL_PROTO", "LL"), (TREE, "NCCL_MIN_NCHANNELS", "4"),
     (TREE, "NCCL_MAX_NCHANNELS", "32"), (DETERMINISTIC, "NCCL_ALGO", "Ring;allreduce:Tree")],
)
def test_an_environment_overriding_the_arms_nccl_setting_is_refused(arm: PolicyConfig, name: str, value: str) -> None:
    with pytest.raises(policy.PolicyError) as excinfo:
        policy.validate_policy(arm, Device.cpu, env={name: value})
    assert f"{name}={value!r} is set in the environment" in str(excinfo.value)
    assert f"accepted: {list(policy.env_accepted(arm)[name])}" in str(excinfo.value)


def test_the_environment_check_accepts_exactly_what_the_arm_sets() -> None:
    for arm in (TREE, DETERMINISTIC):
        set_by_arm = {k: v for k, v in policy.policy_env(arm).items() if v is not None}
        policy.validate_policy(arm, Device.cuda, env=set_by_arm)  # e.g. a rank started inside the arm's block


def test_the_deterministic_tree_mode_composes_to_torchtitans_policy() -> None:
    cfg = compose_config("mode@arms.deterministic=deterministic_tree")
    tree = cfg.arms["deterministic"]
    assert (tree.nccl_algo, tree.nccl_proto, tree.nccl_channels) == ("Ring;allreduce:Tree", "Simple", 1)
    assert tree.name == "deterministic" and tree.deterministic and tree.deterministic_kernels
    ring = compose_config().arms["deterministic"]
    # The two modes differ in the NCCL policy only.
    assert {k for k, v in vars(tree).items() if vars(ring)[k] != v} == {"nccl_algo", "nccl_proto", "nccl_channels"}
    assert (ring.nccl_algo, ring.nccl_proto, ring.nccl_channels) == ("Ring", None, None)
    lines = policy.audit(tree, "taxbench")  # what a stack-native arm with this switch would be told
    assert [line.split(" ")[3] for line in lines] == ["NCCL_ALGO", "NCCL_PROTO",
                                                      "NCCL_MIN_NCHANNELS/NCCL_MAX_NCHANNELS"]


def test_cli_refuses_an_unpinned_tree_in_one_line(tmp_path, taxbench_cli) -> None:
    done = taxbench_cli("mode@arms.deterministic=deterministic_tree", "arms.deterministic.nccl_channels=null",
                        f"experiment.out_dir={tmp_path}", "experiment.name=tree", cwd=tmp_path, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "a Tree all-reduce is deterministic only pinned" in lines[0], lines
    assert lines[0].startswith("taxbench: error: ") and lines[0].endswith("nccl_channels=1 "
                                                                           "(mode@arms.deterministic=deterministic_tree)")


@pytest.mark.slow
def test_a_deterministic_tree_pair_runs_on_two_gloo_ranks_and_records_its_nccl_settings(tmp_path, taxbench_cli) -> None:
    done = taxbench_cli("mode@arms.deterministic=deterministic_tree", "experiment.steps=6", "experiment.warmup_steps=1",
                        "experiment.resume_step=3", "experiment.block_steps=3", "experiment.checkpoint_every_steps=3",
                        "report.wandb=false", f"experiment.out_dir={tmp_path}", "experiment.name=tree", cwd=tmp_path,
                        timeout=600, env={name: "" for name in policy.PER_ARM_ENV_VARS})
    assert done.returncode == 0, done.stderr[-3000:]
    manifest = json.loads((tmp_path / "tree" / "deterministic-0" / "manifest.json").read_text())
    recorded = manifest["policy"]
    assert (recorded["nccl_algo"], recorded["nccl_proto"], recorded["nccl_channels"]) == ("Ring;allreduce:Tree",
                                                                                         "Simple", 1)
    applied = manifest["policy_applied"]
    assert applied["nccl"] == {"algo": "Ring;allreduce:Tree", "proto": "Simple", "channels": ["1", "1"],
                               "active": False}  # gloo: recorded, never read
    assert applied["env"]["NCCL_MIN_NCHANNELS"] == applied["env"]["NCCL_MAX_NCHANNELS"] == "1"
    baseline = json.loads((tmp_path / "tree" / "baseline-0" / "manifest.json").read_text())["policy_applied"]
    assert baseline["nccl"] == {"algo": None, "proto": None, "channels": [None, None], "active": False}


def test_a_rocm_build_of_torch_is_refused_for_a_deterministic_cuda_arm(monkeypatch: pytest.MonkeyPatch) -> None:
    """ROCm's torch reports its GPUs as CUDA; taxbench cannot vouch for its kernels. The torch build is a runtime
    fact: config/ validates the policy without importing torch, runtime/ adds the build."""
    monkeypatch.setattr(torch.version, "hip", "6.2.0")
    with pytest.raises(policy.PolicyError, match="ROCm/HIP"):
        determinism.validate_on_this_build(DETERMINISTIC, Device.cuda, env={})
    with pytest.raises(policy.PolicyError, match="ROCm/HIP"):
        determinism.prepare_process_env([BASELINE, DETERMINISTIC], Device.cuda)
    determinism.validate_on_this_build(DETERMINISTIC, Device.cpu, env={})  # CPU: torch's own algorithms
    determinism.validate_on_this_build(BASELINE, Device.cuda, env={})  # the baseline makes no determinism promise
