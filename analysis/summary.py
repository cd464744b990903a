"""Analyse one experiment directory: completeness, tax, gates, the fault self-test, and the console summary.

Fail closed: every run is checked against its manifest first (records.check_run). An experiment whose runs are
complete and whose strict gates agree bit for bit passed (exit 0); a strict gate with a differing fingerprint failed
(exit 3, even when records are also missing: the difference is proven); anything else, missing, truncated or
duplicated records, or an enabled fault that never fired, is "incomplete" (exit 4), never a pass.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from taxbench import exit_codes
from taxbench.analysis.records import (
    RecordError,
    ResultWriteError,
    check_run,
    load_fault_events,
    load_manifest,
    load_run,
    manifest_value,
)
from taxbench.analysis.tax import TaxEstimate, estimate_tax, no_estimate, steps_for_half_width
from taxbench.analysis.verdicts import DIFFERS, INCOMPLETE, Verdict, compare_runs
from taxbench.oserrors import describe_os_error
from taxbench.records import RunWriteError, write_atomically

SUMMARY_FILE = "summary.json"

# (gate, reference run, candidate run, whether a failure is a failure of the deterministic recipe)
GATES = (
    ("repeatability", "deterministic-0", "deterministic-1", True),
    ("restart_replay", "deterministic-0", "deterministic-resumed", True),
    ("baseline_sanity", "baseline-0", "baseline-1", False),
)
RUN_NAMES = tuple(sorted({n for g in GATES for n in g[1:3]}))
PASSED, FAILED, INCOMPLETE_OUTCOME = "passed", "failed", "incomplete"
SHOWN_PROBLEMS = 3  # console lines of incompleteness; summary.json and the report hold them all


@dataclass
class ExperimentSummary:
    experiment: str
    root: str
    recipe: str
    world_size: int
    device: str
    tax: TaxEstimate
    verdicts: list[Verdict]
    steps_needed: int  # per arm, for a +/-0.5% interval at the measured CV
    problems: list[str] = field(default_factory=list)  # what makes runs incomplete: run, ranks, steps
    faults: list[str] = field(default_factory=list)  # the injected fault: where it fired, or that it never did
    fault_fired: bool | None = None  # None: no fault configured
    # The gates' own cost: median seconds per step spent on fingerprints (outside the timed step); NaN if unrecorded.
    fingerprint_s: float = math.nan

    @property
    def deterministic_ok(self) -> bool:
        """Both strict gates have positive evidence of agreement (complete runs, every record bitwise equal)."""
        return all(v.agree for v, gate in zip(self.verdicts, GATES, strict=True) if gate[3])

    @property
    def outcome(self) -> str:
        strict = [v for v, gate in zip(self.verdicts, GATES, strict=True) if gate[3]]
        if any(v.outcome == DIFFERS for v in strict):
            return FAILED
        if self.problems or self.fault_fired is False or not self.deterministic_ok:
            return INCOMPLETE_OUTCOME
        return PASSED

    @property
    def exit_code(self) -> int:
        return {PASSED: exit_codes.OK, FAILED: exit_codes.NOT_DETERMINISTIC,
                INCOMPLETE_OUTCOME: exit_codes.INCOMPLETE}[self.outcome]

    def to_dict(self) -> dict[str, Any]:
        return {
            "experiment": self.experiment,
            "root": self.root,
            "recipe": self.recipe,
            "world_size": self.world_size,
            "device": self.device,
            "tax": self.tax.to_dict(),
            "verdicts": [v.to_dict() for v in self.verdicts],
            "steps_needed": self.steps_needed,
            "deterministic_ok": self.deterministic_ok,
            "outcome": self.outcome,
            "exit_code": self.exit_code,
            "incomplete": self.problems,
            "faults": self.faults,
            "fault_fired": self.fault_fired,
            "fingerprint_s": self.fingerprint_s if math.isfinite(self.fingerprint_s) else None,
        }


@dataclass
class ExperimentAnalysis:
    """A summary together with what it was computed from, for reports and wandb."""

    summary: ExperimentSummary
    runs: dict[str, pd.DataFrame]  # run name -> step records of all ranks
    manifests: dict[str, dict[str, Any]]  # run name -> manifest.json


def write_result(path: Path, data: str | bytes) -> None:
    """Write an analysis result whole (a .tmp renamed into place); a failure is one line naming the path."""
    payload = data.encode("utf-8") if isinstance(data, str) else data
    try:
        write_atomically(path, lambda handle: handle.write(payload))
    except OSError as exc:
        reason = str(exc) if isinstance(exc, RunWriteError) else describe_os_error(exc, path)
        raise ResultWriteError(f"cannot write {reason}; make {path.parent} writable (or copy the results to a "
                               "writable folder) and analyse again") from exc


def _load(root: Path, name: str, manifest: dict) -> tuple[pd.DataFrame, list[str]]:
    """One run's records and what keeps them from covering its manifest's steps x ranks."""
    run_dir = root / name
    steps = int(manifest_value(manifest, run_dir, "config.experiment.steps"))
    world = int(manifest_value(manifest, run_dir, "layout.world_size"))
    frame = load_run(run_dir, empty_ok=True)
    return frame, check_run(name, run_dir, frame, steps, world)


def fault_outcome(root: Path, experiment: dict[str, Any]) -> tuple[list[str], bool | None]:
    """Lines saying where the configured fault fired (or that it never did), and whether it fired."""
    fault = experiment.get("fault") or {}
    if not isinstance(fault, dict) or not fault.get("enabled"):
        return [], None
    target = f"{fault.get('arm')}-{fault.get('replica')}"
    events = load_fault_events(root / target) if (root / target).is_dir() else []
    if not events:
        return [f"{target}: fault {fault.get('kind')} configured but never fired: the self-test tested nothing"], False
    return [f"{target}: {event.describe()}" for event in events], True


def _tax(runs: dict[str, pd.DataFrame], experiment: dict[str, Any], incomplete: bool) -> TaxEstimate:
    try:
        return estimate_tax(runs["baseline-0"], runs["deterministic-0"], experiment["warmup_steps"],
                            experiment["confidence"])
    except ValueError as exc:
        if incomplete:  # too few records for a tax: the incompleteness is what the user needs to hear about
            return no_estimate(experiment["confidence"], experiment["warmup_steps"])
        raise RecordError(str(exc)) from exc


def _median_fingerprint_s(frames: Iterable[pd.DataFrame]) -> float:
    times = [frame["fingerprint_s"].dropna() for frame in frames if "fingerprint_s" in frame]
    times = [t for t in times if not t.empty]
    return float(pd.concat(times).median()) if times else math.nan


def analyse_experiment(root: Path) -> ExperimentAnalysis:
    manifests = {name: load_manifest(root / name) for name in RUN_NAMES}
    manifest = manifests["deterministic-0"]
    experiment = manifest_value(manifest, root / "deterministic-0", "config.experiment")
    loaded = {name: _load(root, name, manifests[name]) for name in RUN_NAMES}
    runs = {name: frame for name, (frame, _) in loaded.items()}
    problems = {name: found for name, (_, found) in loaded.items()}
    timed_incomplete = bool(problems["baseline-0"] or problems["deterministic-0"])
    tax = _tax(runs, experiment, timed_incomplete)
    verdicts = []
    for gate, reference, candidate, _ in GATES:
        from_step = experiment["resume_step"] if gate == "restart_replay" else 0
        verdicts.append(compare_runs(gate, reference, runs[reference], candidate, runs[candidate], from_step,
                                     tuple(problems[reference] + problems[candidate])))
    faults, fired = fault_outcome(root, experiment)
    cv = max(tax.baseline_cv, tax.deterministic_cv)
    summary = ExperimentSummary(
        experiment=root.name,
        root=str(root),
        recipe=manifest_value(manifest, root / "deterministic-0", "config.recipe.name"),
        world_size=manifest_value(manifest, root / "deterministic-0", "layout.world_size"),
        device=manifest_value(manifest, root / "deterministic-0", "policy_applied.device"),
        tax=tax,
        verdicts=verdicts,
        steps_needed=steps_for_half_width(cv) if math.isfinite(cv) else 0,
        problems=[line for name in RUN_NAMES for line in problems[name]],
        faults=faults,
        fault_fired=fired,
        fingerprint_s=_median_fingerprint_s(runs.values()),
    )
    write_result(root / SUMMARY_FILE, json.dumps(summary.to_dict(), indent=2))
    return ExperimentAnalysis(summary, runs, manifests)


def analyse(root: Path) -> ExperimentSummary:
    return analyse_experiment(root).summary


def pct(value: object) -> str:
    """A fraction as a signed percentage ("+1.23%"), or "n/a" when it is missing or not finite."""
    return "n/a" if not isinstance(value, float) or not math.isfinite(value) else f"{value * 100:+.2f}%"


def pct_plain(value: object) -> str:
    """A fraction as an unsigned percentage with one decimal ("1.2%"), or "n/a"."""
    return "n/a" if not isinstance(value, float) or not math.isfinite(value) else f"{value * 100:.1f}%"


def ms(seconds: object, digits: int = 2) -> str:
    """Seconds as milliseconds ("12.34 ms"), or "n/a" when missing or not finite."""
    if not isinstance(seconds, float) or not math.isfinite(seconds):
        return "n/a"
    return f"{seconds * 1e3:.{digits}f} ms"


def gate_outcome(verdict: Verdict, strict: bool) -> str:
    """One line per gate: the verdict, and where a failing gate first differs."""
    if verdict.agree:
        after = f" after step {verdict.from_step}" if verdict.from_step else ""
        return f"[green]bitwise identical[/green] ({verdict.compared_steps} steps{after})"
    if verdict.outcome == INCOMPLETE:
        label = "[red]INCOMPLETE[/red]" if strict else "[yellow]incomplete[/yellow]"
        agreed = (f"the {verdict.compared_steps} steps both runs hold agree" if verdict.compared_steps else
                  "no step to compare")
        return f"{label} (see incomplete); {agreed}"
    m = verdict.first_mismatch
    assert m is not None
    label = "[red]DIFFERS[/red]" if strict else "[yellow]differs[/yellow]"
    where = f"{label} first at step {m.step}, rank {m.rank}, {m.metric}"
    return where + (" (among the records both runs hold)" if verdict.problems else "")


def _shown_problems(problems: list[str]) -> str:
    lines = [escape(p) for p in problems[:SHOWN_PROBLEMS]]
    if len(problems) > SHOWN_PROBLEMS:
        lines.append(f"... {len(problems) - SHOWN_PROBLEMS} more in {SUMMARY_FILE}")
    return "\n".join(lines)


def render(summary: ExperimentSummary, console: Console | None = None, report_path: Path | None = None) -> None:
    """The final console summary: one compact table that fits an 80-column terminal."""
    console = console or Console()
    tax = summary.tax
    level = int(round(tax.confidence * 100))
    table = Table(box=None, show_header=False, pad_edge=False, padding=(0, 1),
                  title=f"[bold]{summary.experiment}[/bold]  {summary.recipe} | {summary.world_size} ranks | "
                        f"{summary.device}", title_justify="left")
    table.add_column(style="bold", no_wrap=True)
    table.add_column(overflow="fold")
    interval = escape(f"[{pct(tax.low)}, {pct(tax.high)}]")
    table.add_row("tax", f"[bold]{pct(tax.tax)}[/bold]  {level}% CI {interval}  HL {pct(tax.hl_tax)}")
    table.add_row("step time", f"baseline {ms(tax.baseline_median_s)} (CV {pct_plain(tax.baseline_cv)})  "
                               f"deterministic {ms(tax.deterministic_median_s)} "
                               f"(CV {pct_plain(tax.deterministic_cv)})")
    for verdict, (_, _, _, strict) in zip(summary.verdicts, GATES, strict=True):
        table.add_row(verdict.gate, gate_outcome(verdict, strict))
    if summary.problems:
        table.add_row("[red]incomplete[/red]", _shown_problems(summary.problems))
    for line in summary.faults:
        table.add_row("fault", escape(line) if summary.fault_fired else f"[red]{escape(line)}[/red]")
    if tax.drifting:
        table.add_row("[yellow]warning[/yellow]", "step times still drifting (MSER-5 hit its cap); run more steps")
    sample = f"{tax.pairs} block pairs after {tax.warmup_steps} warmup steps"
    if summary.steps_needed > tax.steady_steps:
        sample += f"; +/-0.5% needs ~{summary.steps_needed} steps/arm"
    table.add_row("sample", sample)
    if math.isfinite(summary.fingerprint_s) and tax.baseline_median_s > 0:
        share = summary.fingerprint_s / tax.baseline_median_s
        table.add_row("gates' cost", f"fingerprints {ms(summary.fingerprint_s)}/step ({pct_plain(share)} of a baseline "
                                     "step), outside the timed step")
    table.add_row("results", summary.root if report_path is None else f"{summary.root}\n{report_path}")
    console.print(table)

