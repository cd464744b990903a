"""Warmup detection: a fixed minimum checked by MSER-5."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class WarmupCut:
    steps: int  # observations to drop from the front
    mser_steps: int  # MSER-5's own suggestion
    drifting: bool  # MSER-5 wanted to cut at its cap: the series has no steady state yet


def mser5(values: np.ndarray) -> tuple[int, bool]:
    """MSER-5 truncation point in observations and whether it hit the cap (half the series)."""
    n_batches = len(values) // 5
    if n_batches < 4:
        return 0, False
    batches = np.asarray(values[: n_batches * 5], dtype=float).reshape(n_batches, 5).mean(axis=1)
    cap = n_batches // 2
    # Suffix sums give every tail's mean and variance at once.
    suffix = np.cumsum(batches[::-1])[::-1]
    suffix_sq = np.cumsum((batches**2)[::-1])[::-1]
    counts = n_batches - np.arange(n_batches)
    variance = suffix_sq / counts - (suffix / counts) ** 2
    statistic = variance[: cap + 1] / counts[: cap + 1]
    best = int(np.argmin(statistic))
    return best * 5, best == cap and cap > 0


def warmup_cut(values: np.ndarray, minimum: int) -> WarmupCut:
    suggested, at_cap = mser5(values)
    return WarmupCut(steps=max(minimum, suggested), mser_steps=suggested, drifting=at_cap)
