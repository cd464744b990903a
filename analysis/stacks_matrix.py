"""`taxbench stacks`: the matrix no one publishes. One experiment per cell (a training stack under one policy for its
deterministic arm: the stack's own switch, or taxbench's full policy), read back as one table of tax +/- interval and
the three gate verdicts per stack and policy.

The folder holds stacks.json (what was asked for: every cell, the recipe and parameter count it ran, and why a cell
did not run) and one experiment folder per cell that ran (<stack>-<policy>/). A cell that cannot run here is a row of
its own, never a failure: "not installed" (the stack's extra is missing; the pip line), "needs CUDA" (Megatron-Core on
a CPU machine), "not wired" (the stack's switch is not wired as a stack-native arm; the refusal's reason).

Outcome: the worst of the run cells' verdicts (taxbench.exit_codes.combined: a strict gate that differs, 3, before
missing evidence, 4, before a pass). A cell whose ranks failed or whose experiment cannot be analysed is incomplete
(4); a matrix where no cell ran has no evidence at all (4), never a pass.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from taxbench import exit_codes
from taxbench.analysis.report import REPORT_DIR, Block, Heading, Paragraph, Report, TableBlock, write_report
from taxbench.analysis.summary import (
    FAILED,
    INCOMPLETE_OUTCOME,
    SUMMARY_FILE,
    ExperimentAnalysis,
    ExperimentSummary,
    analyse_experiment,
    pct,
    pct_plain,
    write_result,
)
from taxbench.analysis.verdicts import DIFFERS, IDENTICAL, Verdict
from taxbench.design import GATES, TIMED
from taxbench.rundir.read import RecordError, UnreadableRecords, read_json_object

PLAN_FILE = "stacks.json"  # <root>/stacks.json: the cells asked for, what each ran, and why a cell did not
NOT_INSTALLED, NEEDS_CUDA, NOT_WIRED = "not installed", "needs CUDA", "not wired"
SKIPPED = (NOT_INSTALLED, NEEDS_CUDA, NOT_WIRED)
# The deterministic arm's mode (conf/mode/) per policy column, and how the table names it
POLICY_LABELS = {"stack_native": "own switch", "deterministic": "taxbench's policy"}
HEADER = ["stack", "recipe", "parameters", "deterministic arm", "tax +/- interval",
          *(gate.name.replace("_", " ") for gate in GATES)]


# ------------------------------------------------------------------------------------------------ the plan record
@dataclass
class Cell:
    stack: str  # the stack's short name: native, titan, megatron, deepspeed
    policy: str  # the deterministic arm's mode: stack_native or deterministic
    recipe: str
    parameters: int | None  # the recipe's model on the meta device (None: the stack is not installed)
    skipped: str | None = None  # one of SKIPPED; None: the cell runs
    reason: str = ""  # why it did not run, one line (the install line, the refusal)
    seconds: float | None = None  # wall-clock time of its experiment (launch to exit)
    failure: str | None = None  # a rank that died or raised, one line

    @property
    def name(self) -> str:
        """Its experiment's folder under the matrix root."""
        return f"{self.stack}-{self.policy}"


@dataclass
class StacksPlan:
    family: str  # dense or moe: which recipe each stack runs
    steps: int
    world_size: int
    device: str
    cells: list[Cell] = field(default_factory=list)
    shape: str = ""  # the model and batch fields given to every stack that builds its model from them

    def write(self, root: Path) -> None:
        write_result(root / PLAN_FILE, json.dumps(asdict(self), indent=2))


def read_plan(root: Path) -> StacksPlan:
    stored = read_json_object(root / PLAN_FILE, "stacks record")
    try:
        cells = [Cell(**cell) for cell in stored["cells"]]
        plan = StacksPlan(str(stored["family"]), int(stored["steps"]), int(stored["world_size"]),
                          str(stored["device"]), cells, str(stored.get("shape", "")))
    except (KeyError, TypeError, ValueError) as exc:
        raise UnreadableRecords(f"{root / PLAN_FILE}: not a stacks record ({exc}); the file is damaged") from exc
    names = [cell.name for cell in plan.cells]
    wrong = [cell.name for cell in plan.cells if cell.skipped not in (None, *SKIPPED) or
             cell.policy not in POLICY_LABELS]
    if not names or len(set(names)) != len(names) or wrong:
        raise UnreadableRecords(f"{root / PLAN_FILE}: cells {names} are not distinct stack-policy cells "
                                f"{'(' + ', '.join(wrong) + ')' if wrong else ''}; the file is damaged or edited")
    return plan


def is_stacks_folder(root: Path) -> bool:
    return (root / PLAN_FILE).is_file()


# ------------------------------------------------------------------------------------------------------ the results
@dataclass
class CellResult:
    cell: Cell
    summary: ExperimentSummary | None  # None: skipped, or its experiment could not be analysed
    problems: list[str] = field(default_factory=list)  # a failed launch, an experiment that cannot be read
    # An own-switch cell's audit from its manifest: what taxbench's full policy would add or change (None: not one)
    audit: list[str] | None = None

    @property
    def ran(self) -> bool:
        return self.cell.skipped is None

    @property
    def exit_code(self) -> int:
        if not self.ran:
            return exit_codes.OK
        codes = [exit_codes.INCOMPLETE] if self.problems or self.summary is None else []
        return exit_codes.combined(codes + ([self.summary.exit_code] if self.summary else []))

    @property
    def outcome(self) -> str:
        if not self.ran:
            return str(self.cell.skipped)
        if self.summary is None or (self.problems and self.summary.outcome != FAILED):
            return INCOMPLETE_OUTCOME  # a proven difference still outranks the missing evidence, as in exit_code
        return self.summary.outcome

    def verdict(self, gate: str) -> Verdict | None:
        return next((v for v in self.summary.verdicts if v.gate == gate), None) if self.summary else None

    def to_dict(self) -> dict[str, Any]:
        s = self.summary
        return {**asdict(self.cell), "name": self.cell.name, "outcome": self.outcome, "exit_code": self.exit_code,
                "tax": None if s is None else s.tax.to_dict(), "conclusive": None if s is None else s.conclusive,
                "gates": {} if s is None else {v.gate: v.outcome for v in s.verdicts},
                "problems": self.problems + ([] if s is None else s.problems), "audit": self.audit}


@dataclass
class StacksSummary:
    root: str
    plan: StacksPlan
    cells: list[CellResult]

    @property
    def ran(self) -> list[CellResult]:
        return [cell for cell in self.cells if cell.ran]

    @property
    def exit_code(self) -> int:
        if not self.ran:
            return exit_codes.INCOMPLETE
        return exit_codes.combined(cell.exit_code for cell in self.ran)

    @property
    def deterministic_ok(self) -> bool:
        return bool(self.ran) and all(c.exit_code == exit_codes.OK and c.summary and c.summary.deterministic_ok
                                      for c in self.ran)

    def verdict(self) -> tuple[str, str]:
        """The outcome as one line and its tone ("good", "bad", "warn")."""
        skipped = len(self.cells) - len(self.ran)
        not_run = f"; {skipped} cell{'s' if skipped != 1 else ''} not run (listed)" if skipped else ""
        if not self.ran:
            return "bad", "no cell ran here: no evidence for any stack (see why below)"
        failed = [c.cell.name for c in self.ran if c.exit_code == exit_codes.NOT_DETERMINISTIC]
        if failed:
            return "bad", f"not bitwise deterministic: {', '.join(failed)} (a strict gate differs){not_run}"
        incomplete = [c.cell.name for c in self.ran if c.exit_code != exit_codes.OK]
        if incomplete:
            return "bad", f"incomplete evidence: {', '.join(incomplete)} (no verdict for those){not_run}"
        return "good", f"every cell that ran is bitwise deterministic ({len(self.ran)} cells){not_run}"

    def to_dict(self) -> dict[str, Any]:
        return {"root": self.root, "family": self.plan.family, "steps": self.plan.steps,
                "world_size": self.plan.world_size, "device": self.plan.device, "shape": self.plan.shape,
                "verdict": self.verdict()[1],
                "exit_code": self.exit_code, "cells": [cell.to_dict() for cell in self.cells]}


def analyse_cell(root: Path, cell: Cell, on_experiment: Callable[[ExperimentAnalysis], None] | None) -> CellResult:
    if cell.skipped is not None:
        return CellResult(cell, None)
    problems = [f"{cell.name}: {cell.failure}"] if cell.failure else []
    try:
        analysis = analyse_experiment(root / cell.name)
    except (RecordError, ValueError, KeyError, OSError) as exc:
        return CellResult(cell, None, [*problems, f"{cell.name}: not analysed ({exc})"])
    if on_experiment is not None:
        on_experiment(analysis)
    manifest = analysis.manifests.get(TIMED["deterministic"].name, {})
    audit = manifest.get("stack_native_audit") if (manifest.get("policy") or {}).get("stack_native") else None
    return CellResult(cell, analysis.summary, problems, [str(line) for line in audit] if audit is not None else None)


def analyse_stacks(root: Path, on_experiment: Callable[[ExperimentAnalysis], None] | None = None) -> StacksSummary:
    """Analyse every cell's experiment under `root` (a `taxbench stacks` folder) and write its summary.json;
    on_experiment sees each cell's full analysis (to write its report) before its records are dropped."""
    plan = read_plan(root)
    summary = StacksSummary(str(root), plan, [analyse_cell(root, cell, on_experiment) for cell in plan.cells])
    write_result(root / SUMMARY_FILE, json.dumps(summary.to_dict(), indent=2))
    return summary


# ---------------------------------------------------------------------------------------------------------- words
def parameters_text(count: int | None) -> str:
    if count is None:
        return "n/a"
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if count >= size:
            return f"{count / size:.3g}{unit}"
    return str(count)


def tax_text(cell: CellResult) -> str:
    if not cell.ran:
        return str(cell.cell.skipped)
    if cell.summary is None:
        return "not analysed"
    tax, summary = cell.summary.tax, cell.summary
    if not math.isfinite(tax.tax):
        return "n/a (too few timed steps)"
    if not math.isfinite(tax.half_width):
        return f"{pct(tax.tax)} (no interval)"
    return f"{pct(tax.tax)} +/-{pct_plain(tax.half_width)}" + ("" if summary.conclusive else " (inconclusive)")


def gate_text(verdict: Verdict | None) -> str:
    if verdict is None:
        return "—"
    if verdict.outcome == IDENTICAL:
        return "identical"
    m = verdict.first_mismatch
    if verdict.outcome == DIFFERS and m is not None:
        return f"differs (step {m.step}, rank {m.rank}, {m.metric})"
    return "incomplete"


def matrix_rows(summary: StacksSummary) -> list[list[str]]:
    """The table's rows, HEADER's columns: the console, the report and wandb show the same words."""
    return [[c.cell.stack, c.cell.recipe, parameters_text(c.cell.parameters), POLICY_LABELS[c.cell.policy],
             tax_text(c), *(gate_text(c.verdict(gate.name)) for gate in GATES)] for c in summary.cells]


def _mark(verdict: Verdict | None, strict: bool) -> str:
    if verdict is None:
        return ""
    return {IDENTICAL: "[green]✓[/green]", DIFFERS: "[red]✗[/red]" if strict else "[yellow]~[/yellow]"}.get(
        verdict.outcome, "[red]?[/red]" if strict else "[yellow]?[/yellow]")


GATES_LEGEND = ("gates: repeatability, restart replay, baseline sanity (✓ identical, ✗ differs, ~ baseline runs "
                "differ, ? incomplete)")


def console_tax(cell: CellResult) -> str:
    """tax_text, shorter: one decimal, and a trailing * for an inconclusive interval."""
    tax = cell.summary.tax if cell.summary else None
    if tax is None or not math.isfinite(tax.tax) or not math.isfinite(tax.half_width):
        return tax_text(cell)
    return f"{tax.tax * 100:+.1f}% ±{tax.half_width * 100:.1f}%" + ("" if cell.summary.conclusive else "*")


def console_rows(summary: StacksSummary) -> list[list[str]]:
    """The table as the console shows it, narrow enough for 80 columns: the three gates as marks in one column."""
    return [[escape(c.cell.stack), escape(c.cell.recipe), parameters_text(c.cell.parameters),
             "own" if c.cell.policy == "stack_native" else "taxbench", escape(console_tax(c)),
             " ".join(_mark(c.verdict(gate.name), gate.strict) for gate in GATES)] for c in summary.cells]


def audits(summary: StacksSummary) -> dict[str, list[str]]:
    """Per own-switch cell ("<stack>'s own switch"): what taxbench's full policy would add or change."""
    return {f"{c.cell.stack}'s own switch": c.audit or ["nothing (the switch sets everything taxbench's policy does)"]
            for c in summary.cells if c.audit is not None}


def failing(cell: CellResult) -> bool:
    return cell.ran and cell.exit_code != exit_codes.OK


def not_run_lines(summary: StacksSummary) -> list[str]:
    return [f"{c.cell.stack}, {POLICY_LABELS[c.cell.policy]}: {c.cell.skipped}: {c.cell.reason}"
            for c in summary.cells if not c.ran]


def problem_lines(summary: StacksSummary) -> list[str]:
    return [p for c in summary.cells for p in c.problems + (c.summary.problems if c.summary else [])]


def render_stacks(summary: StacksSummary, console: Console | None = None, report: Path | None = None) -> None:
    console = console or Console()
    plan = summary.plan
    tone, line = summary.verdict()
    colour = {"good": "green", "bad": "red", "warn": "yellow"}[tone]
    console.print(f"[bold]{escape(Path(summary.root).name)}[/bold]  stacks matrix | {plan.family} recipes | "
                  f"{plan.world_size} ranks on {plan.device} | {plan.steps} steps per run")
    if plan.shape:
        console.print(f"shape    {escape(plan.shape)} (torchtitan: its flavor's own)", soft_wrap=True)
    console.print(f"[bold {colour}]{escape(line)}[/bold {colour}]")
    table = Table(box=None, padding=(0, 1))
    for column in ("stack", "recipe", "params", "arm", "tax", "gates"):
        table.add_column(column, overflow="fold")
    for cell, row in zip(summary.cells, console_rows(summary), strict=True):
        table.add_row(*row, style="dim" if not cell.ran else None)
    console.print(table)
    console.print(GATES_LEGEND, soft_wrap=True)
    if any(c.summary is not None and not c.summary.conclusive for c in summary.cells):
        console.print("tax: +/- the interval's half-width; * inconclusive (wide, or spans zero): more steps narrow it",
                      soft_wrap=True)
    for switch, lines in audits(summary).items():
        console.print(f"[bold]audit[/bold]   {escape(switch)}: taxbench's policy would add or change", soft_wrap=True)
        for line in lines:
            console.print(f"        - {escape(line)}", soft_wrap=True)
    for note in not_run_lines(summary):
        console.print(f"[yellow]not run[/yellow] {escape(note)}", soft_wrap=True)
    for problem in problem_lines(summary)[:5]:
        console.print(f"[red]incomplete[/red] {escape(problem)}", soft_wrap=True)
    console.print(f"[bold]results[/bold]  {escape(summary.root)}", soft_wrap=True)
    if report is not None:
        console.print(f"[bold]report[/bold]   {escape(str(report))}", soft_wrap=True)


# --------------------------------------------------------------------------------------------------------- report
INTRO = (
    "The same model size on each training stack, under two policies for the deterministic arm: the stack's **own "
    "switch** alone (`mode@arms.deterministic=stack_native`: taxbench applies none of its own policy and audits what "
    "it would add) and **taxbench's policy** (`mode@arms.deterministic=deterministic`). Each cell is one experiment "
    "(a baseline/deterministic pair with its three gates; its own report is linked). Tax is the deterministic arm's "
    "step time over the baseline's, with its interval. Cells that cannot run here are listed with the reason, never "
    "counted as failures."
)


def stacks_report(summary: StacksSummary, cell_reports: dict[str, Path] | None = None) -> Report:
    """The matrix as report blocks; cell_reports maps a cell's name to its experiment's report.html."""
    cell_reports = cell_reports or {}
    plan = summary.plan
    tone, line = summary.verdict()
    out_dir = Path(summary.root) / REPORT_DIR
    links = {(index, 0): os.path.relpath(cell_reports[c.cell.name].parent, out_dir)
             for index, c in enumerate(summary.cells) if c.cell.name in cell_reports}
    blocks: list[Block] = [
        Paragraph(f"{plan.family} recipes · {plan.world_size} ranks on {plan.device} · {plan.steps} steps per run · "
                  f"results {summary.root} · generated {datetime.now(UTC):%Y-%m-%d %H:%M UTC}"),
        Paragraph(line, tone=tone),
        *([Paragraph(f"Every stack that builds its model from the recipe's fields (taxbench, DeepSpeed, "
                     f"Megatron-Core) runs one shape: `{plan.shape}`; torchtitan's model is its flavor's own (its "
                     "parameter count is in the table).")] if plan.shape else []),
        Heading("Stacks and policies"),
        Paragraph(INTRO),
        TableBlock(HEADER, matrix_rows(summary), [failing(c) for c in summary.cells], links, highlight_class="bad"),
    ]
    audited = audits(summary)
    if audited:
        blocks += [Heading("What taxbench's policy would add to each own switch", level=3),
                   TableBlock(["own switch", "taxbench's policy would add or change"],
                              [[switch, line] for switch, lines in audited.items() for line in lines])]
    not_run = not_run_lines(summary)
    if not_run:
        blocks += [Heading("Not run here", level=3), TableBlock(["cell and why"], [[n] for n in not_run])]
    problems = problem_lines(summary)
    if problems:
        blocks += [Heading("Incomplete evidence", level=3),
                   TableBlock(["what is missing"], [[p] for p in problems], [True] * len(problems),
                              highlight_class="bad")]
    return Report(f"taxbench stacks: {Path(summary.root).name}", blocks)


def write_stacks_report(summary: StacksSummary, cell_reports: dict[str, Path] | None = None) -> Path | None:
    return write_report(stacks_report(summary, cell_reports), Path(summary.root) / REPORT_DIR)
