"""Diagnostics (warnings, debug detail) go through `logging`, under the `taxbench` logger.

Every module logs to `logger(__name__)`, a child of `taxbench` (the analysis/ and launchers/ packages too), so that
Hydra's `hydra.verbose=taxbench` turns on their debug messages. The `taxbench` logger writes to stderr itself, as
`taxbench: warning: ...`, in every process that runs taxbench code (the CLI, its subcommands, spawned ranks, Slurm
tasks), whether or not Hydra configured logging there. Results, tables and progress are user output, not logged.
"""

from __future__ import annotations

import logging
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

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


# Modules whose own warnings are not shown while a stack runs: the training stacks' and torch.distributed's
# deprecation and support notices (DeepSpeed's ZeRO calls torch's deprecated reduce_scatter_tensor every step: 1,816
# lines of FutureWarning in one experiment; torchtitan's DTensor seeding warns of CPU meshes on every rank) are not
# the user's to act on, and buried the verdict. Warnings from taxbench and from the user's own code still show.
STACK_MODULES = r"(torch\.distributed|torchtitan|deepspeed|megatron|transformer_engine)(\.|$)"


@contextmanager
def stacks_quieted() -> Iterator[None]:
    """While a rank runs (launchers/worker.py) or a stack's config is built in the command (torchtitan's config logs
    warnings on the root logger, which Hydra sends to stdout): the stacks' own warnings ignored, and log records
    below ERROR of loggers that inherit the root logger's level (torchtitan's is the root logger itself) dropped;
    taxbench's logger keeps its level. Undone on exit."""
    root, ours = logging.getLogger(), logging.getLogger(NAMESPACE)
    saved = root.level, ours.level
    with warnings.catch_warnings():
        for category in (FutureWarning, DeprecationWarning, UserWarning):
            warnings.filterwarnings("ignore", category=category, module=STACK_MODULES)
        ours.setLevel(ours.getEffectiveLevel())  # not inherited from the root logger while that one is raised
        root.setLevel(max(root.getEffectiveLevel(), logging.ERROR))
        try:
            yield
        finally:
            root.setLevel(saved[0])
            ours.setLevel(saved[1])
