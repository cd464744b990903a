"""`taxbench report FOLDER`: report.html and report.md of an experiment or a sweep, and wandb on request
(torch-free)."""

from __future__ import annotations

import argparse
from pathlib import Path

from taxbench import exit_codes
from taxbench.analysis.publish import read_and_report
from taxbench.analysis.wandb_log import WandbUnavailable
from taxbench.commands.help_format import subcommand_parser
from taxbench.commands.input_errors import one_line_input_errors
from taxbench.config.schema import ReportConfig
from taxbench.rundir.read import RecordError
from taxbench.rundir.records import RunWriteError


def parser() -> argparse.ArgumentParser:
    parser = subcommand_parser(
        "report",
        "Analyse an experiment, or a sweep folder that a taxbench multirun made, and write report/report.html "
        "(self-contained, with plots) and report/report.md; --wandb also logs it to Weights & Biases.",
        "exit codes: 0 passed, 2 bad input (not an experiment or a sweep folder), 3 a gate failed, 4 incomplete "
        "evidence")
    parser.add_argument("root", type=Path, metavar="FOLDER", help="an experiment folder or a sweep folder")
    parser.add_argument("--wandb", action="store_true", help="also log to wandb (offline unless WANDB_MODE is set)")
    parser.add_argument("--wandb-project", default=ReportConfig.wandb_project, help="wandb project")
    parser.add_argument("--wandb-group", default=None, help="wandb group (default: the sweep folder's name)")
    return parser


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    settings = ReportConfig(html=True, wandb=args.wandb, wandb_project=args.wandb_project,
                            wandb_group=args.wandb_group)
    with one_line_input_errors(WandbUnavailable, RecordError, RunWriteError, FileNotFoundError):
        return read_and_report(args.root, settings, strict_wandb=True)
    return exit_codes.CONFIG_ERROR
