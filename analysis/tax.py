"""The determinism tax from interleaved blocks.

Per block pair r = median(deterministic block) / median(baseline block), post-warmup. The tax is exp(mean log r) - 1
with a paired-t interval on log r; a Hodges-Lehmann estimate with its signed-rank interval cross-checks it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd
from scipy import stats

from taxbench.analysis.records import step_times
from taxbench.analysis.warmup import WarmupCut, warmup_cut


@dataclass(frozen=True)
class TaxEstimate:
    tax: float  # fraction: 0.05 means the deterministic arm is 5% slower
    low: float
    high: float
    hl_tax: float
    hl_low: float
    hl_high: float
    pairs: int
    confidence: float
    baseline_median_s: float
    deterministic_median_s: float
    baseline_cv: float
    deterministic_cv: float
    warmup_steps: int
    steady_steps: int  # per arm, after the warmup cut
    drifting: bool

    def to_dict(self) -> dict:
        return asdict(self)


def steps_for_half_width(cv: float, half_width: float = 0.005, confidence: float = 0.95) -> int:
    """Steps per arm for a +/- half_width interval on the ratio of medians at this coefficient of variation."""
    z = stats.norm.ppf(0.5 + confidence / 2)
    return math.ceil(2 * (z * cv / half_width) ** 2)


def _hodges_lehmann(logs: np.ndarray, confidence: float) -> tuple[float, float, float]:
    n = len(logs)
    i, j = np.triu_indices(n)
    walsh = np.sort((logs[i] + logs[j]) / 2)
    center = float(np.median(walsh))
    if n < 2:
        return center, math.nan, math.nan
    # Normal approximation of the signed-rank critical value (exact enough for n >= 6; conservative below).
    z = stats.norm.ppf(0.5 + confidence / 2)
    m = len(walsh)
    k = int(math.floor(n * (n + 1) / 4 - z * math.sqrt(n * (n + 1) * (2 * n + 1) / 24)))
    k = min(max(k, 0), m - 1)
    return center, float(walsh[k]), float(walsh[m - 1 - k])


def block_ratios(baseline: pd.DataFrame, deterministic: pd.DataFrame, warmup: int) -> pd.DataFrame:
    """Per block: baseline and deterministic median step time after warmup, and their ratio."""
    medians = {}
    for name, frame in (("baseline", baseline), ("deterministic", deterministic)):
        times = step_times(frame)
        times = times[times["step"] > warmup]
        medians[name] = times.groupby("block")["time_s"].median()
    paired = pd.concat(medians, axis=1, join="inner").dropna()
    paired["ratio"] = paired["deterministic"] / paired["baseline"]
    return paired


def estimate_tax(
    baseline: pd.DataFrame, deterministic: pd.DataFrame, min_warmup: int, confidence: float = 0.95
) -> TaxEstimate:
    series = {name: step_times(f)["time_s"].to_numpy() for name, f in
              (("baseline", baseline), ("deterministic", deterministic))}
    cuts: dict[str, WarmupCut] = {name: warmup_cut(values, min_warmup) for name, values in series.items()}
    warmup = max(cut.steps for cut in cuts.values())
    paired = block_ratios(baseline, deterministic, warmup)
    logs = np.log(paired["ratio"].to_numpy())
    n = len(logs)
    if n == 0:
        raise ValueError(
            f"no block pairs left after a warmup of {warmup} steps; run more steps (experiment.steps) or fewer "
            "warmup steps (experiment.warmup_steps)"
        )
    mean = float(logs.mean())
    if n >= 2:
        half = float(stats.t.ppf(0.5 + confidence / 2, n - 1) * logs.std(ddof=1) / math.sqrt(n))
    else:
        half = math.nan
    hl, hl_low, hl_high = _hodges_lehmann(logs, confidence)
    post = {name: values[warmup:] for name, values in series.items()}

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
        steady_steps=len(post["baseline"]),
        drifting=any(cut.drifting for cut in cuts.values()),
    )


def no_estimate(confidence: float, warmup_steps: int) -> TaxEstimate:
    """The estimate of an experiment whose timed runs hold too few records for one (every number NaN)."""
    nan = math.nan
    return TaxEstimate(tax=nan, low=nan, high=nan, hl_tax=nan, hl_low=nan, hl_high=nan, pairs=0,
                       confidence=confidence, baseline_median_s=nan, deterministic_median_s=nan, baseline_cv=nan,
                       deterministic_cv=nan, warmup_steps=warmup_steps, steady_steps=0, drifting=False)
