"""Non-finite training: the first step and rank at which a run's loss or gradient norm was NaN or infinite.

Bitwise agreement on non-finite values proves nothing about determinism: once a NaN reaches the parameters every later
step computes NaN whatever order its sums took, so two runs agree bit for bit on a diverged trajectory however
nondeterministic their kernels are. The bits before the first non-finite step still count; after it they are no
evidence. So an experiment whose deterministic runs trained on non-finite values is never a pass: its outcome is
"diverged" (exit 4, incomplete evidence: no verdict either way, README "exit codes"), unless a gate already proved a
difference (exit 3 outranks it). Non-finite baseline runs are named too; they do not decide the determinism outcome.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd

from taxbench.rundir.step_record import GRAD_NORM, LOSS, RANK, STEP

WATCHED = (LOSS, GRAD_NORM)  # the recorded scalars (float values of the bits the fingerprints hold)


@dataclass(frozen=True)
class NonFinite:
    """A run's first non-finite value of one metric."""

    run: str
    metric: str  # "loss" or "grad_norm"
    value: str  # "NaN", "+Inf" or "-Inf"
    step: int
    rank: int
    records: int  # how many of the run's records hold a non-finite value of this metric

    @property
    def deterministic(self) -> bool:
        return self.run.startswith("deterministic")

    def describe(self) -> str:
        more = f" ({self.records} records non-finite)" if self.records > 1 else ""
        return f"{self.run}: {self.metric} {self.value} first at step {self.step}, rank {self.rank}{more}"

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def _value_text(value: float) -> str:
    return "NaN" if math.isnan(value) else "+Inf" if value > 0 else "-Inf"


def first_nonfinite(run: str, frame: pd.DataFrame) -> list[NonFinite]:
    """The run's first non-finite loss and gradient norm (by step, then rank), one finding per metric."""
    found = []
    for metric in WATCHED:
        if metric not in frame or frame.empty:
            continue
        values = frame[metric].to_numpy(dtype=np.float64, na_value=np.nan)
        bad = ~np.isfinite(values)
        if not bad.any():
            continue
        steps, ranks = frame[STEP].to_numpy()[bad], frame[RANK].to_numpy()[bad]
        first = int(np.lexsort((ranks, steps))[0])
        found.append(NonFinite(run, metric, _value_text(float(values[bad][first])), int(steps[first]),
                               int(ranks[first]), int(bad.sum())))
    return found


def nonfinite_runs(runs: dict[str, pd.DataFrame]) -> list[NonFinite]:
    """Every run's first non-finite loss and gradient norm, in the order of `runs`."""
    return [finding for name, frame in runs.items() for finding in first_nonfinite(name, frame)]
