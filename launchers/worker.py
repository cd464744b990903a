"""What every rank runs, whoever started it: set up the process, run the experiment schedule, tear down."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

from taxbench.config.schema import TaxbenchConfig
from taxbench.diagnostics import stacks_quieted
from taxbench.parallel import distributed
from taxbench.parallel.distributed import DistContext
from taxbench.progress import step_progress
from taxbench.runtime import determinism
from taxbench.schedule.experiment import Experiment, total_steps
from taxbench.schedule.repeats import REPLICAS, RepeatedRuns
from taxbench.schedule.rerun import Rerun


@contextmanager
def rank_process(cfgs: Sequence[TaxbenchConfig], rank: int, world_size: int, local_rank: int, master_addr: str,
                 master_port: int) -> Iterator[DistContext]:
    """Set this process up as one rank for runs of `cfgs` (threads, determinism env, process group); tear down."""
    cluster = cfgs[0].cluster
    os.environ.setdefault("OMP_NUM_THREADS", str(cluster.threads_per_rank))
    torch.set_num_threads(cluster.threads_per_rank)
    # Before the first CUDA op: cuBLAS reads its workspace config once per process.
    determinism.prepare_process_env([p for cfg in cfgs for p in cfg.arms.values()], cluster.device)
    ctx = distributed.init(rank, world_size, local_rank, cluster.device, master_addr, master_port)
    try:
        with stacks_quieted():
            yield ctx
    finally:
        distributed.shutdown()


def run_rank(rank: int, world_size: int, local_rank: int, cfg: TaxbenchConfig, root: str,
             master_addr: str, master_port: int) -> None:
    with rank_process([cfg], rank, world_size, local_rank, master_addr, master_port) as ctx:
        run_schedule(cfg, ctx, Path(root))


def run_schedule(cfg: TaxbenchConfig, ctx: DistContext, root: Path) -> None:
    """This rank's share of the experiment schedule (rank 0 shows the progress)."""
    with step_progress(total_steps(cfg), f"{cfg.experiment.name}", enabled=ctx.rank == 0) as progress:
        Experiment(cfg, ctx, root, progress).run()


def run_repeats_rank(rank: int, world_size: int, local_rank: int, cfg: TaxbenchConfig, root: str,
                     master_addr: str, master_port: int, arm: str) -> None:
    """This rank's share of two whole runs of `arm` (taxbench layouts: one layout's folder)."""
    with rank_process([cfg], rank, world_size, local_rank, master_addr, master_port) as ctx, \
            step_progress(len(REPLICAS) * cfg.experiment.steps, Path(root).name, enabled=rank == 0) as progress:
        RepeatedRuns(cfg, ctx, Path(root), arm, progress).run()


def run_rerun_rank(rank: int, world_size: int, local_rank: int, cfg: TaxbenchConfig, root: str,
                   master_addr: str, master_port: int) -> None:
    """This rank's share of one run of the deterministic arm (taxbench verify's rerun)."""
    with rank_process([cfg], rank, world_size, local_rank, master_addr, master_port) as ctx, \
            step_progress(cfg.experiment.steps, Path(root).name, enabled=rank == 0) as progress:
        Rerun(cfg, ctx, Path(root), progress).run()
