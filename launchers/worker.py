"""What every rank runs, whoever started it: set up the process, run the experiment schedule, tear down."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from taxbench import distributed, policy
from taxbench.config import to_typed
from taxbench.experiment import Experiment, total_steps
from taxbench.progress import step_progress


def run_rank(rank: int, world_size: int, local_rank: int, cfg_container: dict[str, Any], root: str,
             master_addr: str, master_port: int) -> None:
    cfg = to_typed(cfg_container)
    threads = cfg.cluster.threads_per_rank
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    torch.set_num_threads(threads)
    # Before the first CUDA op: cuBLAS reads its workspace config once per process.
    policy.prepare_process_env(cfg.arms.values(), cfg.cluster.device)
    ctx = distributed.init(rank, world_size, local_rank, cfg.cluster.device, master_addr, master_port)
    try:
        with step_progress(total_steps(cfg), f"{cfg.experiment.name}", enabled=rank == 0) as on_step:
            Experiment(cfg, ctx, Path(root), on_step).run()
    finally:
        distributed.shutdown()
