"""The words every presenter shares: numbers as text, and an experiment's, sweep's or layouts folder's results as
lines (the verdict, the tax's headline, a knob's cost, a layout pair's first difference).

Plain text only, no console markup: the console (taxbench.analysis.console) colours these lines, the report
(taxbench.analysis.report) sets them in HTML and markdown, wandb (taxbench.analysis.wandb_log) and summary.json
(taxbench.analysis.summary) store them. Nothing here computes a result; every line reads one the analysis computed.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from taxbench.analysis.ablation import KnobResult
from taxbench.analysis.experiment import CALIBRATION, DIVERGED, FAILED, PASSED, RUNNING, ExperimentSummary
from taxbench.analysis.layouts import LayoutsSummary, PairResult
from taxbench.analysis.verdicts import DIFFERS, Verdict
from taxbench.design import GATES, MEASURED
from taxbench.stats.tax import PRECISE_HALF_WIDTH


# ------------------------------------------------------------------------------------------------------------ numbers
def pct(value: object) -> str:
    """A fraction as a signed percentage ("+1.23%"), or "n/a" when it is missing or not finite."""
    return "n/a" if not isinstance(value, float) or not math.isfinite(value) else f"{value * 100:+.2f}%"


def pct_plain(value: object) -> str:
    """A fraction as an unsigned percentage with one decimal ("1.2%"), or "n/a"."""
    return "n/a" if not isinstance(value, float) or not math.isfinite(value) else f"{value * 100:.1f}%"


def interval(low: object, high: object, confidence: float | None = None) -> str:
    """A confidence interval by its two ends ("95% CI -5.60% to +30.17%"): a ratio's interval is asymmetric about its
    estimate, so never as the estimate +/- a half-width."""
    level = f"{int(round(confidence * 100))}% CI " if confidence is not None else ""
    return f"{level}{pct(low)} to {pct(high)}"


def ms(seconds: object, digits: int = 2) -> str:
    """Seconds as milliseconds ("12.34 ms"), or "n/a" when missing or not finite."""
    if not isinstance(seconds, float) or not math.isfinite(seconds):
        return "n/a"
    return f"{seconds * 1e3:.{digits}f} ms"


def duration(seconds: float) -> str:
    """A rough duration: "40 s", "12 min", "3.5 h"."""
    if not math.isfinite(seconds):
        return "n/a"
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def si(value: float | None, unit: str) -> str:
    """12345 -> "12.3k tok/s"; None or NaN -> "n/a"."""
    if value is None or not math.isfinite(value):
        return "n/a"
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.1f}{prefix} {unit}"
    return f"{value:.1f} {unit}"


def mebibytes(value: int | None) -> str:
    return "n/a" if value is None else f"{value / 2**20:,.0f} MiB"


def ranks(world_size: int) -> str:
    return f"{world_size} rank{'' if world_size == 1 else 's'}"


def world_label(points: pd.DataFrame) -> str:
    """What the sweep's world sizes count: "GPUs", or "ranks" when no point ran on CUDA."""
    return "GPUs" if "device" in points and (points["device"] == "cuda").any() else "ranks"


# ------------------------------------------------------------------------------------------------------ an experiment
def headline(summary: ExperimentSummary) -> str:
    """The tax as one plain line: the estimate with its interval, or why it is inconclusive."""
    tax = summary.tax
    if not math.isfinite(tax.tax):
        return "no estimate: too few timed steps (see incomplete)"
    ci = interval(tax.low, tax.high, tax.confidence)
    planted = f"; planted {pct(summary.planted_tax)}" if summary.planted_tax else ""
    if summary.conclusive:
        return f"{pct(tax.tax)} ({ci}){planted}"
    if not math.isfinite(tax.half_width):
        return f"inconclusive: {pct(tax.tax)} from one round, no interval{planted}"
    why = "spans zero" if tax.low <= 0 <= tax.high else f"wider than {pct_plain(2 * summary.conclusive_half_width)}"
    line = f"inconclusive: {pct(tax.tax)} ({ci}: {why}){planted}"
    if tax.half_width > PRECISE_HALF_WIDTH and summary.steps_needed:
        line += (f"; +/-{pct_plain(PRECISE_HALF_WIDTH)} would need about {summary.steps_needed} steps per run "
                 f"(about {duration(summary.time_needed_s)} on this hardware)")
    return line


def verdict_line(summary: ExperimentSummary) -> tuple[str, str]:
    """The verdict as one line, the first thing every output shows, with its tone ("good", "bad", "warn")."""
    if summary.outcome == RUNNING:
        return "warn", f"running: no verdict yet ({summary.running} still records it)"
    if summary.outcome == CALIBRATION:
        return "warn", "calibration (A/A pair: both arms on the baseline policy): no determinism verdict"
    strict = [(v, gate) for v, gate in zip(summary.verdicts, GATES, strict=True) if gate.strict]
    if summary.outcome == PASSED:
        steps = " and ".join(f"{v.gate} {v.compared_steps} steps" for v, _ in strict)
        return "good", f"deterministic: yes (every fingerprint agrees bit for bit: {steps})"
    if summary.outcome == FAILED:
        failed, gate = next((v, g) for v, g in strict if v.outcome == DIFFERS)
        m = failed.first_mismatch
        assert m is not None
        return "bad", f"deterministic: NO ({failed.gate} differs first at step {m.step}, rank {m.rank}, {m.metric})"
    if summary.outcome == DIVERGED:
        first = min((f for f in summary.nonfinite if f.deterministic), key=lambda f: (f.step, f.rank))
        return "bad", (f"deterministic: no verdict, training diverged: {first.describe()} (bits that agree on "
                       "non-finite values prove nothing)")
    reason = summary.problems[0] if summary.problems else (summary.faults[0] if summary.faults else "see the gates")
    more = f" (and {len(summary.problems) - 1} more)" if len(summary.problems) > 1 else ""
    return "bad", f"deterministic: no verdict, incomplete evidence: {reason}{more}"


def localize_command(summary: ExperimentSummary) -> str | None:
    """The ready-to-run command that narrows the first failing strict gate to an op (None when none failed)."""
    for v, gate in zip(summary.verdicts, GATES, strict=True):
        if gate.strict and v.outcome == DIFFERS and not summary.calibration:
            root = Path(summary.root)
            return f"taxbench localize {root / gate.reference.name} {root / gate.candidate.name}"
    return None


def knob_cost(result: KnobResult) -> str:
    """A knob's tax on its own with its interval, or why there is none."""
    if result.problems:
        return "incomplete (see incomplete)"
    if result.tax is None:
        return result.cost_status
    if not math.isfinite(result.tax.tax):
        return "no estimate"
    return f"{pct(result.tax.tax)} ({interval(result.tax.low, result.tax.high, result.tax.confidence)})"


def knob_need(result: KnobResult) -> str:
    """Whether determinism needs the knob: "yes", "no", "open" (runs incomplete) or why it was not tested."""
    if result.needed is not None:
        return "yes" if result.needed else "no"
    return "open" if result.needed_status == MEASURED else f"n/a ({result.needed_status})"


# --------------------------------------------------------------------------------------------------- a layouts folder
def repeatable_text(verdict: Verdict) -> str:
    if verdict.agree:
        return f"yes ({verdict.compared_steps} steps bitwise)"
    m = verdict.first_mismatch
    if verdict.outcome == DIFFERS and m is not None:
        return f"NO (step {m.step}, rank {m.rank}, {m.metric})"
    return "unknown (incomplete)"


def weights_text(identical: bool | None) -> str:
    return {True: "same", False: "differ", None: "missing"}[identical]


def first_difference_text(pair: PairResult) -> str:
    if pair.first_difference is None:
        return "none" if pair.final_weights_identical is not None else "none found (digest missing)"
    step, metric = pair.first_difference
    return "step 0 weights" if step == 0 else f"{metric} @{step}"


def ulp_text(values: list[int | None], steps: list[int]) -> str:
    """The largest per-step ulp distance and its step: "max 40 @3", "0" when every step is equal, "n/a" if none."""
    present = [(v, s) for v, s in zip(values, steps, strict=True) if v is not None]
    if not present:
        return "n/a"
    value, step = max(present, key=lambda item: (item[0], -item[1]))
    return "0" if value == 0 else f"max {value} @{step}"


def initial_weights_line(summary: LayoutsSummary) -> tuple[str, str]:
    identical = summary.initial_weights_identical
    digests = summary.initial_digests
    elements = next((layout.weights_elements for layout in summary.layouts if layout.weights_elements), 0)
    if identical:
        digest = next(iter(digests.values()))
        return "good", (f"identical step-0 weights: yes, every run of all {len(summary.layouts)} layouts starts from "
                        f"model digest {digest} ({elements:,} elements, layout-invariant digest)")
    if identical is None:
        missing = [key for key, value in digests.items() if value is None]
        return "bad", f"identical step-0 weights: unknown, no step-0 digest for {', '.join(missing)}"
    reference = next(iter(digests.values()))
    differing = [key for key, value in digests.items() if value != reference]
    return "bad", (f"identical step-0 weights: NO, {', '.join(differing)} differ from {next(iter(digests))}'s "
                   f"{reference}")
