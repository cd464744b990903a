"""cluster=torchrun: ranks started by someone else (torchrun, srun in your own sbatch script, a Kubernetes PyTorchJob).

Every process runs the whole `python -m taxbench ... cluster=torchrun` command as one rank; the environment says
which: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT (torchrun, PyTorchJob), or under srun without them
SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID with the job's first node as the rendezvous host.

Rank 0 alone does what the taxbench CLI does before and after launching ranks: the pre-launch checks, claiming (and
locking) the experiment folder, the analysis and the report. The other ranks wait for it on a gloo control group:
they take rank 0's resolved config (a generated experiment.name differs per process otherwise), run their share of the
schedule, and exit with rank 0's exit code.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
from omegaconf import DictConfig

from taxbench import exit_codes
from taxbench.checkpoint.store import CheckpointError
from taxbench.config.layout_rules import layout_problems
from taxbench.config.schema import ConfigError, TaxbenchConfig, load_config
from taxbench.launchers.local import rank_failed
from taxbench.launchers.outcome import Launched, publish_launch
from taxbench.launchers.worker import rank_process, run_schedule
from taxbench.parallel.distributed import DistContext
from taxbench.preflight import prepare
from taxbench.rundir.experiment_folder import claimed, experiment_root
from taxbench.rundir.provenance import capture_launch
from taxbench.rundir.records import RunWriteError

# Rank 0's report can take a while on big runs; the other ranks wait for its exit code that long at most.
CONTROL_TIMEOUT = timedelta(hours=2)
# Where a port is derived from SLURM_JOB_ID (the range submitit uses), so every task of the job picks the same one.
DERIVED_PORTS = (20000, 60000)
START_HINT = ("start it with `torchrun --nproc-per-node N -m taxbench cluster=torchrun ...` or `srun python -m "
              "taxbench cluster=torchrun ...`, or use cluster=local to have taxbench start the ranks")


@dataclass(frozen=True)
class RankEnvironment:
    """Who this process is in a world started by an external launcher, and where the ranks meet."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str  # "torchrun" (RANK/WORLD_SIZE, also a PyTorchJob) or "srun"


def rank_environment(env: Mapping[str, str], configured_port: int = 0,
                     hostnames: Callable[[str], list[str]] | None = None) -> RankEnvironment:
    """This process's rank from the launcher's variables; ConfigError naming the variable and the fix otherwise.

    `configured_port` (cluster.master_port) is used under srun when MASTER_PORT is not set; `hostnames` expands a
    Slurm node list (default: `scontrol show hostnames`)."""
    if "RANK" in env or "WORLD_SIZE" in env:
        return _from_torchrun(env)
    if "SLURM_PROCID" in env:
        return _from_srun(env, configured_port, hostnames or slurm_hostnames)
    raise ConfigError(f"cluster=torchrun reads each rank from the environment, but neither RANK (torchrun, Kubernetes "
                      f"PyTorchJob) nor SLURM_PROCID (srun) is set; {START_HINT}")


def _from_torchrun(env: Mapping[str, str]) -> RankEnvironment:
    fix = "torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; set all four when starting ranks another way"
    world = _int_var(env, "WORLD_SIZE", fix, minimum=1)
    rank = _rank(env, "RANK", world, fix)
    local_rank = _int_var(env, "LOCAL_RANK", fix, minimum=0) if "LOCAL_RANK" in env else 0
    addr = _text_var(env, "MASTER_ADDR", f"{fix} (MASTER_ADDR: the host of rank 0)")
    _text_var(env, "MASTER_PORT", fix)
    port = _port(env["MASTER_PORT"])
    if port is None:
        raise ConfigError(f"MASTER_PORT={env['MASTER_PORT']!r} is not a TCP port in [1, 65535]; {fix}")
    return RankEnvironment(rank, world, local_rank, addr, port, "torchrun")


def _from_srun(env: Mapping[str, str], configured_port: int,
               hostnames: Callable[[str], list[str]]) -> RankEnvironment:
    fix = "run it as a task of srun (srun sets SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID), or start it with torchrun"
    world = _int_var(env, "SLURM_NTASKS", fix, minimum=1)
    rank = _rank(env, "SLURM_PROCID", world, fix)
    local_rank = _int_var(env, "SLURM_LOCALID", fix, minimum=0) if "SLURM_LOCALID" in env else 0
    addr = env.get("MASTER_ADDR") or _first_node(env, hostnames)
    port = _port(env["MASTER_PORT"]) if "MASTER_PORT" in env else configured_port or _port_for_job(env)
    if port is None:
        raise ConfigError(f"MASTER_PORT={env['MASTER_PORT']!r} is not a TCP port in [1, 65535]; export a free port "
                          "as MASTER_PORT in the sbatch script, the same for every task")
    return RankEnvironment(rank, world, local_rank, addr, port, "srun")


def _first_node(env: Mapping[str, str], hostnames: Callable[[str], list[str]]) -> str:
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise ConfigError("MASTER_ADDR is not set and neither is SLURM_JOB_NODELIST to take the job's first node "
                          "from; export MASTER_ADDR=<host of task 0> in the sbatch script")
    nodes = hostnames(nodelist)
    if not nodes:
        raise ConfigError(f"SLURM_JOB_NODELIST={nodelist!r} names no node; export MASTER_ADDR=<host of task 0>")
    return nodes[0]


def slurm_hostnames(nodelist: str) -> list[str]:
    """The hosts of a Slurm node list such as `gpu[01-04]`, expanded by `scontrol show hostnames`."""
    fix = ("export MASTER_ADDR in the sbatch script, e.g. "
           "MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1)")
    try:
        done = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                              timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(f"MASTER_ADDR is not set and `scontrol show hostnames {nodelist}` failed ({exc}); "
                          f"{fix}") from None
    if done.returncode != 0:
        last = next((line for line in reversed(done.stderr.splitlines()) if line.strip()), "no message")
        raise ConfigError(f"MASTER_ADDR is not set and `scontrol show hostnames {nodelist}` failed ({last.strip()}); "
                          f"{fix}")
    return done.stdout.split()


def _port_for_job(env: Mapping[str, str]) -> int:
    job_id = env.get("SLURM_JOB_ID")
    if not job_id:
        raise ConfigError("MASTER_PORT is not set and neither is SLURM_JOB_ID to derive one from; export "
                          "MASTER_PORT=<a free port> in the sbatch script, or set cluster.master_port")
    return random.Random(job_id).randint(*DERIVED_PORTS)


def _int_var(env: Mapping[str, str], name: str, fix: str, minimum: int) -> int:
    if name not in env:
        raise ConfigError(f"{name} is not set; {fix}")
    try:
        value = int(env[name])
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise ConfigError(f"{name}={env[name]!r} must be an integer >= {minimum}; {fix}")
    return value


def _rank(env: Mapping[str, str], name: str, world: int, fix: str) -> int:
    rank = _int_var(env, name, fix, minimum=0)
    if rank >= world:
        raise ConfigError(f"{name}={rank} must be below the world size {world}; {fix}")
    return rank


def _text_var(env: Mapping[str, str], name: str, fix: str) -> str:
    value = env.get(name, "").strip()
    if not value:
        raise ConfigError(f"{name} is not set; {fix}")
    return value


def _port(text: str) -> int | None:
    try:
        port = int(text)
    except ValueError:
        return None
    return port if 1 <= port <= 65535 else None


def sized_for_environment(raw: DictConfig, ranks: RankEnvironment) -> None:
    """Set the config's world size (cluster.cpu_ranks, or cluster.gpus on CUDA) to the launcher's, when it is 0;
    ConfigError when the config asks for another size or the recipe's layout does not fit the launcher's world."""
    key = "gpus" if raw.cluster.device == "cuda" else "cpu_ranks"
    variable = "WORLD_SIZE" if ranks.source == "torchrun" else "SLURM_NTASKS"
    configured = int(raw.cluster[key])
    if configured == 0:
        raw.cluster[key] = ranks.world_size
    elif configured != ranks.world_size:
        raise ConfigError(f"cluster.{key}={configured} but the launcher started {variable}={ranks.world_size} ranks; "
                          f"drop cluster.{key} (0 takes {variable}) or start {configured} ranks")
    problems = layout_problems(load_config(raw).recipe, ranks.world_size, f"cluster.{key}")
    if problems:
        raise ConfigError(f"{variable}={ranks.world_size} does not fit recipe {raw.recipe.name}'s parallel layout: "
                          f"{'; '.join(problems)}; start a world size that fits (torchrun --nnodes x "
                          "--nproc-per-node, srun --ntasks) or change recipe.parallel")


class ControlGroup:
    """Rank 0's decisions, handed to every other rank over a gloo group (also on CUDA, where training uses NCCL)."""

    def __init__(self) -> None:
        self.group = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)

    def from_rank_zero(self, value: Any = None) -> Any:
        """On rank 0: send `value`, return it; elsewhere: return what rank 0 sent."""
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def wait_for_all(self) -> None:
        dist.barrier(group=self.group)


@dataclass(frozen=True)
class Refused:
    """Rank 0 stopped before the schedule (bad input, a folder in use); the other ranks exit with `code` too."""

    code: int


def run_started_rank(raw: DictConfig, env: Mapping[str, str] = os.environ) -> int:
    """Run this process as one rank of an externally started world; the experiment's exit code on every rank.

    Only rank 0 prints errors that every rank hits; a ConfigError is raised there and swallowed elsewhere."""
    rank: int | None = None
    try:
        ranks = rank_environment(env, int(raw.cluster.master_port))
        rank = ranks.rank
        sized_for_environment(raw, ranks)
        local_cfg = load_config(raw)
    except ConfigError:
        if rank:
            return exit_codes.CONFIG_ERROR
        raise
    with rank_process([local_cfg], ranks.rank, ranks.world_size, ranks.local_rank, ranks.master_addr,
                      ranks.master_port) as ctx:
        control = ControlGroup()
        if ctx.rank == 0:
            return _run_rank_zero(raw, ctx, control)
        started = control.from_rank_zero()
        if isinstance(started, Refused):
            return started.code
        cfg, root = started
        _run_share(cfg, ctx, Path(root))
        control.wait_for_all()
        return int(control.from_rank_zero())


def _run_share(cfg: TaxbenchConfig, ctx: DistContext, root: Path) -> None:
    """This rank's part of the schedule; a failure of the run itself is one line naming the rank (exit 1)."""
    try:
        run_schedule(cfg, ctx, root)
    except (RunWriteError, CheckpointError) as exc:
        raise rank_failed(f"rank {ctx.rank} failed: {exc}", cfg.experiment.name) from None


def _run_rank_zero(raw: DictConfig, ctx: DistContext, control: ControlGroup) -> int:
    with ExitStack() as held:
        try:
            cfg = prepare(raw)
            root = held.enter_context(claimed(cfg, experiment_root(cfg)))
        except ConfigError:
            control.from_rank_zero(Refused(exit_codes.CONFIG_ERROR))
            raise
        control.from_rank_zero((cfg, str(root)))
        capture_launch()
        _run_share(cfg, ctx, root)
        control.wait_for_all()  # every rank's records are complete before they are analysed
        code = exit_codes.CONFIG_ERROR
        try:
            code = publish_launch(Launched(root, cfg.report))
        finally:
            # torchrun may stop rank 0 as soon as another rank exits with this code: say everything first.
            sys.stdout.flush()
            sys.stderr.flush()
            control.from_rank_zero(code)
        return code
