"""`taxbench diff RUN_A RUN_B`: two runs' trace captures compared op by op, the first origin per rank."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from taxbench import exit_codes
from taxbench.commands.help_format import subcommand_parser
from taxbench.commands.input_errors import one_line_input_errors
from taxbench.rundir.read import RecordError
from taxbench.tracing.diff import IDENTICAL, NO_EVIDENCE, diff_runs, render
from taxbench.tracing.trace_io import TraceError


def parser() -> argparse.ArgumentParser:
    parser = subcommand_parser(
        "diff",
        "Compare two runs' trace captures (<run>/trace/, from experiment.trace) op by op, aligned by (module, op "
        "occurrence), and name per rank the first op whose inputs agree and whose outputs differ.",
        "exit codes: 0 identical, 2 bad input, 3 the traces differ, 4 no evidence (no trace, or no step in common)")
    parser.add_argument("run_a", type=Path)
    parser.add_argument("run_b", type=Path)
    parser.add_argument("--step", type=int, action="append", help="compare only this step (repeatable)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    with one_line_input_errors(TraceError, RecordError, FileNotFoundError):
        report = diff_runs(args.run_a, args.run_b, args.step)
    print(json.dumps(report.to_dict(), indent=2) if args.json else render(report))
    if report.verdict == IDENTICAL:
        return exit_codes.OK
    return exit_codes.INCOMPLETE if report.verdict in NO_EVIDENCE else exit_codes.NOT_DETERMINISTIC
