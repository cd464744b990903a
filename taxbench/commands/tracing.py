"""The `taxbench diff` and `taxbench localize` subcommands (wired into taxbench.cli)."""

from __future__ import annotations

import argparse
import json

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
