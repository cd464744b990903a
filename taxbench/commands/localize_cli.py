"""`taxbench localize RUN_A RUN_B`: the command line of the localization ladder (taxbench.commands.localize), which
replays ranks; imported only once the arguments are read, so that `taxbench localize --help` loads no torch."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from taxbench import exit_codes
from taxbench.commands.help_format import subcommand_parser
from taxbench.commands.input_errors import one_line_input_errors
from taxbench.rundir.read import RecordError
from taxbench.tracing.trace_io import TraceError


def parser() -> argparse.ArgumentParser:
    parser = subcommand_parser(
        "localize",
        "Find the first step where two runs' fingerprints differ, replay both from their checkpoints with deeper "
        "tracing rungs (modules, then ops, then every op's tensors) until the op where they part is named.",
        "exit codes: 0 no divergence, 2 bad input, 3 diverged (origin named or bounded), 4 no evidence")
    parser.add_argument("run_a", type=Path)
    parser.add_argument("run_b", type=Path)
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="where replays go (default: <run_b>/../localize/<run_a>-vs-<run_b>)")
    parser.add_argument("--max-numel", type=int, default=0,
                        help="record larger tensors by shape only (bounds rung-3 cost); 0 = no limit")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    return parser


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    from taxbench.commands.localize import NO_DIVERGENCE, LocalizeError, localize, render
    from taxbench.launchers.command import CommandFailed, NoEvidence
    from taxbench.tracing.diff import NO_EVIDENCE

    with one_line_input_errors(TraceError, LocalizeError, RecordError, FileNotFoundError):
        work = args.work_dir or args.run_b.parent / "localize" / f"{args.run_a.name}-vs-{args.run_b.name}"
        if work.exists() and any(work.iterdir()):
            raise LocalizeError(f"--work-dir {work} is not empty; pass another --work-dir or remove it")
        try:
            with contextlib.redirect_stdout(sys.stderr):  # replays' progress: stdout holds the result alone
                result = localize(args.run_a, args.run_b, work, args.max_numel)
        except CommandFailed as exc:  # a replay of a `taxbench run` command
            print(f"taxbench: error: a replay failed: {exc}", file=sys.stderr)
            return exit_codes.FAILED
        except NoEvidence as exc:
            print(f"taxbench: error: a replay recorded nothing: {exc}", file=sys.stderr)
            return exit_codes.INCOMPLETE
    print(json.dumps(result.to_dict(), indent=2) if args.json else render(result))
    if result.verdict == NO_DIVERGENCE:
        return exit_codes.OK
    return exit_codes.INCOMPLETE if result.verdict in NO_EVIDENCE else exit_codes.NOT_DETERMINISTIC
