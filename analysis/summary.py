"""Analyse one experiment directory: tax, gates, and the console summary."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
from rich.console import Console
from rich.table import Table

from taxbench.analysis.records import load_manifest, load_run
from taxbench.analysis.tax import TaxEstimate, estimate_tax, steps_for_half_width
from taxbench.analysis.verdicts import Verdict, compare_runs

SUMMARY_FILE = "summary.json"

# (gate, reference run, candidate run, whether a failure is a failure of the deterministic recipe)
GATES = (
    ("repeatability", "deterministic-0", "deterministic-1", True),
    ("restart_replay", "deterministic-0", "deterministic-resumed", True),
    ("baseline_sanity", "baseline-0", "baseline-1", False),
)


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

    @property
    def deterministic_ok(self) -> bool:
        return all(v.agree for v, gate in zip(self.verdicts, GATES, strict=True) if gate[3])

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
        }


@dataclass
class ExperimentAnalysis:
    """A summary together with what it was computed from, for reports and wandb."""

    summary: ExperimentSummary
    runs: dict[str, pd.DataFrame]  # run name -> step records of all ranks
    manifests: dict[str, dict[str, Any]]  # run name -> manifest.json


def analyse_experiment(root: Path) -> ExperimentAnalysis:
    names = sorted({n for g in GATES for n in g[1:3]})
    manifests = {name: load_manifest(root / name) for name in names}
    manifest = manifests["deterministic-0"]
    config = manifest["config"]
    experiment = config["experiment"]
    runs = {name: load_run(root / name) for name in names}
    tax = estimate_tax(runs["baseline-0"], runs["deterministic-0"], experiment["warmup_steps"],
                       experiment["confidence"])
    verdicts = []
    for gate, reference, candidate, _ in GATES:
        from_step = experiment["resume_step"] if gate == "restart_replay" else 0
        verdicts.append(compare_runs(gate, reference, runs[reference], candidate, runs[candidate], from_step))
    cv = max(tax.baseline_cv, tax.deterministic_cv)
    summary = ExperimentSummary(
        experiment=root.name,
        root=str(root),
        recipe=config["recipe"]["name"],
        world_size=manifest["layout"]["world_size"],
        device=manifest["policy_applied"]["device"],
        tax=tax,
        verdicts=verdicts,
        steps_needed=steps_for_half_width(cv) if math.isfinite(cv) else 0,
    )
    (root / SUMMARY_FILE).write_text(json.dumps(summary.to_dict(), indent=2), encoding="utf-8")
    return ExperimentAnalysis(summary, runs, manifests)


def analyse(root: Path) -> ExperimentSummary:
    return analyse_experiment(root).summary


def pct(value: object) -> str:
    """A fraction as a signed percentage ("+1.23%"), or "n/a" when it is missing or not finite."""
    return "n/a" if not isinstance(value, float) or not math.isfinite(value) else f"{value * 100:+.2f}%"


def gate_outcome(verdict: Verdict, strict: bool) -> str:
    """One line per gate: the verdict, and where a failing gate first differs."""
    if verdict.agree:
        after = f" after step {verdict.from_step}" if verdict.from_step else ""
        return f"[green]bitwise identical[/green] ({verdict.compared_steps} steps{after})"
    m = verdict.first_mismatch
    assert m is not None
    label = "[red]DIFFERS[/red]" if strict else "[yellow]differs[/yellow]"
    return f"{label} first at step {m.step}, rank {m.rank}, {m.metric}"


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
    table.add_row("tax", f"[bold]{pct(tax.tax)}[/bold]  {level}% CI [{pct(tax.low)}, {pct(tax.high)}]  "
                         f"HL {pct(tax.hl_tax)}")
    table.add_row("step time", f"baseline {tax.baseline_median_s * 1e3:.2f} ms (CV {tax.baseline_cv * 100:.1f}%)  "
                               f"deterministic {tax.deterministic_median_s * 1e3:.2f} ms "
                               f"(CV {tax.deterministic_cv * 100:.1f}%)")
    for verdict, (_, _, _, strict) in zip(summary.verdicts, GATES, strict=True):
        table.add_row(verdict.gate, gate_outcome(verdict, strict))
    if tax.drifting:
        table.add_row("[yellow]warning[/yellow]", "step times still drifting (MSER-5 hit its cap); run more steps")
    sample = f"{tax.pairs} block pairs after {tax.warmup_steps} warmup steps"
    if summary.steps_needed > tax.steady_steps:
        sample += f"; +/-0.5% needs ~{summary.steps_needed} steps/arm"
    table.add_row("sample", sample)
    table.add_row("results", summary.root if report_path is None else f"{summary.root}\n{report_path}")
    console.print(table)
