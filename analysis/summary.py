"""Analyse one experiment directory: tax, gates, and the console summary."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


def analyse(root: Path) -> ExperimentSummary:
    manifest = load_manifest(root / "deterministic-0")
    config = manifest["config"]
    experiment = config["experiment"]
    runs = {name: load_run(root / name) for name in {n for g in GATES for n in g[1:3]}}
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
    return summary


def _pct(value: float) -> str:
    return "n/a" if not math.isfinite(value) else f"{value * 100:+.2f}%"


def render(summary: ExperimentSummary, console: Console | None = None) -> None:
    console = console or Console()
    tax = summary.tax
    console.print(f"[bold]{summary.experiment}[/bold]  recipe={summary.recipe}  ranks={summary.world_size}  "
                  f"device={summary.device}  results: {summary.root}")
    timing = Table(title="Step time (steady state)", show_edge=False)
    for column in ("arm", "median step", "CV"):
        timing.add_column(column)
    timing.add_row("baseline", f"{tax.baseline_median_s * 1e3:.2f} ms", f"{tax.baseline_cv * 100:.1f}%")
    timing.add_row("deterministic", f"{tax.deterministic_median_s * 1e3:.2f} ms", f"{tax.deterministic_cv * 100:.1f}%")
    console.print(timing)
    level = int(round(tax.confidence * 100))
    console.print(
        f"Determinism tax: [bold]{_pct(tax.tax)}[/bold]  {level}% CI [{_pct(tax.low)}, {_pct(tax.high)}]  "
        f"(Hodges-Lehmann {_pct(tax.hl_tax)} [{_pct(tax.hl_low)}, {_pct(tax.hl_high)}]; {tax.pairs} block pairs, "
        f"warmup {tax.warmup_steps} steps)"
    )
    if tax.drifting:
        console.print("[yellow]warning: step times still drifting (MSER-5 hit its cap); run more steps[/yellow]")
    if summary.steps_needed and summary.steps_needed > tax.pairs:
        console.print(f"for a +/-0.5% interval at this noise level: ~{summary.steps_needed} steps per arm")
    gates = Table(title="Bitwise gates", show_edge=False)
    for column in ("gate", "runs", "verdict", "first mismatch (step, rank, metric)"):
        gates.add_column(column)
    for verdict, (_, _, _, strict) in zip(summary.verdicts, GATES, strict=True):
        if verdict.agree:
            outcome = f"[green]bitwise identical[/green] ({verdict.compared_steps} steps)"
            where = "-"
        else:
            outcome = "[red]DIFFERS[/red]" if strict else "[yellow]differs[/yellow]"
            m = verdict.first_mismatch
            assert m is not None
            where = f"step {m.step}, rank {m.rank}, {m.metric}"
        gates.add_row(verdict.gate, f"{verdict.reference} vs {verdict.candidate}", outcome, where)
    console.print(gates)
