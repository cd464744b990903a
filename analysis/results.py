"""Writing analysis results (summary.json, sweep.csv, layouts.json, report/): whole files, and only where allowed.

One home for the write that every analysis and every report uses, so that none of them imports another just to write
a file: a result is written whole (a .tmp renamed into place), never in a folder a live launch holds
(taxbench.rundir.write_scope), and a failure is one line naming the path.
"""

from __future__ import annotations

import math
from pathlib import Path

from taxbench.oserrors import describe_os_error
from taxbench.rundir.read import ResultWriteError
from taxbench.rundir.records import RunWriteError, write_atomically
from taxbench.rundir.write_scope import OutsideScope, may_write


def may_write_result(path: Path) -> bool:
    """Whether a result may be written at `path` now (taxbench.rundir.write_scope: not in a folder a live launch
    holds); a path outside the folder a reading command was pointed at is a ResultWriteError."""
    try:
        return may_write(path)
    except OutsideScope as exc:
        raise ResultWriteError(str(exc)) from exc


def write_result(path: Path, data: str | bytes) -> None:
    """Write an analysis result whole (a .tmp renamed into place); a failure is one line naming the path. Skipped in
    a folder a live launch holds (taxbench.rundir.write_scope)."""
    if not may_write_result(path):
        return
    payload = data.encode("utf-8") if isinstance(data, str) else data
    try:
        write_atomically(path, lambda handle: handle.write(payload))
    except OSError as exc:
        reason = str(exc) if isinstance(exc, RunWriteError) else describe_os_error(exc, path)
        raise ResultWriteError(f"cannot write {reason}; make {path.parent} writable (or copy the results to a "
                               "writable folder) and analyse again") from exc


def finite_or_none(value: float) -> float | None:
    """A number for JSON: NaN and infinities as None (null), which JSON has no literal for."""
    return value if math.isfinite(value) else None

