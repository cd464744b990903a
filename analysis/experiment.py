"""One experiment's results: the typed result model (ExperimentSummary, ExperimentAnalysis) and the pipeline that
computes it from the runs' records (completeness, tax, gates, the fault self-test, ablation, throughput).

Fail closed: every run is checked against its manifest first (records.check_run). An experiment whose runs are
complete and whose strict gates agree bit for bit passed (exit 0); a strict gate with a differing fingerprint failed
(exit 3, even when records are also missing: the difference is proven); deterministic runs that trained on a NaN or
infinite loss or gradient norm "diverged" (exit 4: bits that agree on non-finite values prove nothing, see
taxbench.analysis.divergence); anything else, missing, truncated or duplicated records, or an enabled fault that never
fired, is "incomplete" (exit 4), never a pass.

This module computes and renders nothing: summary.json (taxbench.analysis.summary), the console
(taxbench.analysis.console), the report (taxbench.analysis.report) and wandb (taxbench.analysis.wandb_log) present
the one result it returns, in words from taxbench.analysis.text.
"""

from __future__ import annotations

import math
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import pandas as pd

from taxbench import exit_codes
from taxbench.analysis.ablation import KnobResult, analyse_ablation
from taxbench.analysis.attribution import SHARE_OF, attribute_arms
from taxbench.analysis.cost import CostSplit, cost_split
from taxbench.analysis.divergence import NonFinite, nonfinite_runs
from taxbench.analysis.equivalence import Equivalence, baseline_equivalence
from taxbench.analysis.results import finite_or_none
from taxbench.analysis.throughput import THROUGHPUT_FIELDS, ArmThroughput, arm_throughput, cost_of_tax
from taxbench.analysis.verdicts import DIFFERS, Verdict, compare_runs
from taxbench.config.schema import ConfigError, ExperimentConfig, FaultConfig, load_config
from taxbench.design import (
    EQUIVALENCE_RUNS,
    GATED_RUNS,
    GATES,
    INTERLEAVED,
    MEASURED,
    RESUMED,
    TIMED,
    WITH,
    RunRef,
    knob_arm,
    run_steps,
)
from taxbench.rundir.cost_file import read_cost
from taxbench.rundir.read import (
    FaultEvent,
    RecordError,
    UnreadableRecords,
    empty_run,
    load_checked_run,
    load_fault_events,
    step_losses,
    step_times,
)
from taxbench.rundir.records import MANIFEST, METRICS
from taxbench.rundir.run_manifest import Manifest, load_manifest
from taxbench.rundir.step_record import (
    BLOCK,
    DATA_S,
    FINGERPRINT_S,
    GRAD_NORM,
    LOSS,
    MEM_PEAK_BYTES,
    RANK,
    STEP,
    TIME_S,
    TOKENS,
)
from taxbench.rundir.stop_file import STEPS, STOP_FILE, read_stop
from taxbench.rundir.write_scope import running as still_running
from taxbench.stats.tax import (
    Checkpoints,
    TaxEstimate,
    block_ratios,
    estimate_tax,
    no_estimate,
    steps_for_half_width,
)

PASSED, FAILED, INCOMPLETE_OUTCOME, CALIBRATION = "passed", "failed", "incomplete", "calibration"
RUNNING = "running"  # a live launch still writes the experiment: no verdict yet (exit 4), read by a reading command
DIVERGED = "diverged"  # the deterministic runs trained on non-finite values: no verdict (exit 4)
ARMS = ("baseline", "deterministic")
# ExperimentSummary.interleave of a `taxbench run -- COMMAND` experiment: whole runs alternated in pairs
# (taxbench.analysis.command_experiment), not blocks interleaved in rounds.
WHOLE_RUNS = "whole runs"


@dataclass
class ExperimentSummary:
    experiment: str
    root: str
    recipe: str
    world_size: int
    device: str
    tax: TaxEstimate
    verdicts: list[Verdict]
    steps_needed: int  # per run, for a +/-0.5% interval, extrapolated from the measured half-width (0: no interval)
    time_needed_s: float  # the experiment's duration at steps_needed steps per run on this hardware
    steps: int  # every run's steps (a precision target decides it at run time)
    stopped_by: str  # "steps", "target_half_width" or "max_steps"
    target_half_width: float  # 0: none
    conclusive_half_width: float
    planted_tax: float  # the known tax planted in every deterministic step (0: none)
    calibration: bool  # an A/A pair: both arms on the baseline policy; never a determinism result
    rank_median_s: list[float]  # each rank's median step time over the timed runs after warmup
    throughput: dict[str, ArmThroughput | None]  # arm -> tokens/s, TFLOP/s, MFU, memory (None: not recorded)
    code: str  # taxbench version and git commit ("+dirty") of the runs, from their provenance
    cost: dict[str, float | None]  # what the tax costs: tokens/s lost, device-hours per day
    # The deterministic loss curve against the baseline pair's noise: statistical, never part of the outcome
    equivalence: Equivalence
    problems: list[str] = field(default_factory=list)  # what makes runs incomplete: run, ranks, steps
    faults: list[str] = field(default_factory=list)  # the injected fault: where it fired, or that it never did
    fault_fired: bool | None = None  # None: no fault configured
    # The gates' own cost: median seconds per step spent on fingerprints (outside the timed step); NaN if unrecorded.
    fingerprint_s: float = math.nan
    ablation: list[KnobResult] = field(default_factory=list)  # per knob (experiment.ablation=true), KNOBS order
    # arm -> its ops against the baseline's, by growth per step (experiment.ablation=true; analysis.attribution)
    attribution: dict[str, pd.DataFrame] = field(default_factory=dict)
    interleave: str = "pair"  # experiment.interleave: which runs were timed (policy: one model, switched per block)
    # Each run's first NaN/Inf loss and gradient norm (taxbench.analysis.divergence); in deterministic runs: DIVERGED
    nonfinite: list[NonFinite] = field(default_factory=list)

    @property
    def diverged(self) -> bool:
        """A deterministic run trained on a non-finite loss or gradient norm."""
        return any(finding.deterministic for finding in self.nonfinite)
    gate_steps: int = 0  # the steps of a gate-only run (taxbench.design.run_steps); 0: as the timed runs
    # Who still writes the experiment (a live launch; taxbench.rundir.write_scope.running), for a reading command:
    # no verdict yet, whatever the records so far say; None for a finished one
    running: str | None = None
    # Where the launch's wall clock went (analysis.cost); None for experiments from before cost.json
    cost_split: CostSplit | None = None

    @property
    def deterministic_ok(self) -> bool:
        """Both strict gates have positive evidence of agreement (complete runs, every record bitwise equal) on a
        deterministic recipe (a calibration pair is no evidence of determinism)."""
        strict = (v for v, gate in zip(self.verdicts, GATES, strict=True) if gate.strict)
        return (not self.calibration and not self.diverged and self.running is None
                and all(v.agree for v in strict))

    @property
    def conclusive(self) -> bool:
        """The tax interval is narrower than +/-conclusive_half_width and does not span zero."""
        tax = self.tax
        return (math.isfinite(tax.half_width) and tax.half_width <= self.conclusive_half_width
                and not tax.low <= 0 <= tax.high)

    @property
    def rank_spread(self) -> float:
        """(slowest - fastest rank's median step) / median over ranks; NaN with fewer than two ranks."""
        medians = [m for m in self.rank_median_s if math.isfinite(m)]
        if len(medians) < 2:
            return math.nan
        return (max(medians) - min(medians)) / float(pd.Series(medians).median())

    @property
    def outcome(self) -> str:
        strict = [v for v, gate in zip(self.verdicts, GATES, strict=True) if gate.strict]
        differs = not self.calibration and any(v.outcome == DIFFERS for v in strict)
        if self.running is not None and not differs:  # a proven difference stays one; anything else may still change
            return RUNNING
        if self.calibration:  # the gates then compare baseline-policy runs: shown, but no verdict on determinism
            return INCOMPLETE_OUTCOME if self.problems else CALIBRATION
        if differs:
            return FAILED
        if self.diverged:
            return DIVERGED
        if self.problems or self.fault_fired is False or not self.deterministic_ok:
            return INCOMPLETE_OUTCOME
        return PASSED

    @property
    def exit_code(self) -> int:
        return {PASSED: exit_codes.OK, CALIBRATION: exit_codes.OK, FAILED: exit_codes.NOT_DETERMINISTIC,
                DIVERGED: exit_codes.INCOMPLETE, INCOMPLETE_OUTCOME: exit_codes.INCOMPLETE,
                RUNNING: exit_codes.INCOMPLETE}[self.outcome]

    def to_dict(self) -> dict[str, Any]:
        return {
            "experiment": self.experiment,
            "root": self.root,
            "recipe": self.recipe,
            "world_size": self.world_size,
            "device": self.device,
            "tax": self.tax.to_dict(),
            "verdicts": [v.to_dict() for v in self.verdicts],
            "conclusive": self.conclusive,
            "steps_needed": self.steps_needed,
            "time_needed_s": finite_or_none(self.time_needed_s),
            "steps": self.steps,
            "stopped_by": self.stopped_by,
            "target_half_width": self.target_half_width,
            "planted_tax": self.planted_tax,
            "calibration": self.calibration,
            "interleave": self.interleave,
            "gate_steps": self.gate_steps,
            "cost_split": None if self.cost_split is None else self.cost_split.to_dict(),
            "rank_median_s": [finite_or_none(m) for m in self.rank_median_s],
            "rank_spread": finite_or_none(self.rank_spread),
            "throughput": {arm: None if t is None else t.to_dict() for arm, t in self.throughput.items()},
            "cost": self.cost,
            "code": self.code,
            "deterministic_ok": self.deterministic_ok,
            "outcome": self.outcome,
            "exit_code": self.exit_code,
            "running": self.running,
            "incomplete": self.problems,
            "nonfinite": [finding.to_dict() for finding in self.nonfinite],
            "faults": self.faults,
            "fault_fired": self.fault_fired,
            "fingerprint_s": finite_or_none(self.fingerprint_s),
            "ablation": [k.to_dict() for k in self.ablation],
            "attribution": {arm: {"share_of": ops.attrs.get(SHARE_OF), "ops": ops.to_dict(orient="records")}
                            for arm, ops in self.attribution.items()},
            "equivalence": {key: finite_or_none(value) if isinstance(value, float) else value
                            for key, value in self.equivalence.to_dict().items()},
        }


@dataclass
class ExperimentAnalysis:
    """A summary together with what it was computed from, for reports and wandb."""

    summary: ExperimentSummary
    runs: dict[str, pd.DataFrame]  # run name -> step records of all ranks (the fields of analysed_fields)
    timed: dict[str, list[pd.DataFrame]]  # arm -> its interleaved (timed) runs' records
    manifests: dict[str, Manifest]  # run name -> its manifest.json

    @cached_property
    def step_times(self) -> dict[str, pd.DataFrame]:
        """Arm -> its first timed run's step time per step (the slowest rank's; step, time_s, block), for the plots."""
        return {arm: step_times(self.runs[f"{arm}-0"]) for arm in ARMS}

    @cached_property
    def step_series(self) -> dict[str, pd.DataFrame]:
        """Arm -> its first timed run per step: the job's step time, loss, grad norm and tokens/s (run_step_series)."""
        return {arm: run_step_series(self.runs[f"{arm}-0"], self.step_times[arm],
                                     self.manifests[f"{arm}-0"].data_parallel)
                for arm in ARMS}

    @cached_property
    def block_ratios(self) -> pd.DataFrame:
        """The per-block deterministic/baseline ratios the tax is estimated from (same warmup, same steps left out
        after checkpoint commits), for the plots: computed once, on first use, whichever presenter asks."""
        experiment = self.manifests[TIMED["deterministic"].name].experiment_config
        stop = read_stop(Path(self.summary.root))
        return block_ratios(self.timed["baseline"], self.timed["deterministic"], self.summary.tax.warmup_steps,
                            Checkpoints.of(experiment, None if stop is None else stop.commits))


def run_step_series(frame: pd.DataFrame, times: pd.DataFrame, dp: int) -> pd.DataFrame:
    """Per step of one run: the job's step time (slowest rank; `times` is step_times(frame)), the loss (mean over
    ranks), the global grad norm (as rank 0 recorded it) and the job's tokens/s (rank 0's tokens per step x dp / step
    time)."""
    time_s = times.set_index(STEP)[TIME_S]
    first_rank = frame[frame[RANK] == frame[RANK].min()].drop_duplicates(STEP).set_index(STEP)
    return pd.DataFrame({
        "step_time": time_s,
        "loss": step_losses(frame),
        "grad_norm": first_rank[GRAD_NORM],
        "tokens_per_s": first_rank[TOKENS] * dp / time_s,
    }).sort_index()


def experiment_settings(config: dict[str, Any], run_dir: Path) -> ExperimentConfig:
    """The experiment's settings as the run's manifest records them, typed (taxbench.config.schema.load_config): the
    analysis reads the schema's defaults, never defaults of its own. A config the schema refuses is a damaged
    manifest (exit 4)."""
    try:
        return load_config(config).experiment
    except ConfigError as exc:
        raise UnreadableRecords(f"{run_dir / MANIFEST}: its config does not load ({exc}); the manifest is damaged "
                                "or was written by another taxbench version") from exc


def expected_steps(root: Path, experiment: dict[str, Any]) -> tuple[int, str, list[str]]:
    """Every timed run's steps, what stopped the rounds, and why that is in doubt. stop.json records the steps the
    timed runs took (a precision target decides them at run time); without a target they must be experiment.steps.
    A gate-only run's steps follow from them (taxbench.design.run_steps)."""
    steps = int(experiment["steps"])
    stop = read_stop(root)
    if stop is None:
        return steps, "unknown", [f"{root / STOP_FILE}: missing or damaged: the interleaved rounds never finished, "
                                  "so the runs' length is unknown; continue the experiment "
                                  "(experiment.continue_existing=true)"]
    if float(experiment.get("target_half_width", 0)) <= 0:
        if stop.steps != steps or stop.stopped_by != STEPS:
            return steps, "unknown", [f"{root / STOP_FILE}: steps={stop.steps} stopped by {stop.stopped_by}, but "
                                      f"the manifests' experiment.steps={steps} has no precision target"]
        return steps, STEPS, []
    if stop.steps < steps or stop.steps % int(experiment["block_steps"]):
        return steps, "unknown", [f"{root / STOP_FILE}: steps={stop.steps} is not a whole number of blocks at "
                                  f"or above experiment.steps={steps}"]
    return stop.steps, stop.stopped_by, []


def recipe_label(recipe: dict[str, Any]) -> str:
    """The recipe's name, and a custom model's factory (every custom model would otherwise read as its recipe)."""
    model = recipe.get("model") or {}
    target = (model.get("factory") or {}).get("_target_") if model.get("kind") == "custom" else None
    return f"{recipe.get('name')} ({target})" if target else str(recipe.get("name"))


def code_of(manifest: Manifest) -> str:
    """'taxbench 0.1.0 @ 1a2b3c4d5e6f+dirty' from the manifest's provenance ('unknown' for older runs)."""
    provenance = manifest.provenance or {}
    if not provenance:
        return "unknown"
    commit = provenance.get("commit")
    where = f" @ {commit[:12]}{'+dirty' if provenance.get('dirty') else ''}" if commit else ""
    return f"taxbench {provenance.get('version')}{where}"


# The record fields the analysis keeps of a checked run (load_checked_run reads identity and schema version first).
# Of every run: the gates, non-finite values, training curves and what the fingerprints cost.
GATE_FIELDS = (STEP, RANK, LOSS, GRAD_NORM, FINGERPRINT_S, *METRICS)
# Of the timed runs and each arm's first run too: the tax, throughput, and the step times and series of the report.
TIMED_FIELDS = (*GATE_FIELDS, BLOCK, TIME_S, DATA_S, TOKENS, MEM_PEAK_BYTES)


def analysed_fields(name: str, timed_names: Collection[str]) -> tuple[str, ...]:
    """What the analysis keeps of run `name`. With fingerprints packed (taxbench.rundir.hex_columns) the frame of
    1,000 ranks x 1,000 steps then holds 120 MB (80 MB for a gate-only run) instead of the records' 290 MB, and the
    five runs of an experiment fit in a GiB."""
    return TIMED_FIELDS if name in timed_names or name in {ref.name for ref in TIMED.values()} else GATE_FIELDS


def interleaved_runs(experiment: dict[str, Any]) -> tuple[RunRef, ...]:
    """The runs that were timed (an experiment without experiment.interleave timed the *-0 pair only)."""
    return INTERLEAVED[experiment.get("interleave", "pair")]


def timed_runs(runs: dict[str, pd.DataFrame], experiment: dict[str, Any]) -> dict[str, list[pd.DataFrame]]:
    """Each arm's interleaved (timed) runs."""
    interleaved = interleaved_runs(experiment)
    return {arm: [runs[ref.name] for ref in interleaved if ref.arm == arm] for arm in ARMS}


def after_warmup(frame: pd.DataFrame, warmup: int, columns: list[str]) -> pd.DataFrame:
    """`columns` (those the frame has) of the records after the warmup: selected first, since filtering the whole
    frame of 1,000 ranks x 1,000 steps copies every column."""
    return frame[[c for c in columns if c in frame]].loc[frame[STEP].to_numpy() > warmup]


def rank_medians(timed: dict[str, list[pd.DataFrame]], warmup: int) -> list[float]:
    """Each rank's median step time over every timed run after the warmup (rank order)."""
    frames = [after_warmup(frame, warmup, [RANK, TIME_S]) for runs in timed.values() for frame in runs]
    frames = [frame for frame in frames if not frame.empty]
    if not frames:
        return []
    return pd.concat(frames).groupby(RANK)[TIME_S].median().sort_index().tolist()


def _fault_target(fault: FaultConfig) -> str | None:
    """The run the configured fault corrupts (None without an enabled fault)."""
    return f"{fault.arm}-{fault.replica}" if fault.enabled else None


def _fault_events(root: Path, target: str) -> list[FaultEvent]:
    return load_fault_events(root / target) if (root / target).is_dir() else []


def unrecorded_faults(root: Path, fault: FaultConfig, steps: int) -> list[str]:
    """A fault that fired at a step past those the records hold: records cut back to before it are not the evidence
    of the run that was corrupted (incomplete, never a pass)."""
    target = _fault_target(fault)
    if target is None:
        return []
    return [f"{root / target}: {event.describe()}, but the records hold steps 1-{steps} only: records cut back "
            "before the fault are not this run's evidence" for event in _fault_events(root, target)
            if event.step > steps]


def fault_outcome(root: Path, fault: FaultConfig, verdicts: list[Verdict]) -> tuple[list[str], bool | None]:
    """Lines saying where the configured fault fired (or that it never did), and whether the self-test tested
    anything: a fault that fired in a run that a gate still finds identical to its reference tested nothing either
    (False, an incomplete outcome), as a fault that never fired."""
    target = _fault_target(fault)
    if target is None:
        return [], None
    events = _fault_events(root, target)
    if not events:
        return [f"{target}: fault {fault.kind.value} configured but never fired: the self-test tested nothing"], False
    lines = [f"{target}: {event.describe()}" for event in events]
    passing = [v.gate for v in verdicts if v.agree and target in (v.reference, v.candidate)]
    if passing:
        lines.append(f"{target}: the fault fired, yet {', '.join(passing)} found the runs identical: the "
                     "corruption never reached a fingerprint, or these records are not the corrupted run's")
    return lines, not passing


def _tax(timed: dict[str, list[pd.DataFrame]], experiment: dict[str, Any], incomplete: bool,
         checkpoints: Checkpoints) -> TaxEstimate:
    try:
        return estimate_tax(timed["baseline"], timed["deterministic"], experiment["warmup_steps"],
                            experiment["confidence"], checkpoints)
    except ValueError as exc:
        if incomplete:  # too few records for a tax: the incompleteness is what the user needs to hear about
            return no_estimate(experiment["confidence"], experiment["warmup_steps"])
        raise RecordError(str(exc)) from exc


def step_deltas_us(tax: TaxEstimate, knobs: list[KnobResult]) -> dict[str, float | None]:
    """Each profiled arm's measured step-time growth over the baseline (microseconds; None: not measured)."""
    def delta(estimate: TaxEstimate | None) -> float | None:
        if estimate is None:
            return None
        value = (estimate.deterministic_median_s - estimate.baseline_median_s) * 1e6
        return value if math.isfinite(value) else None

    deltas = {"deterministic": delta(tax)}
    deltas.update({knob_arm(WITH, k.knob): delta(k.tax) for k in knobs if k.cost_status == MEASURED})
    return deltas


def _median_fingerprint_s(frames: Iterable[pd.DataFrame]) -> float:
    times = [frame[FINGERPRINT_S].dropna() for frame in frames if FINGERPRINT_S in frame]
    times = [t for t in times if not t.empty]
    return float(pd.concat(times).median()) if times else math.nan


class StillRunning(UnreadableRecords):
    """A reading command was pointed at an experiment whose live launch has not recorded a run yet (exit 4: no
    evidence yet, nothing wrong with it)."""


def _started(run_dir: Path) -> bool:
    return (run_dir / MANIFEST).exists() or (run_dir / MANIFEST).is_symlink()


def _kept_fields(frame: pd.DataFrame, fields: Collection[str]) -> pd.DataFrame:
    return frame[[name for name in frame.columns if name in fields]]


def compute_experiment(root: Path) -> ExperimentAnalysis:
    """The experiment's results from its runs' records and manifests (taxbench.analysis.summary records them in
    summary.json). It writes nothing: the records' Arrow mirrors are written only by a caller that asks for them
    (taxbench.rundir.read.leave_mirrors, which taxbench.analysis.publish runs before it analyses)."""
    began = time.perf_counter()
    running = still_running(root)
    first = TIMED["deterministic"].name  # every run's manifest holds the experiment's config; read it from one
    if running is not None and not _started(root / first):
        raise StillRunning(f"{root} is running ({running}) and has not started its runs yet; nothing to analyse: "
                           "analyse it again when the launch has finished")
    manifest = load_manifest(root / first)
    config = manifest.run_config
    experiment = manifest.experiment_config
    settings = experiment_settings(config, root / first)
    # The gated runs, then timed runs of their own (experiment.interleave=policy: the shared model's <arm>-timed).
    names = GATED_RUNS + tuple(ref.name for ref in interleaved_runs(experiment) if ref.name not in GATED_RUNS)
    # A run the live launch has not started yet has no manifest: it is missing evidence, said as such.
    waiting = [name for name in names if running is not None and not _started(root / name)]
    manifests = {name: manifest if name == first else load_manifest(root / name) for name in names
                 if name not in waiting}
    steps, stopped_by, stop_problems = expected_steps(root, experiment)
    stop = read_stop(root)
    checkpoints = Checkpoints.of(experiment, None if stop is None else stop.commits)
    timed_names = {ref.name for ref in interleaved_runs(experiment)}
    run_steps_of = {name: run_steps(name, timed_names, steps, experiment) for name in names}
    loaded = {name: load_checked_run(root / name, manifests[name], run_steps_of[name], config,
                                     analysed_fields(name, timed_names)) for name in names if name not in waiting}
    loaded.update({name: (_kept_fields(empty_run(), analysed_fields(name, timed_names)),
                          [f"{root / name}: not started yet (the experiment is running)"])
                   for name in waiting})
    runs = {name: frame for name, (frame, _) in loaded.items()}
    problems = {name: found for name, (_, found) in loaded.items()}
    timed = timed_runs(runs, experiment)
    timed_incomplete = any(problems[ref.name] for ref in interleaved_runs(experiment)) or bool(stop_problems)
    tax = _tax(timed, experiment, timed_incomplete, checkpoints)
    target = _fault_target(settings.fault)
    if target in problems:
        problems[target] += unrecorded_faults(root, settings.fault, run_steps_of[target])
    verdicts = []
    for gate in GATES:
        reference, candidate = gate.reference.name, gate.candidate.name
        from_step = experiment["resume_step"] if gate.after_resume else 0
        # A gate compares the steps both runs take (a gate-only run takes fewer than a timed one).
        through = min(run_steps_of[reference], run_steps_of[candidate])
        verdicts.append(compare_runs(gate.name, reference, runs[reference], candidate, runs[candidate], from_step,
                                     tuple(problems[reference] + problems[candidate]), through))
    faults, fired = fault_outcome(root, settings.fault, verdicts)
    device = manifest.device
    knobs = analyse_ablation(root, config, timed["baseline"], steps, checkpoints)
    world = manifest.world_size
    attribution, attribution_problems = ({}, []) if not settings.ablation else attribute_arms(
        root, step_deltas_us(tax, knobs), world)
    equivalence = baseline_equivalence(runs, int(experiment["warmup_steps"]),
                                       stop_problems + [line for name in EQUIVALENCE_RUNS for line in problems[name]])
    steps_needed = steps_for_half_width(tax)
    # The whole experiment at that length: every run (timed or not) at its arm's median step.
    # Timed runs grow with the steps; gate-only runs stay at their own length.
    medians = {"baseline": tax.baseline_median_s, "deterministic": tax.deterministic_median_s}
    step_cost = sum(medians[arm] for name in names for arm in medians if name.startswith(arm) and name in timed_names)
    gate_cost = sum(medians[arm] * run_steps_of[name] for name in names for arm in medians
                    if name.startswith(arm) and name not in timed_names)
    throughput = {arm: arm_throughput([after_warmup(f, tax.warmup_steps, THROUGHPUT_FIELDS) for f in frames],
                                      medians[arm], world, manifest.throughput)
                  for arm, frames in timed.items()}
    summary = ExperimentSummary(
        experiment=root.name,
        root=str(root),
        recipe=recipe_label(manifest.recipe),
        world_size=world,
        device=device,
        tax=tax,
        verdicts=verdicts,
        steps_needed=steps_needed,
        time_needed_s=steps_needed * step_cost + gate_cost if steps_needed else math.nan,
        steps=steps,
        stopped_by=stopped_by,
        target_half_width=settings.target_half_width,
        conclusive_half_width=settings.conclusive_half_width,
        planted_tax=settings.planted_tax,
        calibration=settings.calibration,
        rank_median_s=rank_medians(timed, tax.warmup_steps),
        throughput=throughput,
        code=code_of(manifest),
        cost=cost_of_tax(throughput["baseline"], throughput["deterministic"], tax.tax, world),
        equivalence=equivalence,
        problems=(stop_problems + [line for name in names for line in problems[name]]
                  + [line for knob in knobs for line in knob.problems] + attribution_problems),
        faults=faults,
        fault_fired=fired,
        fingerprint_s=_median_fingerprint_s(runs.values()),
        ablation=knobs,
        attribution=attribution,
        interleave=str(experiment.get("interleave", "pair")),
        nonfinite=nonfinite_runs(runs),
        gate_steps=run_steps(RESUMED.name, (), steps, experiment),
        running=running,
    )
    # Analysis's own time: up to here, and the summary's write after it (small)
    summary.cost_split = cost_split(read_cost(root), runs, timed_names, time.perf_counter() - began)
    return ExperimentAnalysis(summary, runs, timed, manifests)
