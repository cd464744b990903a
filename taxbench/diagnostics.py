"""Diagnostics (warnings, debug detail) go through `logging`, under the `taxbench` logger.

Every module logs to `logger(__name__)`, a child of `taxbench` (the analysis/ and launchers/ packages too), so that
Hydra's `hydra.verbose=taxbench` turns on their debug messages. The `taxbench` logger writes to stderr itself, as
`taxbench: warning: ...`, in every process that runs taxbench code (the CLI, its subcommands, spawned ranks, Slurm
tasks), whether or not Hydra configured logging there. Results, tables and progress are user output, not logged.
"""

from __future__ import annotations

import logging
import sys

NAMESPACE = "taxbench"


def logger(module: str) -> logging.Logger:
    """The logger of `module` under the taxbench namespace: analysis.publish -> taxbench.analysis.publish."""
    return logging.getLogger(module if module.partition(".")[0] == NAMESPACE else f"{NAMESPACE}.{module}")


class _StderrHandler(logging.Handler):
    """Writes to sys.stderr as it is at each record (a redirected or captured stream), like logging.lastResort."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:
            self.handleError(record)


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return f"{NAMESPACE}: {record.levelname.lower()}: {super().format(record)}"


def _show_on_stderr() -> None:
    top = logging.getLogger(NAMESPACE)
    if any(isinstance(handler, _StderrHandler) for handler in top.handlers):
        return
    handler = _StderrHandler()
    handler.setFormatter(_Formatter())
    top.addHandler(handler)
    # Hydra's job logging sends the root logger to stdout: propagating would print each diagnostic twice. The level
    # stays unset (inherited from the root logger: WARNING unless configured), so hydra.verbose=true shows ours too.
    top.propagate = False


_show_on_stderr()
