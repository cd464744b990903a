"""Report figures (matplotlib, Agg backend: no display needed), returned as PNG bytes.

matplotlib is imported with the first figure: `taxbench analyse` of a folder without a report draws none, and pyplot
costs it half a second.
"""

from __future__ import annotations

import io
import math
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from taxbench.analysis.equivalence import BAND_FACTOR, RELATIVE_FLOOR, Equivalence
from taxbench.rundir.step_record import GRAD_NORM, LOSS, RANK, STEP, TIME_S
from taxbench.stats.tax import TaxEstimate

if TYPE_CHECKING:
    from matplotlib.figure import Figure

ARM_COLORS = {"baseline": "#1f77b4", "deterministic": "#d62728"}


def _subplots(*args: Any, **kwargs: Any) -> Any:  # noqa: ANN401 (pyplot.subplots' figure and axes)
    """pyplot.subplots on the Agg backend (chosen before pyplot is first imported)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(*args, **kwargs)


def _png(figure: Figure) -> bytes:
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    plt.close(figure)
    return buffer.getvalue()


def step_time_plot(series: dict[str, pd.DataFrame], tax: TaxEstimate, ratios: pd.DataFrame) -> bytes:
    """Per-step time of each arm (slowest rank) with the warmup cut, above the per-block ratio and the tax interval.

    `series` maps an arm to a frame with step and time_s; `ratios` has one row per block pair with a ratio column.
    """
    from matplotlib.ticker import MaxNLocator, PercentFormatter

    figure, (top, bottom) = _subplots(
        2, 1, figsize=(9, 6.2), sharex=False, gridspec_kw={"height_ratios": [3, 2]}, layout="constrained"
    )
    for arm, frame in series.items():
        top.plot(frame[STEP], frame[TIME_S] * 1e3, lw=1.1, color=ARM_COLORS.get(arm), label=arm, alpha=0.85)
    top.axvspan(0.5, tax.warmup_steps + 0.5, color="0.85", zorder=0, label=f"warmup ({tax.warmup_steps} steps, cut)")
    top.axvline(tax.warmup_steps + 0.5, color="0.35", ls="--", lw=1)
    steady = [f.loc[f[STEP] > tax.warmup_steps, TIME_S] for f in series.values()]
    steady = [times for times in steady if not times.empty]
    if steady:  # keep a huge first step from flattening the steady state, without clipping either arm
        top.set_ylim(0, max(float(np.percentile(times, 99)) for times in steady) * 1e3 * 1.35)
    for arm, median in (("baseline", tax.baseline_median_s), ("deterministic", tax.deterministic_median_s)):
        top.axhline(median * 1e3, color=ARM_COLORS[arm], lw=0.8, ls=":")
    top.set_xlabel("step")
    top.set_ylabel("step time, slowest rank (ms)")
    top.set_title("Step time per arm (dotted: steady-state median)")
    top.legend(loc="upper right", fontsize=9, framealpha=0.9)
    top.grid(alpha=0.3)

    blocks = ratios.index.to_numpy()
    bottom.plot(blocks, (ratios["ratio"].to_numpy() - 1) * 100, "o-", color="0.3", ms=4, lw=1,
                label="one round (deterministic / baseline median)")
    level = int(round(tax.confidence * 100))
    if math.isfinite(tax.low) and math.isfinite(tax.high):
        bottom.axhspan(tax.low * 100, tax.high * 100, color=ARM_COLORS["deterministic"], alpha=0.15,
                       label=f"{level}% CI")
    bottom.axhline(tax.tax * 100, color=ARM_COLORS["deterministic"], lw=1.5, label=f"tax {tax.tax * 100:+.2f}%")
    bottom.axhline(0, color="black", lw=0.8)
    bottom.yaxis.set_major_formatter(PercentFormatter(decimals=1))
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    bottom.set_xlabel("interleaved round (post-warmup)")
    bottom.set_ylabel("deterministic / baseline - 1")
    bottom.set_title("Tax per round")
    bottom.legend(loc="best", fontsize=9, framealpha=0.9, ncols=3)
    bottom.grid(alpha=0.3)
    return _png(figure)


def training_curves_plot(runs: dict[str, pd.DataFrame]) -> bytes:
    """Loss and gradient norm per step (rank 0's record) of each run, as torchtitan and Megatron log them."""
    figure, (loss_axis, norm_axis) = _subplots(1, 2, figsize=(10, 3.6), layout="constrained")
    for name, frame in runs.items():
        first = frame[frame[RANK] == frame[RANK].min()].sort_values(STEP)
        arm = name.split("-")[0]
        style = "-" if name.endswith("-0") else "--"
        for axis, column in ((loss_axis, LOSS), (norm_axis, GRAD_NORM)):
            axis.plot(first[STEP], first[column], style, lw=1.1, color=ARM_COLORS.get(arm), label=name, alpha=0.8)
    for axis, title in ((loss_axis, "loss"), (norm_axis, "gradient norm (before clipping)")):
        axis.set_xlabel("step")
        axis.set_title(title)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    return _png(figure)


def equivalence_plot(equivalence: Equivalence) -> bytes:
    """The deterministic loss curve over the baseline band (top), and its deviation from the baselines' center against
    the band's half-width (bottom: at the scale of the loss the band is usually too thin to see)."""
    from matplotlib.ticker import MaxNLocator

    figure, (curves, residuals) = _subplots(
        2, 1, figsize=(9, 6.2), sharex=True, gridspec_kw={"height_ratios": [3, 2]}, layout="constrained"
    )
    steps, center, band = equivalence.steps, equivalence.center, equivalence.band
    baseline, deterministic = ARM_COLORS["baseline"], ARM_COLORS["deterministic"]
    band_label = f"baseline band ({BAND_FACTOR:g}x RMS gap, at least {RELATIVE_FLOOR:.2%} of the loss)"
    curves.fill_between(steps, center - band, center + band, color=baseline, alpha=0.2, lw=0, label=band_label)
    curves.plot(steps, equivalence.baseline_0, "-", lw=0.9, color=baseline, alpha=0.8, label="baseline-0")
    curves.plot(steps, equivalence.baseline_1, "--", lw=0.9, color=baseline, alpha=0.8, label="baseline-1")
    curves.plot(steps, equivalence.deterministic, "-", lw=1.1, color=deterministic, label="deterministic-0")
    curves.set_ylabel("loss (mean over ranks)")
    curves.set_title("Deterministic loss over the baseline band")
    curves.legend(loc="upper right", fontsize=9, framealpha=0.9)
    curves.grid(alpha=0.3)

    residuals.fill_between(steps, -band, band, color=baseline, alpha=0.2, lw=0, label=band_label)
    residuals.plot(steps, equivalence.baseline_0 - center, "-", lw=0.9, color=baseline, alpha=0.8,
                   label="baseline-0 (baseline-1 mirrors it)")
    residuals.plot(steps, equivalence.deterministic - center, "-", lw=1.1, color=deterministic,
                   label="deterministic-0")
    outside = ~equivalence.inside & np.isfinite(equivalence.deterministic)
    if outside.any():
        residuals.scatter(steps[outside], (equivalence.deterministic - center)[outside], marker="x", s=30,
                          color=deterministic, zorder=5, label=f"outside the band ({int(outside.sum())} steps)")
    residuals.axhline(0, color="black", lw=0.8)
    residuals.xaxis.set_major_locator(MaxNLocator(integer=True))
    residuals.set_xlabel("step")
    residuals.set_ylabel("loss - baseline center")
    residuals.set_title(f"Deviation per step ({equivalence.n_steps} steps after step {equivalence.from_step})")
    residuals.legend(loc="best", fontsize=8, framealpha=0.9, ncols=2)
    residuals.grid(alpha=0.3)
    return _png(figure)


def sweep_tax_plot(points: pd.DataFrame, world: str = "GPUs") -> bytes:
    """Tax vs GPU count (world size) with the confidence interval of each point; red markers fail a gate, orange
    ones are incomplete (no verdict)."""
    from matplotlib.ticker import FuncFormatter, PercentFormatter

    figure, axis = _subplots(figsize=(8, 4.5), layout="constrained")
    ordered = points.sort_values("world_size")
    for recipe, frame in ordered.groupby("recipe", sort=False):
        x = frame["world_size"].to_numpy()
        y = frame["tax"].to_numpy() * 100
        below = np.clip(y - frame["low"].to_numpy() * 100, 0, None)
        above = np.clip(frame["high"].to_numpy() * 100 - y, 0, None)
        axis.errorbar(x, y, yerr=np.nan_to_num(np.vstack([below, above])), fmt="o-", capsize=4, lw=1.3,
                      label=str(recipe))
        outcome = frame["outcome"].to_numpy(dtype=object)
        for marked, color, label in ((outcome == "failed", "red", "not bitwise deterministic"),
                                     (outcome == "incomplete", "orange", "incomplete: no verdict")):
            if marked.any():
                axis.scatter(x[marked], y[marked], s=120, facecolors="none", edgecolors=color, lw=2, zorder=5,
                             label=f"{recipe}: {label}")
    axis.axhline(0, color="black", lw=0.8)
    world_sizes = sorted(ordered["world_size"].unique())
    if len(world_sizes) > 1 and world_sizes[0] > 0 and world_sizes[-1] / world_sizes[0] >= 8:
        axis.set_xscale("log", base=2)
    axis.set_xticks(world_sizes)
    axis.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{int(v)}"))
    axis.minorticks_off()
    axis.yaxis.set_major_formatter(PercentFormatter(decimals=1))
    axis.set_xlabel(f"{world} (world size)")
    axis.set_ylabel("determinism tax")
    level = int(round(float(ordered["confidence"].iloc[0]) * 100)) if "confidence" in ordered else 95
    axis.set_title(f"Determinism tax vs {world} ({level}% CI)")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=9)
    return _png(figure)


def top_ops_plot(ops: pd.DataFrame, arm: str) -> bytes:
    """Growth of each top op's self time per step in `arm` against the baseline (analysis.attribution's table)."""
    shown = ops.iloc[::-1]  # the largest growth on top
    figure, axes = _subplots(figsize=(9, 0.45 * len(shown) + 1.4), layout="constrained")
    colors = [ARM_COLORS["deterministic"] if d > 0 else ARM_COLORS["baseline"] for d in shown["delta_us"]]
    axes.barh(shown["op"], shown["delta_us"] / 1e3, color=colors)
    axes.axvline(0, color="0.3", lw=0.8)
    axes.set_xlabel(f"self time per step, {arm} minus baseline (ms; red: grew, blue: shrank)")
    axes.set_title(f"Ops whose time changed most in {arm} (torch.profiler, profile runs)")
    axes.grid(axis="x", alpha=0.3)
    return _png(figure)
