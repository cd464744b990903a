"""The argument parser of a subcommand whose --help says what it does and what its exit codes mean, wrapped for an
80-column terminal whatever the terminal reports."""

from __future__ import annotations

import argparse
import shutil


class Formatter(argparse.HelpFormatter):
    """argparse's formatter at no more than 80 columns, whatever the terminal reports."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, width=min(80, shutil.get_terminal_size().columns), max_help_position=28)


def subcommand_parser(name: str, description: str, exits: str) -> argparse.ArgumentParser:
    """The parser of `taxbench <name>`; `exits` says what its exit codes mean (shown under its --help)."""
    return argparse.ArgumentParser(prog=f"taxbench {name}", description=description, epilog=exits,
                                   formatter_class=Formatter)
