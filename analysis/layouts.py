"""`taxbench layouts`: one recipe run under several parallel layouts, compared layout against layout.

Validation, not a gate. Per layout: whether its two runs agree bit for bit (repeatable on its own: every rank's
fingerprints, as the repeatability gate compares them). Across layouts, where per-rank fingerprints cannot compare
(each rank fingerprints its own shard), the layout-invariant quantities:
- the weights at step 0 and at the last step, by their layout-invariant digest (taxbench.parallel.logical_digest):
  layout-invariant initial values make step 0 identical by construction, and this is the evidence that it is;
- per step, the loss and the gradient norm of the whole job as float32 bit patterns, and their distance in ulps
  (units in the last place: how many float32 values lie between them).
The loss of a step is the mean of the ranks' recorded losses (data-parallel ranks each record their own batch's;
ranks of one replica record the same bits), taken in float64 and rounded to float32: exact for these few values, so
the number does not depend on the order it is summed in. The gradient norm is already the whole model's on every rank.

Outcome: exit 0 when every layout is repeatable, whatever differs between layouts (that is the finding); exit 3 when
a layout is not repeatable on its own (then its differences to others mean nothing); exit 4 when evidence is missing,
truncated or unreadable (a run cut short, a missing digest), never a pass.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from taxbench import exit_codes
from taxbench.analysis.results import finite_or_none, write_result
from taxbench.analysis.verdicts import DIFFERS, Verdict, compare_runs
from taxbench.config.layout_names import parse_layout_name
from taxbench.config.schema import ConfigError
from taxbench.design import run_name
from taxbench.rundir.json_object import read_json_object
from taxbench.rundir.plans import LaunchRecord, LayoutsPlan
from taxbench.rundir.plans import read_layouts_plan as read_plan
from taxbench.rundir.read import RecordError, load_checked_run
from taxbench.rundir.records import WEIGHTS_FORMAT, weights_file
from taxbench.rundir.run_manifest import Manifest, load_manifest
from taxbench.rundir.step_record import GRAD_NORM, GRAD_NORM_BITS, LOSS, LOSS_BITS, RANK, STEP, TIME_S

SUMMARY_FILE = "summary.json"
REPLICAS = ("0", "1")
INITIAL = "0"  # the weights' step before any training
WEIGHTS = "weights"  # beside the step record's LOSS and GRAD_NORM: the metrics a layouts pair compares


# ------------------------------------------------------------------------------------------------------------ ulps
def _ordered(bits: int, width: int) -> int:
    """A float's bit pattern as an integer that orders like the float (-0 and +0 both 0)."""
    magnitude = bits & ((1 << (width - 1)) - 1)
    return -magnitude if bits >> (width - 1) & 1 else magnitude


def _is_nan(bits: int, width: int) -> bool:
    mantissa_bits = {16: 10, 32: 23, 64: 52}[width]
    exponent = (bits >> mantissa_bits) & ((1 << (width - 1 - mantissa_bits)) - 1)
    return exponent == (1 << (width - 1 - mantissa_bits)) - 1 and bits & ((1 << mantissa_bits) - 1) != 0


def ulp_distance(a_bits: int, b_bits: int, width: int = 32) -> int | None:
    """How many representable floats of `width` bits (16, 32 or 64) lie between two bit patterns: 0 for the same
    value (and for -0 against +0), 1 for neighbours; None when either is a NaN."""
    if _is_nan(a_bits, width) or _is_nan(b_bits, width):
        return None
    return abs(_ordered(a_bits, width) - _ordered(b_bits, width))


def float32_bits(value: float) -> int:
    return int(np.array([value], dtype=np.float32).view(np.uint32)[0])


# ------------------------------------------------------------------------------------------------------- per layout
@dataclass
class LayoutResult:
    name: str
    layout: dict[str, Any]  # the manifest's: world size, dp, tp, pp, ep, ...
    repeatable: Verdict
    series: pd.DataFrame  # replica 0 per step: loss_bits, grad_norm_bits (float32 bit patterns as ints)
    digests: dict[str, dict[str, str | None]]  # replica -> step -> model digest (None: missing or not whole)
    weights_elements: int
    problems: list[str]
    notes: list[str]
    seconds: float | None
    median_step_s: float

    @property
    def factors(self) -> str:
        if not self.layout:
            return "n/a (no manifest)"
        return ".".join(f"{key}{self.layout.get(key)}" for key in ("pp", "tp", "dp", "ep")) + \
            f" {self.layout.get('data_parallel')}"

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "layout": self.layout, "repeatable": self.repeatable.to_dict(),
                "digests": self.digests, "weights_elements": self.weights_elements, "problems": self.problems,
                "notes": self.notes, "seconds": self.seconds, "median_step_s": finite_or_none(self.median_step_s)}


def _whole_job_series(frame: pd.DataFrame, run: str) -> tuple[pd.DataFrame, list[str]]:
    """Per step: the job's loss (mean of the ranks' float32 losses in float64, rounded to float32) and grad norm, as
    float32 bit patterns; notes where the ranks' grad norms disagree (they are the whole model's on every rank)."""
    notes = []
    grouped = frame.groupby(STEP, sort=True)
    loss = grouped[LOSS].mean().astype(np.float64).to_numpy().astype(np.float32)
    grad_norm = grouped[GRAD_NORM].mean().astype(np.float64).to_numpy().astype(np.float32)
    disagree = grouped[GRAD_NORM_BITS].nunique()
    if (disagree > 1).any():
        notes.append(f"{run}: the ranks' grad norms differ at {int((disagree > 1).sum())} step(s) (first: step "
                     f"{int(disagree[disagree > 1].index[0])}); compared as their mean")
    series = pd.DataFrame({STEP: grouped[LOSS].mean().index.to_numpy(dtype=np.int64),
                           LOSS_BITS: loss.view(np.uint32).astype(np.int64),
                           GRAD_NORM_BITS: grad_norm.view(np.uint32).astype(np.int64)})
    return series, notes


def _digests(run_dir: Path, steps: int) -> tuple[dict[str, str | None], int, list[str]]:
    """The run's model digests at step 0 and its last step, the model's element count, and what is missing."""
    path = weights_file(run_dir)
    wanted = (INITIAL, str(steps))
    if not path.exists():
        return dict.fromkeys(wanted), 0, [f"{path}: missing; the run's weights were never digested (the run did not "
                                          "start, or ran under an older taxbench)"]
    try:
        stored = read_json_object(path, "weights digest")
    except RecordError as exc:
        return dict.fromkeys(wanted), 0, [str(exc)]
    if stored.get("run") != run_dir.name or stored.get("format") != WEIGHTS_FORMAT:
        return dict.fromkeys(wanted), 0, [
            f"{path}: digests of run {stored.get('run')!r} in format {stored.get('format')!r}, not of {run_dir.name} "
            f"in format {WEIGHTS_FORMAT!r}; was it copied from another run?"]
    found = stored.get("steps") if isinstance(stored.get("steps"), dict) else {}
    digests: dict[str, str | None] = {}
    problems = []
    elements = 0
    for step in wanted:
        entry = found.get(step)
        if not isinstance(entry, dict) or not isinstance(entry.get("model"), str):
            why = "; ".join(entry.get("problems", [])[:2]) if isinstance(entry, dict) else "no digest recorded"
            problems.append(f"{path}: no whole-model digest at step {step} ({why or 'damaged'})")
            digests[step] = None
            continue
        digests[step] = entry["model"]
        elements = int(entry.get("elements", 0))
    return digests, elements, problems


def layout_identity_problems(run_dir: Path, name: str, manifest: Manifest | None) -> list[str]:
    """Whether the run's manifest describes the layout its folder is named for (a run copied from another layout's
    folder would compare a layout with itself)."""
    if manifest is None:
        return []
    try:
        expected = parse_layout_name(name)
    except ConfigError as exc:
        return [f"{run_dir.parent}: not a layout folder name ({exc})"]
    recorded = manifest.layout_or_empty
    wanted = {"pp": expected.pp, "tp": expected.tp, "ep": expected.ep}
    if expected.dp is not None:
        wanted["dp"] = expected.dp
    differing = [f"{key}={recorded.get(key)}" for key, value in wanted.items() if recorded.get(key) != value]
    parallel = manifest.recipe_parallel
    configured = {"virtual_stages": expected.virtual_stages}
    if expected.data_parallel is not None:
        configured["data_parallel"] = expected.data_parallel.value
    differing += [f"{key}={parallel.get(key)}" for key, value in configured.items() if parallel.get(key) != value]
    if differing:
        return [f"{run_dir / 'manifest.json'}: describes a layout with {', '.join(differing)}, not {name}; was it "
                "copied from another layout's folder?"]
    return []


def analyse_layout(root: Path, name: str, arm: str, steps: int, launch: LaunchRecord | None) -> LayoutResult:
    folder = root / name
    runs = [run_name(arm, replica) for replica in REPLICAS]
    problems: list[str] = []
    if launch is not None and launch.failure:
        problems.append(f"layout {name}: {launch.failure}")
    frames: dict[str, pd.DataFrame] = {}
    layout: dict[str, Any] = {}
    digests: dict[str, dict[str, str | None]] = {}
    elements = 0
    config: dict[str, Any] | None = None  # the layout's, as its first run's manifest holds it: both runs must hold it
    for replica, run in zip(REPLICAS, runs, strict=True):
        try:
            manifest = load_manifest(folder / run)
            config = config if config is not None else manifest.run_config
            frame, found = load_checked_run(folder / run, manifest, steps, config)
        except RecordError as exc:
            frame, found, manifest = pd.DataFrame(columns=[STEP, RANK, LOSS, GRAD_NORM]), [str(exc)], None
        frames[run] = frame
        problems += found
        layout = layout or dict(manifest.layout_or_empty if manifest is not None else {})
        problems += layout_identity_problems(folder / run, name, manifest)
        digests[replica], count, missing = _digests(folder / run, steps)
        elements = elements or count
        problems += missing
    repeatable = (compare_runs("repeatability", runs[0], frames[runs[0]], runs[1], frames[runs[1]], 0,
                               tuple(problems)) if all(LOSS_BITS in f for f in frames.values()) else
                  Verdict("repeatability", runs[0], runs[1], False, 0, None, 0, tuple(problems)))
    reference = frames[runs[0]]
    series, notes = (_whole_job_series(reference, f"{name}/{runs[0]}") if not reference.empty else
                     (pd.DataFrame(columns=[STEP, LOSS_BITS, GRAD_NORM_BITS]), []))
    median = float(reference.groupby(STEP)[TIME_S].max().median()) if TIME_S in reference and \
        not reference.empty else math.nan
    return LayoutResult(name, layout, repeatable, series, digests, elements, problems, notes,
                        launch.seconds if launch else None, median)


# ------------------------------------------------------------------------------------------------------- per pair
@dataclass
class PairResult:
    reference: str
    candidate: str
    initial_weights_identical: bool | None  # None: a digest is missing
    final_weights_identical: bool | None
    first_difference: tuple[int, str] | None  # (step, metric); step 0 is the initial weights
    steps: list[int]
    loss_ulp: list[int | None]  # per step (None: a NaN, or a step one layout lacks)
    grad_norm_ulp: list[int | None]

    @property
    def identical(self) -> bool:
        return self.first_difference is None and self.final_weights_identical is True

    def max_ulp(self, metric: str) -> int | None:
        values = [v for v in (self.loss_ulp if metric == LOSS else self.grad_norm_ulp) if v is not None]
        return max(values) if values else None

    def to_dict(self) -> dict[str, Any]:
        first = self.first_difference
        return {"reference": self.reference, "candidate": self.candidate,
                "initial_weights_identical": self.initial_weights_identical,
                "final_weights_identical": self.final_weights_identical,
                "first_difference": None if first is None else {"step": first[0], "metric": first[1]},
                "max_loss_ulp": self.max_ulp(LOSS), "max_grad_norm_ulp": self.max_ulp(GRAD_NORM),
                "per_step": [{"step": s, "loss_ulp": lu, "grad_norm_ulp": gu}
                             for s, lu, gu in zip(self.steps, self.loss_ulp, self.grad_norm_ulp, strict=True)]}


def _same(a: str | None, b: str | None) -> bool | None:
    return None if a is None or b is None else a == b


def compare_layouts(a: LayoutResult, b: LayoutResult, steps: int) -> PairResult:
    """Replica 0 of two layouts: weights at step 0 and at the last step, loss and grad norm per step."""
    initial = _same(a.digests.get("0", {}).get(INITIAL), b.digests.get("0", {}).get(INITIAL))
    final = _same(a.digests.get("0", {}).get(str(steps)), b.digests.get("0", {}).get(str(steps)))
    left, right = a.series.set_index(STEP), b.series.set_index(STEP)
    wanted = list(range(1, steps + 1))
    loss_ulp: list[int | None] = []
    norm_ulp: list[int | None] = []
    first: tuple[int, str] | None = (0, WEIGHTS) if initial is False else None
    for step in wanted:
        if step not in left.index or step not in right.index:
            loss_ulp.append(None)
            norm_ulp.append(None)
            continue
        ulps = {metric: ulp_distance(int(left.at[step, f"{metric}_bits"]), int(right.at[step, f"{metric}_bits"]))
                for metric in (LOSS, GRAD_NORM)}
        loss_ulp.append(ulps[LOSS])
        norm_ulp.append(ulps[GRAD_NORM])
        if first is None:
            differing = [m for m in (LOSS, GRAD_NORM)
                         if left.at[step, f"{m}_bits"] != right.at[step, f"{m}_bits"]]
            if differing:
                first = (step, differing[0])
    if first is None and final is False:
        first = (steps, WEIGHTS)
    return PairResult(a.name, b.name, initial, final, first, wanted, loss_ulp, norm_ulp)


# ------------------------------------------------------------------------------------------------------ the summary
@dataclass
class LayoutsSummary:
    root: str
    plan: LayoutsPlan
    layouts: list[LayoutResult]
    pairs: list[PairResult]

    @property
    def problems(self) -> list[str]:
        return [p for layout in self.layouts for p in layout.problems]

    @property
    def not_repeatable(self) -> list[str]:
        return [layout.name for layout in self.layouts if layout.repeatable.outcome == DIFFERS]

    @property
    def initial_digests(self) -> dict[str, str | None]:
        """'<layout>/<replica>' -> its step-0 model digest."""
        return {f"{layout.name}/{replica}": layout.digests.get(replica, {}).get(INITIAL)
                for layout in self.layouts for replica in REPLICAS}

    @property
    def initial_weights_identical(self) -> bool | None:
        """True on positive evidence only: every run of every layout digested its step-0 weights, all alike."""
        values = list(self.initial_digests.values())
        if any(v is None for v in values):
            return None
        return len(set(values)) == 1

    @property
    def exit_code(self) -> int:
        codes = [exit_codes.NOT_DETERMINISTIC if self.not_repeatable else exit_codes.OK]
        if self.problems:
            codes.append(exit_codes.INCOMPLETE)
        return exit_codes.combined(codes)

    def verdict(self) -> tuple[str, str]:
        """The outcome as one line and its tone ("good", "bad", "warn")."""
        if self.not_repeatable:
            return "bad", (f"not repeatable on its own: {', '.join(self.not_repeatable)} (its two runs differ; "
                           "differences to other layouts mean nothing until it is)")
        if self.problems:
            more = f" (and {len(self.problems) - 1} more)" if len(self.problems) > 1 else ""
            return "bad", f"incomplete evidence: {self.problems[0]}{more}"
        differing = [p for p in self.pairs if not p.identical]
        if not differing:
            return "good", f"every layout repeatable, and all {len(self.layouts)} layouts agree bit for bit"
        return "warn", (f"every layout repeatable; {len(differing)} of {len(self.pairs)} layout pairs differ "
                        "(see the table: first step, metric, ulps)")

    def to_dict(self) -> dict[str, Any]:
        return {"root": self.root, "recipe": self.plan.recipe, "arm": self.plan.arm, "steps": self.plan.steps,
                "world_size": self.plan.world_size, "verdict": self.verdict()[1],
                "initial_weights_identical": self.initial_weights_identical,
                "initial_digests": self.initial_digests, "not_repeatable": self.not_repeatable,
                "layouts": [layout.to_dict() for layout in self.layouts],
                "pairs": [pair.to_dict() for pair in self.pairs], "incomplete": self.problems,
                "exit_code": self.exit_code}


@dataclass
class LayoutsAnalysis:
    summary: LayoutsSummary

    def step_values(self) -> pd.DataFrame:
        """Per step (index) the loss and grad norm each layout's first run compared with, as floats:
        columns loss/<layout> and grad_norm/<layout>."""
        columns = {}
        for layout in self.summary.layouts:
            series = layout.series.set_index(STEP)
            for metric in (LOSS, GRAD_NORM):
                bits = series[f"{metric}_bits"].to_numpy(dtype=np.int64).astype(np.uint32)
                columns[f"{metric}/{layout.name}"] = pd.Series(bits.view(np.float32).astype(np.float64),
                                                               index=series.index)
        return pd.DataFrame(columns).sort_index()


def analyse_layouts(root: Path) -> LayoutsAnalysis:
    """Compare the layouts under `root` (a `taxbench layouts` folder) and write its summary.json."""
    plan = read_plan(root)
    layouts = [analyse_layout(root, name, plan.arm, plan.steps, plan.launches.get(name)) for name in plan.layouts]
    pairs = [compare_layouts(a, b, plan.steps) for i, a in enumerate(layouts) for b in layouts[i + 1:]]
    summary = LayoutsSummary(str(root), plan, layouts, pairs)
    write_result(root / SUMMARY_FILE, json.dumps(summary.to_dict(), indent=2))
    return LayoutsAnalysis(summary)
