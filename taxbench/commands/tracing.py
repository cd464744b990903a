"""The `taxbench diff` and `taxbench localize` subcommands (wired into taxbench.cli)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from taxbench import exit_codes
from taxbench.commands.localize import NO_DIVERGENCE, LocalizeError, localize
from taxbench.commands.localize import render as render_localization
from taxbench.rundir.read import RecordError
from taxbench.tracing.diff import IDENTICAL, NO_EVIDENCE, diff_runs, render
from taxbench.tracing.trace_io import TraceError

EXIT_DIVERGED = exit_codes.NOT_DETERMINISTIC  # same code as a failed determinism gate


def input_errors() -> tuple[type[Exception], ...]:
    """Errors that mean bad input (reported as `taxbench: error: ...`), not a bug."""
    return (TraceError, LocalizeError, RecordError, FileNotFoundError)


def add_tracing_parsers(sub: argparse._SubParsersAction) -> None:
    diff_cmd = sub.add_parser("diff", help="diff two runs' traces (<run>/trace/) and name the first origin per rank")
    diff_cmd.add_argument("run_a", type=Path)
    diff_cmd.add_argument("run_b", type=Path)
    diff_cmd.add_argument("--step", type=int, action="append", help="compare only this step (repeatable)")
    diff_cmd.add_argument("--json", action="store_true", help="print the report as JSON")
    loc_cmd = sub.add_parser("localize", help="replay the first diverging step with deeper rungs until an op is named")
    loc_cmd.add_argument("run_a", type=Path)
    loc_cmd.add_argument("run_b", type=Path)
    loc_cmd.add_argument("--work-dir", type=Path, default=None,
                         help="where replays go (default: <run_b>/../localize/<run_a>-vs-<run_b>)")
    loc_cmd.add_argument("--max-numel", type=int, default=0,
                         help="record larger tensors by shape only (bounds rung-3 cost); 0 = no limit")
    loc_cmd.add_argument("--json", action="store_true", help="print the result as JSON")


def run_tracing_command(args: argparse.Namespace) -> int:
    if args.command == "diff":
        report = diff_runs(args.run_a, args.run_b, args.step)
        print(json.dumps(report.to_dict(), indent=2) if args.json else render(report))
        if report.verdict == IDENTICAL:
            return exit_codes.OK
        return exit_codes.INCOMPLETE if report.verdict in NO_EVIDENCE else EXIT_DIVERGED
    work = args.work_dir or args.run_b.parent / "localize" / f"{args.run_a.name}-vs-{args.run_b.name}"
    if work.exists() and any(work.iterdir()):
        raise LocalizeError(f"--work-dir {work} is not empty; pass another --work-dir or remove it")
    result = localize(args.run_a, args.run_b, work, args.max_numel)
    print(json.dumps(result.to_dict(), indent=2) if args.json else render_localization(result))
    if result.verdict == NO_DIVERGENCE:
        return exit_codes.OK
    return exit_codes.INCOMPLETE if result.verdict in NO_EVIDENCE else EXIT_DIVERGED
