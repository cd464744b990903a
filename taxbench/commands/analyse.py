"""`taxbench analyse EXPERIMENT`: re-analyse an experiment folder and print its summary (torch-free)."""

from __future__ import annotations

import argparse
from pathlib import Path

from taxbench import exit_codes
from taxbench.analysis.publish import read_and_report
from taxbench.commands.help_format import subcommand_parser
from taxbench.commands.input_errors import one_line_input_errors
from taxbench.rundir.read import RecordError
from taxbench.rundir.records import RunWriteError


def parser() -> argparse.ArgumentParser:
    parser = subcommand_parser(
        "analyse",
        "Re-analyse an experiment folder: check every run against its manifest, estimate the tax, decide the "
        "gates, print the summary and rewrite summary.json (and report/ where the experiment wrote one).",
        "exit codes: 0 the gates passed, 2 bad input (not an experiment folder), 3 a gate failed, 4 incomplete "
        "evidence (missing, truncated or unreadable records)")
    parser.add_argument("root", type=Path, metavar="EXPERIMENT", help="an experiment folder (runs/<name>)")
    return parser


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    with one_line_input_errors(RecordError, RunWriteError, FileNotFoundError):
        return read_and_report(args.root)
    return exit_codes.CONFIG_ERROR
