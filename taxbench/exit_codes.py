"""The process exit codes of every taxbench command (documented in the README)."""

from __future__ import annotations

from collections.abc import Iterable

OK = 0  # done; for an experiment: the deterministic recipe passed both strict gates
FAILED = 1  # the run itself failed (a rank died, Slurm job lost): the message says how to continue
CONFIG_ERROR = 2  # bad input, refused before anything ran (or a results folder that cannot be read)
NOT_DETERMINISTIC = 3  # a strict gate failed, or two traces diverged
INCOMPLETE = 4  # not enough evidence for a verdict: missing, truncated, duplicated or unreadable records


def combined(codes: Iterable[int]) -> int:
    """One exit code for several verdicts: a proven gate failure (3) outranks missing evidence (4), which outranks a
    pass (0)."""
    codes = set(codes)
    for code in (NOT_DETERMINISTIC, INCOMPLETE):
        if code in codes:
            return code
    return OK if codes <= {OK} else max(codes)
