"""An experiment's analysis, recorded: its results (taxbench.analysis.experiment) written to
<experiment>/summary.json, where sweeps, `taxbench verify` and people read the verdict from.

The pipeline computes; this writes its result down; the console, the report and wandb present the same result.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from taxbench.analysis.command_experiment import command_run_of, compute_command_experiment
from taxbench.analysis.experiment import ExperimentAnalysis, ExperimentSummary, compute_experiment
from taxbench.analysis.results import write_result
from taxbench.analysis.text import headline

SUMMARY_FILE = "summary.json"


def summary_record(summary: ExperimentSummary) -> dict[str, Any]:
    """summary.json's content: the result, with the tax's headline (taxbench.analysis.text) after the verdicts."""
    record: dict[str, Any] = {}
    for key, value in summary.to_dict().items():
        record[key] = value
        if key == "verdicts":
            record["headline"] = headline(summary)
    return record


def analyse_experiment(root: Path) -> ExperimentAnalysis:
    """Analyse the experiment at `root` and write its summary.json (not in a folder a live launch holds)."""
    command_run = command_run_of(root)
    analysis = compute_experiment(root) if command_run is None else compute_command_experiment(root, command_run)
    write_result(root / SUMMARY_FILE, json.dumps(summary_record(analysis.summary), indent=2))
    return analysis


def analyse(root: Path) -> ExperimentSummary:
    return analyse_experiment(root).summary
