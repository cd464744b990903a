"""Local launchers: ranks as processes on this machine (gloo on CPU, NCCL on GPU), or one rank in-process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from taxbench.config import TaxbenchConfig, world_size
from taxbench.distributed import free_port
from taxbench.launchers.worker import run_rank


def _spawned(local_rank: int, world: int, cfg_container: dict[str, Any], root: str, addr: str, port: int) -> None:
    run_rank(local_rank, world, local_rank, cfg_container, root, addr, port)


def launch_local(cfg: TaxbenchConfig, cfg_container: dict[str, Any], root: Path) -> None:
    world = world_size(cfg.cluster)
    addr = cfg.cluster.master_addr
    port = cfg.cluster.master_port or free_port(addr)
    mp.start_processes(_spawned, args=(world, cfg_container, str(root), addr, port), nprocs=world,
                       join=True, start_method="spawn")


def launch_inprocess(cfg: TaxbenchConfig, cfg_container: dict[str, Any], root: Path) -> None:
    addr = cfg.cluster.master_addr
    run_rank(0, 1, 0, cfg_container, str(root), addr, cfg.cluster.master_port or free_port(addr))
