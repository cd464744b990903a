"""`taxbench certificate EXPERIMENT -o FILE`: the command line of an experiment's portable reference (written by
taxbench.commands.verify.certificate_command, imported once the arguments are read: its --help loads no torch)."""

from __future__ import annotations

import argparse
from pathlib import Path

from taxbench import exit_codes
from taxbench.commands.help_format import subcommand_parser
from taxbench.commands.input_errors import one_line_input_errors
from taxbench.rundir.read import RecordError
from taxbench.rundir.records import RunWriteError


def parser() -> argparse.ArgumentParser:
    parser = subcommand_parser(
        "certificate",
        "Write the portable reference of an experiment's deterministic run (its per-step, per-rank fingerprints "
        "and the manifest's essentials, hash-sealed), small enough to commit, for taxbench verify.",
        "exit codes: 0 written, 2 bad input, 4 incomplete evidence (records missing or unreadable)")
    parser.add_argument("experiment", type=Path, help="an experiment folder (runs/<experiment>)")
    parser.add_argument("-o", "--out", type=Path, required=True, help="the certificate file to write")
    return parser


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    from taxbench.commands.verify import certificate_command

    with one_line_input_errors(RecordError, RunWriteError, FileNotFoundError):
        return certificate_command(args.experiment, args.out)
    return exit_codes.CONFIG_ERROR
