"""When the interleaved rounds stop: after experiment.steps, or at the precision asked for.

With experiment.target_half_width > 0 the rounds go on past `steps` until the tax interval's half-width is at most
the target (a Chow-Robbins fixed-width rule: the half-width depends on the spread, not on the estimate, so stopping
on it leaves the estimate unbiased), or until the step cap. The rule looks at `steps` and then each time the runs
have grown by 10% (fewer looks, less optional stopping, and a look is an estimate over every step so far), and never
before MIN_ROUNDS post-warmup rounds, so that an early, lucky small spread cannot stop it; benchmarks/calibration.py
measures the coverage this gives.

Every rank holds the slowest rank's time per step (an all-reduce of each round's times), rank 0 applies the analysis's
own estimator to them, and its decision is broadcast, so all ranks stop after the same round.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import pandas as pd
import torch
import torch.distributed as dist

from taxbench.config.schema import ExperimentConfig, max_steps
from taxbench.design import RunRef
from taxbench.parallel.distributed import DistContext
from taxbench.rundir.records import steps_file
from taxbench.rundir.step_record import BLOCK, RANK, STEP, TIME_S
from taxbench.rundir.stop_file import CAP, STEPS, TARGET, Stop, read_commits
from taxbench.stats.tax import Checkpoints, estimate_tax

MIN_ROUNDS = 10  # post-warmup rounds before the precision rule may stop
LOOK_GROWTH = 1.1  # after `steps`, the rule looks again once the runs are 10% longer (a look costs an estimate)


class StoppingRule:
    def __init__(self, exp: ExperimentConfig, runs: Sequence[RunRef], ctx: DistContext) -> None:
        self.exp, self.runs, self.ctx = exp, tuple(runs), ctx
        self.cap = max_steps(exp)
        self.times: dict[str, list[float]] = {ref.name: [] for ref in self.runs}  # slowest rank, steps 1..n
        self.half_width: float | None = None
        self.next_look = exp.steps
        self.commits: set[int] = set()  # steps after which the runs committed a checkpoint

    def add_round(self, local: dict[str, list[float]], elapsed_s: float = 0.0) -> float:
        """One round's step times on this rank, per run; kept as the slowest rank's. Returns `elapsed_s` (this
        rank's time since the last checkpoint commit) as the longest of any rank: it rides on the same all-reduce,
        so that every rank agrees when to commit at no extra collective (taxbench.schedule.checkpoint_clock)."""
        slowest, elapsed_s = self._slowest([local[name] for name in self.times], elapsed_s)
        for name, values in zip(self.times, slowest, strict=True):
            self.times[name] += values
        return elapsed_s

    def committed(self, step: int) -> None:
        """The runs committed a checkpoint after `step`: the next step is left out of the estimate."""
        self.commits.add(step)

    def resume(self, root: Path, step: int) -> None:
        """The times of steps 1..step of an interrupted experiment, from each rank's own records."""
        local = []
        for ref in self.runs:
            by_step = {}
            with steps_file(root / ref.name, self.ctx.rank).open(encoding="utf-8") as stream:
                for line in stream:
                    record = json.loads(line)
                    if record[STEP] <= step:
                        by_step[record[STEP]] = float(record[TIME_S])
            local.append([by_step[s] for s in range(1, step + 1)])
        for name, values in zip(self.times, self._slowest(local)[0], strict=True):
            self.times[name] = values
        self.commits = set(read_commits(root, step))

    def _slowest(self, local: list[list[float]], extra: float = 0.0) -> tuple[list[list[float]], float]:
        """Each run's times as the slowest rank's, and `extra` as the largest of any rank (one all-reduce)."""
        flat = torch.tensor([value for row in local for value in row] + [extra], dtype=torch.float64)
        if dist.is_initialized() and self.ctx.world_size > 1:
            on_device = flat.to(self.ctx.device)
            dist.all_reduce(on_device, op=dist.ReduceOp.MAX)
            flat = on_device.cpu()
        values = flat.tolist()
        rows, start = [], 0
        for row in local:
            rows.append(values[start:start + len(row)])
            start += len(row)
        return rows, values[-1]

    def stop_after(self, step: int) -> Stop | None:
        """The stop after the round ending at `step`, or None to run another round (the same on every rank)."""
        if self.exp.target_half_width <= 0:
            return Stop(step, STEPS, None, self.recorded_commits()) if step >= self.exp.steps else None
        if step < self.next_look and step < self.cap:
            return None
        self.next_look = max(step + 1, math.ceil(step * LOOK_GROWTH))
        reached = self._precise_enough(step) if self.ctx.rank == 0 else False
        if dist.is_initialized() and self.ctx.world_size > 1:
            flag = torch.tensor([int(reached)], device=self.ctx.device)
            dist.broadcast(flag, src=0)
            reached = bool(flag.item())
        if reached:
            return Stop(step, TARGET, self.half_width, self.recorded_commits())
        return Stop(step, CAP, self.half_width, self.recorded_commits()) if step >= self.cap else None

    def recorded_commits(self) -> tuple[int, ...]:
        return tuple(sorted(self.commits))

    def _precise_enough(self, step: int) -> bool:
        block = self.exp.block_steps
        frames = {
            name: pd.DataFrame({STEP: range(1, step + 1), RANK: 0, TIME_S: values,
                                BLOCK: [(s - 1) // block for s in range(1, step + 1)]})
            for name, values in self.times.items()
        }
        arms = {arm: [frames[ref.name] for ref in self.runs if ref.arm == arm] for arm in ("baseline", "deterministic")}
        try:
            estimate = estimate_tax(arms["baseline"], arms["deterministic"], self.exp.warmup_steps,
                                    self.exp.confidence, Checkpoints(0, block, frozenset(self.commits)))
        except ValueError:  # no round after the warmup yet
            return False
        self.half_width = estimate.half_width if math.isfinite(estimate.half_width) else None
        return (estimate.pairs >= MIN_ROUNDS and self.half_width is not None
                and self.half_width <= self.exp.target_half_width)
