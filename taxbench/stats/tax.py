"""The determinism tax from interleaved rounds, or from whole-run pairs (`taxbench run -- COMMAND`: estimate_pairs_tax,
where a pair of whole runs is the unit a round is here).

Each round holds one block of every timed run, in a seeded random order. Per round, the log ratio is the mean log
median step time of the deterministic runs' blocks minus that of the baseline runs' blocks, post-warmup (with one
run per arm: log(median det block / median baseline block)). The tax is exp(mean log ratio) - 1 with a t interval
over rounds (the round is the unit: blocks within one round may share the machine's state); a Hodges-Lehmann
estimate with its signed-rank interval cross-checks it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pandas as pd
from scipy import special  # ndtri, stdtrit: the normal and t quantiles (scipy.stats costs analysis 1 s to import)

from taxbench.design import checkpoint_after
from taxbench.rundir.read import step_times
from taxbench.rundir.step_record import BLOCK, STEP, TIME_S
from taxbench.stats.warmup import WarmupCut, warmup_cut

PRECISE_HALF_WIDTH = 0.005  # what "steps needed" is quoted for: a +/-0.5% interval


@dataclass(frozen=True)
class TaxEstimate:
    tax: float  # fraction: 0.05 means the deterministic arm is 5% slower
    low: float
    high: float
    hl_tax: float
    hl_low: float
    hl_high: float
    pairs: int  # rounds with both arms after the warmup cut
    confidence: float
    baseline_median_s: float
    deterministic_median_s: float
    baseline_cv: float
    deterministic_cv: float
    warmup_steps: int
    steady_steps: int  # per run, after the warmup cut
    drifting: bool
    timed_runs: int = 2  # runs the estimate pools (both arms together)

    @property
    def half_width(self) -> float:
        """The interval's relative half-width (NaN without an interval)."""
        return (self.high - self.low) / 2

    def to_dict(self) -> dict:
        return {**asdict(self), "half_width": self.half_width if math.isfinite(self.half_width) else None}


def steps_for_half_width(estimate: TaxEstimate, half_width: float = PRECISE_HALF_WIDTH) -> int:
    """Steps per run for a +/- half_width interval, extrapolated from this estimate's own half-width.

    The half-width shrinks as 1/sqrt(rounds), so the steady steps scale with (measured / wanted)^2; the warmup is
    paid once more. 0 when the estimate has no interval.
    """
    if not math.isfinite(estimate.half_width) or estimate.steady_steps == 0:
        return 0
    steady = estimate.steady_steps * (estimate.half_width / half_width) ** 2
    return estimate.warmup_steps + math.ceil(steady)


def _hodges_lehmann(logs: np.ndarray, confidence: float) -> tuple[float, float, float]:
    n = len(logs)
    i, j = np.triu_indices(n)
    walsh = np.sort((logs[i] + logs[j]) / 2)
    center = float(np.median(walsh))
    if n < 2:
        return center, math.nan, math.nan
    # Normal approximation of the signed-rank critical value (exact enough for n >= 6; conservative below).
    z = special.ndtri(0.5 + confidence / 2)  # = stats.norm.ppf
    m = len(walsh)
    k = int(math.floor(n * (n + 1) / 4 - z * math.sqrt(n * (n + 1) * (2 * n + 1) / 24)))
    k = min(max(k, 0), m - 1)
    return center, float(walsh[k]), float(walsh[m - 1 - k])


def _log_block_medians(runs: Sequence[pd.DataFrame], warmup: int, checkpoints: Checkpoints | None) -> pd.Series:
    """Per block: the mean over `runs` of log(median step time after warmup, without the first step after a
    checkpoint commit); blocks every run holds."""
    logs = []
    for frame in runs:
        times = step_times(frame)
        times = times[times[STEP] > warmup]
        if checkpoints is not None:
            times = times[~times[STEP].map(checkpoints.follows).astype(bool)]
        logs.append(np.log(times.groupby(BLOCK)[TIME_S].median()))
    return pd.concat(logs, axis=1, join="inner").mean(axis=1)


def block_ratios(
    baselines: Sequence[pd.DataFrame], deterministics: Sequence[pd.DataFrame], warmup: int,
    checkpoints: Checkpoints | None,
) -> pd.DataFrame:
    """Per round (block): the baseline and deterministic median step time after warmup (geometric mean over each
    arm's runs) and their ratio; without the first step after each checkpoint commit (`checkpoints`; None: runs that
    commit none; with one step per block, that round is gone). No default: a plot that forgot it showed rounds the
    estimate had left out."""
    paired = pd.concat({"baseline": _log_block_medians(baselines, warmup, checkpoints),
                        "deterministic": _log_block_medians(deterministics, warmup, checkpoints)},
                       axis=1, join="inner").dropna()
    paired["ratio"] = np.exp(paired["deterministic"] - paired["baseline"])
    paired[["baseline", "deterministic"]] = np.exp(paired[["baseline", "deterministic"]])
    return paired


@dataclass(frozen=True)
class Checkpoints:
    """When the timed runs committed checkpoints: the steps recorded in stop.json (`commits`; commits by time are
    not a function of the step), or for experiments from before that, after the block ending at every multiple of
    `every` steps."""

    every: int
    block_steps: int
    commits: frozenset[int] | None = None

    @classmethod
    def of(cls, experiment: Mapping[str, Any], commits: Iterable[int] | None) -> Checkpoints:
        """From an experiment config as a manifest records it and the commits its stop.json records (None: none
        recorded, the step rule)."""
        return cls(int(experiment.get("checkpoint_every_steps", 0)), int(experiment["block_steps"]),
                   None if commits is None else frozenset(commits))

    def follows(self, step: int) -> bool:
        """Whether `step` (1-based) is the first step after a checkpoint commit."""
        if self.commits is not None:
            return step - 1 in self.commits
        return step > 1 and (step - 1) % self.block_steps == 0 and checkpoint_after(step - 1, self.block_steps,
                                                                                      self.every)


def estimate_tax(
    baselines: Sequence[pd.DataFrame], deterministics: Sequence[pd.DataFrame], min_warmup: int,
    confidence: float = 0.95, checkpoints: Checkpoints | None = None,
) -> TaxEstimate:
    """The tax from each arm's timed runs (records of every rank; the slowest rank's time per step counts), without
    the first step after each checkpoint commit (`checkpoints`; taxbench.design.checkpoint_after says why)."""
    series = {(arm, i): step_times(f)[TIME_S].to_numpy() for arm, runs in
              (("baseline", baselines), ("deterministic", deterministics)) for i, f in enumerate(runs)}
    cuts: dict[tuple[str, int], WarmupCut] = {key: warmup_cut(values, min_warmup) for key, values in series.items()}
    warmup = max(cut.steps for cut in cuts.values())
    paired = block_ratios(baselines, deterministics, warmup, checkpoints)
    return _estimate(np.log(paired["ratio"].to_numpy()), series, cuts, warmup, confidence)


def pair_ratios(pairs: Sequence[tuple[pd.DataFrame, pd.DataFrame]], warmup: int) -> pd.DataFrame:
    """Per whole-run pair (`taxbench run -- COMMAND`: a baseline run and a deterministic run of the command, one
    after the other): each run's median step time after warmup (the slowest rank's time per step) and their ratio,
    indexed by pair."""
    rows = {}
    for index, (baseline, deterministic) in enumerate(pairs):
        medians = [float(np.median(times[times[STEP] > warmup][TIME_S])) if (times[STEP] > warmup).any()
                   else math.nan for times in (step_times(baseline), step_times(deterministic))]
        rows[index] = {"baseline": medians[0], "deterministic": medians[1]}
    paired = pd.DataFrame.from_dict(rows, orient="index", columns=["baseline", "deterministic"]).dropna()
    paired.index.name = "pair"
    paired["ratio"] = paired["deterministic"] / paired["baseline"]
    return paired


def estimate_pairs_tax(pairs: Sequence[tuple[pd.DataFrame, pd.DataFrame]], min_warmup: int,
                       confidence: float = 0.95) -> TaxEstimate:
    """The tax from whole-run pairs: per pair, the ratio of the runs' steady-state median step times; the interval
    across pairs (a pair is the unit, as a round is for interleaved blocks: the runs of one pair share the machine's
    state). Warmup: the longest of every run's cut (a fixed minimum checked by MSER-5)."""
    series = {(arm, i): step_times(frame)[TIME_S].to_numpy() for i, pair in enumerate(pairs)
              for arm, frame in zip(("baseline", "deterministic"), pair, strict=True)}
    cuts = {key: warmup_cut(values, min_warmup) for key, values in series.items()}
    warmup = max(cut.steps for cut in cuts.values())
    paired = pair_ratios(pairs, warmup)
    return _estimate(np.log(paired["ratio"].to_numpy()), series, cuts, warmup, confidence)


def _estimate(logs: np.ndarray, series: Mapping[tuple[str, int], np.ndarray], cuts: Mapping[tuple[str, int], WarmupCut],
              warmup: int, confidence: float) -> TaxEstimate:
    """The estimate from per-round (or per-pair) log ratios and the step-time series they came from."""
    n = len(logs)
    if n == 0:
        raise ValueError(
            f"no block pairs left after a warmup of {warmup} steps; run more steps (experiment.steps) or fewer "
            "warmup steps (experiment.warmup_steps)"
        )
    mean = float(logs.mean())
    if n >= 2:
        half = float(special.stdtrit(n - 1, 0.5 + confidence / 2) * logs.std(ddof=1) / math.sqrt(n))  # = stats.t.ppf
    else:
        half = math.nan
    hl, hl_low, hl_high = _hodges_lehmann(logs, confidence)
    post = {arm: np.concatenate([values[warmup:] for (name, _), values in series.items() if name == arm])
            for arm in ("baseline", "deterministic")}

    def cv(values: np.ndarray) -> float:
        return float(values.std(ddof=1) / values.mean()) if len(values) > 1 else math.nan

    return TaxEstimate(
        tax=math.exp(mean) - 1,
        low=math.exp(mean - half) - 1,
        high=math.exp(mean + half) - 1,
        hl_tax=math.exp(hl) - 1,
        hl_low=math.exp(hl_low) - 1,
        hl_high=math.exp(hl_high) - 1,
        pairs=n,
        confidence=confidence,
        baseline_median_s=float(np.median(post["baseline"])),
        deterministic_median_s=float(np.median(post["deterministic"])),
        baseline_cv=cv(post["baseline"]),
        deterministic_cv=cv(post["deterministic"]),
        warmup_steps=warmup,
        steady_steps=max(len(values) for values in series.values()) - warmup,
        drifting=any(cut.drifting for cut in cuts.values()),
        timed_runs=len(series),
    )


def no_estimate(confidence: float, warmup_steps: int) -> TaxEstimate:
    """The estimate of an experiment whose timed runs hold too few records for one (every number NaN)."""
    nan = math.nan
    return TaxEstimate(tax=nan, low=nan, high=nan, hl_tax=nan, hl_low=nan, hl_high=nan, pairs=0,
                       confidence=confidence, baseline_median_s=nan, deterministic_median_s=nan, baseline_cv=nan,
                       deterministic_cv=nan, warmup_steps=warmup_steps, steady_steps=0, drifting=False,
                       timed_runs=0)
