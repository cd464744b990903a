"""When the runs commit a checkpoint: as often as preemption safety needs, not as often as the step count suggests.

A checkpoint costs what it writes (at moe_1t ~5 GB per GPU), so the runs commit one once experiment.checkpoint_every_s
seconds have passed since their last (and, if asked, at every multiple of experiment.checkpoint_every_steps). Commits
fall at block boundaries only, after the round's step times are taken, so none lands inside a timed step or changes
the rounds' order.

All ranks must commit after the same block (a commit is a collective). Their clocks differ, so the decision rests on
one agreed value: the longest time since the last commit over all ranks. The timed rounds carry it on the all-reduce
that already takes each round's slowest step times (taxbench.schedule.stopping); the untimed runs, which have no such
collective, reduce it on their own once per block.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from taxbench.config.schema import ExperimentConfig
from taxbench.design import checkpoint_after
from taxbench.parallel.distributed import DistContext


class CheckpointClock:
    def __init__(self, exp: ExperimentConfig, ctx: DistContext) -> None:
        self.every_s, self.every_steps, self.ctx = exp.checkpoint_every_s, exp.checkpoint_every_steps, ctx
        self.since = time.monotonic()

    def elapsed_s(self) -> float:
        """Seconds on this rank since the last commit (or since the clock started)."""
        return time.monotonic() - self.since

    def agreed_elapsed_s(self) -> float:
        """elapsed_s, the longest over all ranks (a collective when commits by time are on and ranks are many)."""
        if self.every_s <= 0:
            return 0.0
        elapsed = self.elapsed_s()
        if dist.is_initialized() and self.ctx.world_size > 1:
            value = torch.tensor([elapsed], dtype=torch.float64, device=self.ctx.device)
            dist.all_reduce(value, op=dist.ReduceOp.MAX)
            elapsed = float(value.item())
        return elapsed

    def due(self, step: int, block_steps: int, last: int, agreed_elapsed_s: float) -> bool:
        """Whether to commit after the block of `block_steps` ending at `step` (never at `last`, the run's end), given
        the agreed time since the last commit: the same answer on every rank."""
        if step >= last:
            return False
        by_time = self.every_s > 0 and agreed_elapsed_s >= self.every_s
        return by_time or checkpoint_after(step, block_steps, self.every_steps)

    def committed(self) -> None:
        self.since = time.monotonic()
