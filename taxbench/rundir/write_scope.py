"""Where a reading command (`taxbench analyse`, `taxbench report`) may write: only inside the folder it was pointed
at, and nothing at all in a folder a live launch holds.

Analysis writes its results (summary.json, sweep.csv, report/, columnar mirrors) through taxbench.analysis.results'
write_result and the record reader; both ask `may_write` first. Outside a `reading` block (a launch analysing its own
experiment) every write is allowed, as before.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


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
