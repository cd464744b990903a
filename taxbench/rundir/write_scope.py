"""Where a reading command (`taxbench analyse`, `taxbench report`) may write: only inside the folder it was pointed
at, and nothing at all in a folder a live launch holds.

Analysis writes its results (summary.json, sweep.csv, report/, the layouts and stacks plans) through `write_result`
below, and columnar mirrors when asked to (taxbench.rundir.read.write_mirrors); both ask `may_write` first. Outside
a `reading` block (a launch analysing its own experiment) every write is allowed, as before.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from taxbench.oserrors import describe_os_error
from taxbench.rundir.json_object import ResultWriteError
from taxbench.rundir.records import RunWriteError, write_atomically


class OutsideScope(OSError):
    """A result write outside the folder the reading command was pointed at (never done: a bug, not bad input)."""


@dataclass(frozen=True)
class _Scope:
    root: Path  # resolved
    held: dict[Path, str]  # resolved folders below (or at) root that a live launch holds (read-only) -> who holds it


_scopes: list[_Scope] = []  # a plain list, not a ContextVar: the record readers write mirrors from worker threads


@contextmanager
def reading(root: Path, held: Mapping[Path, str] | None = None) -> Iterator[None]:
    """Confine result writes to `root`, and to none of the `held` folders (those a live launch holds, each with who
    holds it)."""
    scope = _Scope(root.resolve(), {path.resolve(): holder for path, holder in (held or {}).items()})
    _scopes.append(scope)
    try:
        yield
    finally:
        _scopes.remove(scope)


def may_write(path: Path) -> bool:
    """Whether an analysis result may be written at `path`: False inside a held folder (read-only, skip the write),
    True elsewhere inside the scope's root; OutsideScope for a path outside it."""
    if not _scopes:
        return True
    scope = _scopes[-1]
    where = path.parent.resolve() / path.name
    if not where.is_relative_to(scope.root):
        raise OutsideScope(f"{where}: outside {scope.root}, the folder this command was pointed at; nothing is "
                           "written there")
    return not any(where.is_relative_to(held) for held in scope.held)


def running(folder: Path) -> str | None:
    """Who holds `folder` (or a folder above it) while a reading command reads it: a live launch still writes
    there (None: none, or no reading command; a launch that analyses its own experiment reads no scope)."""
    if not _scopes:
        return None
    where = folder.resolve()
    return next((holder for held, holder in _scopes[-1].held.items() if where.is_relative_to(held)), None)


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
