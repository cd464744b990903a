"""Baseline equivalence: does the deterministic recipe train like the baseline, within the baseline's own noise?

The third gate of Megatron-LM's determinism proposal (#5785). It is statistical, not bitwise, and kept apart from the
bitwise gates: its verdict never changes `deterministic_ok`, the outcome or the exit code.

Step by step, never pooled. Every run sees the same batches in the same order, so comparing runs at the same step
cancels the batch-to-batch variation of the loss and leaves what differs between the runs' parameters. The loss falls
over training and the run-to-run spread grows as nondeterministic trajectories part, so the deviation and its
yardstick are both taken per step.

The yardstick. When the baseline is nondeterministic, baseline-0 and baseline-1 differ only by run-to-run noise. With
b0, b1 and d the job's loss (mean over ranks) of baseline-0, baseline-1 and deterministic-0 at step t, for every step
after experiment.warmup_steps:

    center(t) = (b0 + b1) / 2        gap(t) = |b1 - b0|        deviation(t) = |d - center|
    band(t)   = max(BAND_FACTOR * rms_gap(t), RELATIVE_FLOOR * |center(t)|)

rms_gap(t) is the root mean square of the gap over a centred window of NOISE_WINDOW steps: one step's gap can be near
zero by chance, and two runs can stay close for a stretch of steps, yet the window is short enough to follow the
drift. If the three losses at step t scatter with one standard deviation sigma(t) about a common mean (the
deterministic run being one more draw), E[gap^2] = 2 sigma^2 and E[deviation^2] = 1.5 sigma^2, so a deviation leaves a
band of 3 x rms_gap only beyond 3.46 of its own standard deviations: about 0.05% of steps for Gaussian noise, more
once the window's estimation error and heavier tails are counted.

The statistic is the share of compared steps whose deviation lies inside the band; the deterministic curve is
"equivalent within baseline noise" when at least REQUIRED_SHARE of its steps do. A share rather than the maximum: a
long run has many chances for one outlying step (a loss spike where runs part briefly), while a curve that is offset
or diverges leaves the band on most steps. This is a tolerance check (is the deterministic curve as close to the
baselines as they are to each other), not a test for any offset at all: losses of neighbouring steps are correlated,
so averaging over steps would overstate the evidence, and offsets below about BAND_FACTOR x the baseline gap need more
baseline runs to resolve.

Calibration on synthetic curves (200 steps, a shared batch-to-batch loss, per-run noise growing 20-fold, AR(1)
correlated between steps; tests/test_equivalence.py): with step-to-step correlation 0.7, none of 200 null triples
failed and an offset of 4 sigma always failed (2 sigma about half the time). With correlation 0.95 (runs drifting
apart for ~40 steps at a time) about one null triple in five fails: two baseline runs cannot measure noise that
slow, so read a "differs" beside the plot in the report.

The floor. A bitwise-identical baseline pair (on CPU the "nondeterministic" baseline usually is deterministic) has no
noise to measure: the band is then RELATIVE_FLOOR of the loss (two loss curves closer than 0.01% read the same), and
the result names that yardstick; a deterministic curve identical to identical baselines is reported as such. A curve
that leaves a band at its floor is NOT_JUDGED rather than "differs": without run-to-run noise there is no yardstick
to call a difference large by (on CPU a passing proxy run's deterministic kernels sum in another order). The floor
also keeps steps where the baselines have barely parted from demanding bitwise agreement.

Not evaluated (never a pass): a compared run is incomplete (the summary reports what is missing), fewer than
MIN_STEPS steps follow the warmup, or a baseline loss is not finite (the reason names the first such step). A
deterministic loss that is not finite where the baselines' are fails: it lies outside every band, and the result names
how many such steps there were and the first; max_deviation is then the largest finite deviation, and where there is
none `max_deviation_missing` says why (taxbench.analysis.divergence names the first non-finite step and rank).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from taxbench.design import EQUIVALENCE_RUNS
from taxbench.rundir.read import step_losses

EQUIVALENT = "equivalent within baseline noise"
DIFFERS = "differs beyond baseline noise"
NOT_EVALUATED = "not evaluated"
NOT_JUDGED = "not judged (baseline noise is zero here)"

BAND_FACTOR = 3.0
NOISE_WINDOW = 41  # steps, centred
RELATIVE_FLOOR = 1e-4
REQUIRED_SHARE = 0.95
MIN_STEPS = 5

# What the band was measured against
NOISE = "baseline noise"
IDENTICAL_BASELINES = f"baseline runs bitwise identical: band is {RELATIVE_FLOOR:.2%} of the loss"
ALL_IDENTICAL = "baseline runs bitwise identical; deterministic curve identical too"


def _no_steps() -> np.ndarray:
    return np.empty(0, dtype=np.float64)


@dataclass(frozen=True, eq=False)
class Equivalence:
    """The deterministic loss curve against the baseline band, with the per-step arrays for plotting."""

    verdict: str  # EQUIVALENT, DIFFERS, NOT_JUDGED (baselines identical, curve outside the floor) or NOT_EVALUATED
    statistic: float  # share of compared steps inside the band (NaN when not evaluated)
    threshold: float  # the share needed for EQUIVALENT
    n_steps: int
    basis: str  # the yardstick (NOISE, IDENTICAL_BASELINES, ALL_IDENTICAL), or why it was not evaluated
    from_step: int  # steps after this one are compared (the warmup)
    steps: np.ndarray = field(default_factory=_no_steps)
    baseline_0: np.ndarray = field(default_factory=_no_steps)
    baseline_1: np.ndarray = field(default_factory=_no_steps)
    deterministic: np.ndarray = field(default_factory=_no_steps)
    band: np.ndarray = field(default_factory=_no_steps)  # half-width of the tolerance band around the center

    @property
    def evaluated(self) -> bool:
        return self.verdict != NOT_EVALUATED

    @property
    def center(self) -> np.ndarray:
        return (self.baseline_0 + self.baseline_1) / 2

    @property
    def gap(self) -> np.ndarray:
        return np.abs(self.baseline_1 - self.baseline_0)

    @property
    def deviation(self) -> np.ndarray:
        """|deterministic - center|; +inf where the deterministic loss is not finite."""
        deviation = np.abs(self.deterministic - self.center)
        return np.where(np.isfinite(deviation), deviation, np.inf)

    @property
    def inside(self) -> np.ndarray:
        return self.deviation <= self.band

    def _median(self, values: np.ndarray) -> float:
        return float(np.median(values)) if values.size else math.nan

    @property
    def nonfinite_steps(self) -> np.ndarray:
        """The compared steps whose deterministic loss is NaN or infinite."""
        return self.steps[~np.isfinite(self.deterministic)] if self.n_steps else self.steps[:0]

    def _nonfinite_text(self) -> str:
        bad = self.nonfinite_steps
        return f"deterministic loss not finite at {bad.size} of {self.n_steps} steps (first: step {int(bad[0])})"

    def max_deviation(self) -> tuple[float, str | None]:
        """The largest finite |deterministic - center|, or NaN with the reason there is none."""
        if not self.evaluated:
            return math.nan, f"{NOT_EVALUATED}: {self.basis}"
        finite = self.deviation[np.isfinite(self.deviation)]
        if not finite.size:
            return math.nan, self._nonfinite_text()
        return float(finite.max()), None

    def describe(self) -> str:
        """One line: the verdict with its statistic, as the console, the report and wandb show it."""
        if not self.evaluated:
            return f"{NOT_EVALUATED}: {self.basis}"
        if self.basis == ALL_IDENTICAL:
            return f"{self.verdict}: {ALL_IDENTICAL} ({self.n_steps} steps)"
        inside = int(self.inside.sum())
        floor = f"; {IDENTICAL_BASELINES}" if self.basis == IDENTICAL_BASELINES else ""
        nonfinite = f"; {self._nonfinite_text()}" if self.nonfinite_steps.size else ""
        return (f"{self.verdict}: {inside} of {self.n_steps} steps inside the band ({self.threshold:.0%} needed); "
                f"median |Δloss| {self._median(self.deviation):.3g} vs band {self._median(self.band):.3g}{floor}"
                f"{nonfinite}")

    def to_dict(self) -> dict[str, Any]:
        """The result without per-step arrays (those are recomputed from the records); NaN where not evaluated."""
        return {
            "verdict": self.verdict,
            "equivalent": self.verdict == EQUIVALENT,
            "statistic": self.statistic,
            "threshold": self.threshold,
            "n_steps": self.n_steps,
            "basis": self.basis,
            "description": self.describe(),
            "from_step": self.from_step,
            "runs": list(EQUIVALENCE_RUNS),
            "steps_inside": int(self.inside.sum()),
            "max_deviation": self.max_deviation()[0],
            "max_deviation_missing": self.max_deviation()[1],  # why max_deviation is null (None when it is not)
            "nonfinite_steps": int(self.nonfinite_steps.size),
            "first_nonfinite_step": int(self.nonfinite_steps[0]) if self.nonfinite_steps.size else None,
            "median_deviation": self._median(self.deviation),
            "median_band": self._median(self.band),
            "median_baseline_gap": self._median(self.gap),
            "band_factor": BAND_FACTOR,
            "noise_window": NOISE_WINDOW,
            "relative_floor": RELATIVE_FLOOR,
        }


def not_evaluated(reason: str, from_step: int) -> Equivalence:
    return Equivalence(NOT_EVALUATED, math.nan, REQUIRED_SHARE, 0, reason, from_step)


def rolling_rms(values: np.ndarray, window: int = NOISE_WINDOW) -> np.ndarray:
    """Root mean square over a centred window (shorter at the ends)."""
    squares = pd.Series(np.square(values))
    return np.sqrt(squares.rolling(window, center=True, min_periods=1).mean().to_numpy())


def compare_loss_curves(baseline_0: pd.Series, baseline_1: pd.Series, deterministic: pd.Series,
                        from_step: int = 0) -> Equivalence:
    """The deterministic loss curve against the band of the two baseline curves (each a loss per step, indexed by
    step), over the steps after `from_step` that all three hold."""
    curves = pd.concat({"b0": baseline_0, "b1": baseline_1, "d": deterministic}, axis=1, join="inner").sort_index()
    curves = curves[curves.index > from_step]
    if len(curves) < MIN_STEPS:
        return not_evaluated(f"only {len(curves)} steps after step {from_step} (needs {MIN_STEPS})", from_step)
    steps = curves.index.to_numpy()
    b0, b1, d = (curves[column].to_numpy(dtype=np.float64) for column in ("b0", "b1", "d"))
    baseline_finite = np.isfinite(b0) & np.isfinite(b1)
    if not baseline_finite.all():
        return not_evaluated(f"baseline loss not finite at step {steps[~baseline_finite][0]}", from_step)
    center = (b0 + b1) / 2
    band = np.maximum(BAND_FACTOR * rolling_rms(b1 - b0), RELATIVE_FLOOR * np.abs(center))
    share = float(np.mean(np.abs(d - center) <= band))  # a non-finite deterministic loss is outside
    if np.array_equal(b0, b1):
        basis = ALL_IDENTICAL if np.array_equal(d, b0) else IDENTICAL_BASELINES
    else:
        basis = NOISE
    verdict = EQUIVALENT if share >= REQUIRED_SHARE else NOT_JUDGED if basis == IDENTICAL_BASELINES else DIFFERS
    return Equivalence(verdict, share, REQUIRED_SHARE, len(steps), basis, from_step, steps, b0, b1, d, band)


def baseline_equivalence(runs: dict[str, pd.DataFrame], from_step: int, problems: Sequence[str] = ()) -> Equivalence:
    """Equivalence of an experiment's runs (run name -> step records); `problems` are what makes any of the
    EQUIVALENCE_RUNS incomplete, and then nothing is evaluated."""
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        return not_evaluated(f"incomplete records: {problems[0]}{more}", from_step)
    return compare_loss_curves(*(step_losses(runs[name]) for name in EQUIVALENCE_RUNS), from_step=from_step)
