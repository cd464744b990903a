"""When the runs commit a checkpoint: as often as preemption safety needs, not as often as the step count suggests.

A checkpoint costs what it writes (at moe_1t ~5 GB per GPU), so the runs commit one once experiment.checkpoint_every_s
seconds have passed since their last (and, if asked, at every multiple of experiment.checkpoint_every_steps). Commits
fall at block boundaries only, after the round's step times are taken, so none lands inside a timed step or changes
the rounds' order.

All ranks must commit after the same block (a commit is a collective). Their clocks differ, so the decision rests on
one agreed value: the longest time since the last commit over all ranks. The timed rounds carry it on the all-reduce
that already takes each round's slowest step times (taxbench.schedule.stopping); the untimed runs, which have no such
collective, reduce it on their own after each stretch of UNTIMED_STRETCH_BLOCKS blocks (they run in stretches: one
activation, barrier and agreement each, instead of one per block, which cost more than a small step).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from taxbench.config.schema import ExperimentConfig
from taxbench.design import checkpoint_after
from taxbench.parallel.distributed import DistContext

UNTIMED_STRETCH_BLOCKS = 10  # a commit by time comes at most this many blocks late (at moe_1t, well under a minute)


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

    def next_decision(self, step: int, block_steps: int, until: int) -> int:
        """The step an untimed run at `step` runs to before it next decides whether to commit: the end of its stretch,
        of the block a commit by steps falls in, or `until`, whichever comes first."""
        stride = block_steps * UNTIMED_STRETCH_BLOCKS
        end = (step // stride + 1) * stride
        if self.every_steps > 0:
            next_commit = (step // self.every_steps + 1) * self.every_steps
            end = min(end, -(-next_commit // block_steps) * block_steps)
        return min(end, until)

    def due(self, step: int, steps: int, last: int, agreed_elapsed_s: float) -> bool:
        """Whether to commit after the `steps` steps (a block, or an untimed stretch) ending at `step` (never at
        `last`, the run's end), given the agreed time since the last commit: the same answer on every rank."""
        if step >= last:
            return False
        by_time = self.every_s > 0 and agreed_elapsed_s >= self.every_s
        return by_time or checkpoint_after(step, steps, self.every_steps)

    def committed(self) -> None:
        self.since = time.monotonic()
