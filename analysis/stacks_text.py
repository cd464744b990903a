"""The words of a stacks matrix (taxbench.analysis.stacks_matrix), shared by its console table, report and wandb
table."""

from __future__ import annotations

import math

from taxbench.analysis.stacks_matrix import CellResult, StacksSummary
from taxbench.analysis.text import interval, pct
from taxbench.analysis.verdicts import DIFFERS, IDENTICAL, Verdict
from taxbench.design import GATES
from taxbench.rundir.plans import POLICY_LABELS


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
    return f"{pct(tax.tax)} ({interval(tax.low, tax.high)})" + ("" if summary.conclusive else " (inconclusive)")


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


def audits(summary: StacksSummary) -> dict[str, list[str]]:
    """Per own-switch cell ("<stack>'s own switch"): what taxbench's full policy would add or change."""
    return {f"{c.cell.stack}'s own switch": c.audit or ["nothing (the switch sets everything taxbench's policy does)"]
            for c in summary.cells if c.audit is not None}


def not_run_lines(summary: StacksSummary) -> list[str]:
    return [f"{c.cell.stack}, {POLICY_LABELS[c.cell.policy]}: {c.cell.skipped}: {c.cell.reason}"
            for c in summary.cells if not c.ran]


def problem_lines(summary: StacksSummary) -> list[str]:
    return [p for c in summary.cells for p in c.problems + (c.summary.problems if c.summary else [])]
