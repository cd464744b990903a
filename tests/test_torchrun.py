"""cluster=torchrun: ranks started by torchrun, srun or a PyTorchJob, each reading its rank from the environment.

The fast tests parse real environments and run the real CLI up to its refusal; the slow ones start real gloo worlds:
`torchrun --nproc-per-node 2 -m taxbench cluster=torchrun`, and two plain processes with srun's variables (as srun or
a one-process-per-pod PyTorchJob starts them), to see that every rank exits with rank 0's exit code.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, compose_raw, run_taxbench

from taxbench import exit_codes
from taxbench.config.schema import ConfigError
from taxbench.launchers.torchrun import (
    DERIVED_PORTS,
    RankEnvironment,
    rank_environment,
    sized_for_environment,
    slurm_hostnames,
)
from taxbench.parallel.distributed import free_port

TORCHRUN_ENV = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}
SRUN_ENV = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "4242",
            "MASTER_ADDR": "gpu01"}
SMALL = ["experiment.steps=20", "experiment.block_steps=5", "experiment.resume_step=5", "report.wandb=false"]


def no_launcher_vars() -> dict[str, str]:
    """This test process's environment without any rank variables (a CI job may run under Slurm itself)."""
    return {k: v for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
            and not k.startswith(("SLURM_", "TORCHELASTIC_"))}


def test_torchrun_variables_name_the_rank_and_the_rendezvous() -> None:
    assert rank_environment(TORCHRUN_ENV) == RankEnvironment(1, 2, 1, "node0", 29500, "torchrun")


def test_a_pytorchjob_without_local_rank_is_local_rank_zero() -> None:
    env = {k: v for k, v in TORCHRUN_ENV.items() if k != "LOCAL_RANK"}
    assert rank_environment(env).local_rank == 0


def test_srun_variables_give_the_rank_and_a_port_every_task_derives_alike() -> None:
    ranks = rank_environment(SRUN_ENV)
    assert (ranks.rank, ranks.world_size, ranks.local_rank, ranks.master_addr, ranks.source) == (3, 4, 1, "gpu01",
                                                                                                 "srun")
    assert DERIVED_PORTS[0] <= ranks.master_port <= DERIVED_PORTS[1]
    assert rank_environment({**SRUN_ENV, "SLURM_PROCID": "0"}).master_port == ranks.master_port
    assert rank_environment(SRUN_ENV, configured_port=31000).master_port == 31000
    assert rank_environment({**SRUN_ENV, "MASTER_PORT": "29400"}, configured_port=31000).master_port == 29400


def test_srun_without_master_addr_takes_the_first_node_of_the_job() -> None:
    env = {k: v for k, v in SRUN_ENV.items() if k != "MASTER_ADDR"} | {"SLURM_JOB_NODELIST": "gpu[07-08]"}
    expanded: list[str] = []

    def hostnames(nodelist: str) -> list[str]:
        expanded.append(nodelist)
        return ["gpu07", "gpu08"]

    assert rank_environment(env, hostnames=hostnames).master_addr == "gpu07"
    assert expanded == ["gpu[07-08]"]


def test_scontrol_expands_a_node_list_or_fails_naming_master_addr() -> None:
    if shutil.which("scontrol") is None:
        pytest.skip("no scontrol on this machine")
    try:
        hosts = slurm_hostnames("tb[01-03]")
    except ConfigError as exc:  # scontrol without a Slurm configuration: the message says what to export
        assert "MASTER_ADDR is not set" in str(exc) and "export MASTER_ADDR" in str(exc)
    else:
        assert hosts == ["tb01", "tb02", "tb03"]


@pytest.mark.parametrize(("env", "says"), [
    ({}, "neither RANK (torchrun, Kubernetes PyTorchJob) nor SLURM_PROCID (srun) is set"),
    ({"RANK": "0"}, "WORLD_SIZE is not set"),
    ({**TORCHRUN_ENV, "RANK": "2"}, "RANK=2 must be below the world size 2"),
    ({**TORCHRUN_ENV, "WORLD_SIZE": "two"}, "WORLD_SIZE='two' must be an integer >= 1"),
    ({k: v for k, v in TORCHRUN_ENV.items() if k != "MASTER_ADDR"}, "MASTER_ADDR is not set"),
    ({k: v for k, v in TORCHRUN_ENV.items() if k != "MASTER_PORT"}, "MASTER_PORT is not set"),
    ({**TORCHRUN_ENV, "MASTER_PORT": "70000"}, "MASTER_PORT='70000' is not a TCP port"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "MASTER_ADDR": "n0"}, "MASTER_PORT is not set and neither is "
                                                                      "SLURM_JOB_ID"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, "MASTER_ADDR is not set and neither is SLURM_JOB_NODELIST"),
])
def test_missing_or_bad_variables_are_named_with_the_fix(env: dict[str, str], says: str) -> None:
    with pytest.raises(ConfigError) as raised:
        rank_environment(env)
    assert says in str(raised.value)
    assert any(fix in str(raised.value) for fix in ("torchrun", "srun", "export", "set all four"))


def test_world_size_comes_from_the_launcher_unless_the_config_asks_for_another() -> None:
    raw = compose_raw("cluster=torchrun", "recipe.global_batch_size=16")
    sized_for_environment(raw, rank_environment({**TORCHRUN_ENV, "WORLD_SIZE": "4"}))
    assert raw.cluster.cpu_ranks == 4
    raw = compose_raw("cluster=torchrun", "cluster.cpu_ranks=4")
    with pytest.raises(ConfigError, match="cluster.cpu_ranks=4 but the launcher started WORLD_SIZE=2 ranks"):
        sized_for_environment(raw, rank_environment(TORCHRUN_ENV))


def test_a_world_that_does_not_fit_the_layout_is_refused_naming_the_launcher_variable() -> None:
    raw = compose_raw("cluster=torchrun")
    with pytest.raises(ConfigError, match=r"WORLD_SIZE=3 does not fit recipe dense_tiny's parallel layout: "
                                          r".*global_batch_size=8.*start a world size that fits"):
        sized_for_environment(raw, rank_environment({**TORCHRUN_ENV, "WORLD_SIZE": "3"}))


@pytest.mark.parametrize(("env", "says"), [
    ({}, "neither RANK"),
    ({**TORCHRUN_ENV, "RANK": "0", "MASTER_ADDR": "127.0.0.1", "WORLD_SIZE": "3"}, "WORLD_SIZE=3 does not fit"),
])
def test_the_cli_refuses_in_one_line_with_exit_2(tmp_path: Path, env: dict[str, str], says: str) -> None:
    result = subprocess.run([sys.executable, "-m", "taxbench", "cluster=torchrun", f"experiment.out_dir={tmp_path}"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            env={**no_launcher_vars(), **env})
    assert result.returncode == exit_codes.CONFIG_ERROR
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("taxbench: error: ") and says in lines[0], result.stderr
    assert not any(tmp_path.iterdir())


def test_a_rank_that_knows_it_is_not_rank_zero_leaves_the_message_to_rank_zero(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "taxbench", "cluster=torchrun", "cluster.cpu_ranks=4"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            env={**no_launcher_vars(), **TORCHRUN_ENV})
    assert result.returncode == exit_codes.CONFIG_ERROR and result.stderr == ""


def test_torchrun_is_one_experiment_per_launch_not_a_multirun(tmp_path: Path) -> None:
    result = run_taxbench("-m", "cluster=torchrun", "experiment.steps=10,20", f"experiment.out_dir={tmp_path}",
                          cwd=tmp_path, timeout=120, env={**TORCHRUN_ENV, "RANK": "0"})
    assert result.returncode == exit_codes.CONFIG_ERROR
    assert "cluster=torchrun runs one experiment per launch" in result.stderr


@pytest.mark.slow
def test_torchrun_two_ranks_complete_with_a_summary(tmp_path: Path) -> None:
    torchrun = Path(sys.executable).with_name("torchrun")
    result = subprocess.run(
        [str(torchrun), "--nproc-per-node", "2", "-m", "taxbench", "cluster=torchrun", *SMALL,
         f"experiment.out_dir={tmp_path}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
        env={**no_launcher_vars(), "PYTHONPATH": str(REPO), "COLUMNS": "200"})
    assert result.returncode == exit_codes.OK, result.stderr[-3000:]
    (root,) = tmp_path.iterdir()  # every rank used rank 0's generated experiment.name
    summary = json.loads((root / "summary.json").read_text())
    assert summary["outcome"] == "passed" and summary["deterministic_ok"] is True
    # rank 0 alone printed the summary: each gate once
    gate_lines = re.findall(r"^(repeatability|restart_replay|baseline_sanity) +bitwise identical", result.stdout, re.M)
    assert sorted(gate_lines) == ["baseline_sanity", "repeatability", "restart_replay"]
    assert (root / "report" / "report.html").is_file()
    manifest = json.loads((root / "deterministic-0" / "manifest.json").read_text())
    assert manifest["config"]["cluster"]["launcher"] == "torchrun"
    assert manifest["config"]["cluster"]["cpu_ranks"] == 2 and len(manifest["stack"]["ranks"]) == 2
    assert manifest["provenance"]["overrides"][0] == "cluster=torchrun"


@pytest.mark.slow
def test_every_srun_task_exits_with_rank_zeros_code(tmp_path: Path) -> None:
    """Two processes started as srun (or a PyTorchJob with one process per pod) starts them; a planted fault fails
    the repeatability gate, and both tasks exit 3."""
    env = {**no_launcher_vars(), "SLURM_NTASKS": "2", "SLURM_JOB_ID": "77", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "taxbench", "cluster=torchrun", *SMALL, "report.html=false",
               f"experiment.out_dir={tmp_path}", "experiment.name=faulted", "experiment.fault.enabled=true",
               "experiment.fault.step=3", "experiment.fault.rank=1"]
    tasks = [subprocess.Popen(command, cwd=tmp_path, env={**env, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outputs = [task.communicate(timeout=600) for task in tasks]
    assert [task.returncode for task in tasks] == [exit_codes.NOT_DETERMINISTIC] * 2, outputs[0][1][-3000:]
    assert "step 3, rank 1, params" in outputs[0][0]
    assert outputs[1][0] == ""  # the summary is rank 0's to print
    summary = json.loads((tmp_path / "faulted" / "summary.json").read_text())
    assert summary["outcome"] != "passed"
