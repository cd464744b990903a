"""`taxbench stacks`: the matrix no one publishes. One experiment per cell (a training stack under one policy for its
deterministic arm: the stack's own switch, or taxbench's full policy), read back as one table of tax (interval) and
the three gate verdicts per stack and policy.

The folder holds stacks.json (what was asked for: every cell, the recipe and parameter count it ran, and why a cell
did not run) and one experiment folder per cell that ran (<stack>-<policy>/). A cell that cannot run here is a row of
its own, never a failure: "not installed" (the stack's extra is missing; the pip line), "needs CUDA" (Megatron-Core on
a CPU machine).

Outcome: the worst of the run cells' verdicts (taxbench.exit_codes.combined: a strict gate that differs, 3, before
missing evidence, 4, before a pass). A cell whose ranks failed or whose experiment cannot be analysed is incomplete
(4); a matrix where no cell ran has no evidence at all (4), never a pass.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from taxbench import exit_codes
from taxbench.analysis.experiment import (
    CALIBRATION,
    FAILED,
    INCOMPLETE_OUTCOME,
    ExperimentAnalysis,
    ExperimentSummary,
)
from taxbench.analysis.results import write_result
from taxbench.analysis.summary import SUMMARY_FILE, analyse_experiment
from taxbench.analysis.verdicts import Verdict
from taxbench.design import GATES, TIMED
from taxbench.rundir.plans import Cell, StacksPlan
from taxbench.rundir.plans import read_stacks_plan as read_plan
from taxbench.rundir.read import RecordError

HEADER = ["stack", "recipe", "parameters", "deterministic arm", "tax (interval)",
          *(gate.name.replace("_", " ") for gate in GATES)]


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
        # A cell whose deterministic arm was the baseline's (the A/A calibration) holds no evidence for its switch.
        no_evidence = self.problems or self.summary is None or self.summary.outcome == CALIBRATION
        codes = [exit_codes.INCOMPLETE] if no_evidence else []
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
    manifest = analysis.manifests.get(TIMED["deterministic"].name)
    audit = manifest.stack_native_audit if manifest is not None and manifest.stack_native else None
    return CellResult(cell, analysis.summary, problems, [str(line) for line in audit] if audit is not None else None)


def analyse_stacks(root: Path, on_experiment: Callable[[ExperimentAnalysis], None] | None = None) -> StacksSummary:
    """Analyse every cell's experiment under `root` (a `taxbench stacks` folder) and write its summary.json;
    on_experiment sees each cell's full analysis (to write its report) before its records are dropped."""
    plan = read_plan(root)
    summary = StacksSummary(str(root), plan, [analyse_cell(root, cell, on_experiment) for cell in plan.cells])
    write_result(root / SUMMARY_FILE, json.dumps(summary.to_dict(), indent=2))
    return summary


def failing(cell: CellResult) -> bool:
    return cell.ran and cell.exit_code != exit_codes.OK
