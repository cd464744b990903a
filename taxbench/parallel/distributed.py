"""Process-group setup: gloo on CPU, NCCL on CUDA, one communicator per arm."""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from taxbench.config.schema import Device, PolicyConfig
from taxbench.runtime.determinism import arm_environment


@dataclass
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    _arm_groups: dict[str, dist.ProcessGroup] = field(default_factory=dict)
    meshes: dict[Any, Any] = field(default_factory=dict)  # DeviceMeshes per (arm, mesh shape): taxbench.parallel.layout
    ready_unix: float | None = None  # when the default process group was up (the startup's cost split)
    _block_barrier: Any = None  # the barrier a block started for the next one, in flight (see begin_next_block)

    def begin_next_block(self) -> None:
        """Start the next block's barrier as this block's last timed step ends, where the next block follows at once
        (the blocks of a round). It is in flight while this rank does the untimed work between the blocks
        (fingerprints, records, the arm switch, the next batches: the same work on every rank), so that a
        collective's latency (about 1 ms on gloo on a 2-core machine) hides that work instead of adding to it, and
        the next block still starts its timed steps together."""
        if self._block_barrier is None and self.world_size > 1 and dist.is_initialized():
            self._block_barrier = dist.barrier(async_op=True)

    def block_start(self, together: bool) -> Any:
        """The barrier a block waits on before its first timed step: the one in flight, else a new one; none where
        the ranks have just left a collective together (`together`: one in flight completed before it)."""
        pending, self._block_barrier = self._block_barrier, None
        if together:
            if pending is not None:
                pending.wait()
            return None
        if pending is not None or self.world_size == 1 or not dist.is_initialized():
            return pending
        return dist.barrier(async_op=True)

    def settle_block_barrier(self) -> None:
        """Wait for a barrier in flight that no block will take (the last block of a run)."""
        pending, self._block_barrier = self._block_barrier, None
        if pending is not None:
            pending.wait()

    def group_for(self, policy: PolicyConfig) -> dist.ProcessGroup:
        """A communicator created under this arm's NCCL_ALGO and NCCL_PROTO (NCCL reads them at communicator
        creation) and with its pinned channel count in the communicator's own config (NCCL caches NCCL_MIN_NCHANNELS
        and NCCL_MAX_NCHANNELS for the process at their first read, so the environment alone would let whichever arm
        came first pin both)."""
        if policy.name not in self._arm_groups:
            with arm_environment(policy):
                self._arm_groups[policy.name] = dist.new_group(list(range(self.world_size)), backend=self.backend,
                                                               pg_options=nccl_options(self.backend, policy))
        return self._arm_groups[policy.name]


def nccl_options(backend: str, policy: PolicyConfig) -> Any:
    """ProcessGroupNCCL options pinning the arm's channels (CTAs) per communicator; None: nothing to pin (or gloo)."""
    if backend != "nccl" or policy.nccl_channels is None:
        return None
    options = dist.ProcessGroupNCCL.Options()
    options.config.min_ctas = options.config.max_ctas = policy.nccl_channels
    return options


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def init(
    rank: int, world_size: int, local_rank: int, device: Device, master_addr: str, master_port: int
) -> DistContext:
    if device is Device.cuda:
        if not torch.cuda.is_available():
            raise RuntimeError(
                "cluster.device=cuda but torch sees no CUDA device (torch "
                f"{torch.__version__}); use cluster.device=cpu or a CUDA build of torch on a GPU node"
            )
        torch.cuda.set_device(local_rank)
        torch_device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        torch_device, backend = torch.device("cpu"), "gloo"
    os.environ["MASTER_ADDR"] = master_addr
    os.environ["MASTER_PORT"] = str(master_port)
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(minutes=10),
            device_id=torch_device if backend == "nccl" else None,
        )
    return DistContext(rank, world_size, local_rank, torch_device, backend, ready_unix=time.time())


def simulate(rank: int, world_size: int) -> DistContext:
    """Be rank `rank` of a world of `world_size` simulated in this process with torch's fake process group:
    collectives return at once and move no data. For building one rank's share of a world this machine cannot start
    (benchmarks/rank_build.py); nothing it computes across ranks is meaningful."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    shutdown()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    return DistContext(rank, world_size, 0, torch.device("cpu"), "fake")


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
