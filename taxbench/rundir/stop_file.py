"""How the timed rounds ended, and the checkpoints they committed on the way: one model, reader and writer each.

- `<experiment>/stop.json` (`Stop`): how many steps every run took and what stopped the timed rounds; written once
  the rounds finish, so that a continue and the analysis agree on the runs' length.
- `<experiment>/commits.json`: the steps after which the timed rounds committed a checkpoint so far, written while
  they run, so that a continue carries them into stop.json.

Both carry `format_version` (STOP_FORMAT, COMMITS_FORMAT). A stop.json without one is of version 1, as every stop.json
before the field was; a commits.json that is a bare list is one from before its version (read as version 1). Neither
reader refuses: a missing, damaged or foreign record means the rounds run again from their newest checkpoint
(stop.json), or that only the resumed-from commit is certain (commits.json).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from taxbench.rundir.evidence import read_regular
from taxbench.rundir.records import write_text_atomically

STOP_FILE = "stop.json"
COMMITS_FILE = "commits.json"
STOP_FORMAT = 1
COMMITS_FORMAT = 1
# What stopped the timed rounds (Stop.stopped_by).
STEPS, TARGET, CAP = "steps", "target_half_width", "max_steps"


@dataclass(frozen=True)
class Stop:
    """How many steps every run took and what stopped the timed rounds (taxbench.schedule.stopping decides it)."""

    steps: int  # every timed run takes this many steps (gate-only runs: taxbench.design.run_steps)
    stopped_by: str  # STEPS (fixed length), TARGET (precision reached) or CAP (max_steps reached first)
    half_width: float | None  # at the last look (None without a target)
    # The steps after which the timed rounds committed a checkpoint (the step after each is left out of the tax);
    # None in experiments from before checkpoints by time, whose commits follow experiment.checkpoint_every_steps.
    commits: tuple[int, ...] | None = None
    # `taxbench run -- COMMAND`: the whole-run pairs that ran (stopped_by then counts pairs, not steps)
    pairs: int | None = None

    def write(self, root: Path) -> None:
        stored = {"format_version": STOP_FORMAT,
                  **{key: value for key, value in asdict(self).items() if key != "pairs" or value is not None}}
        write_text_atomically(root / STOP_FILE, json.dumps(stored, indent=2))


def read_stop(root: Path) -> Stop | None:
    """The stored stop of an experiment whose interleaved rounds finished (None before that, or when the record is
    damaged or of another format version: the rounds then run again from their newest checkpoint)."""
    try:
        stored = json.loads(read_regular(root / STOP_FILE, root).decode("utf-8"))
        if stored.get("format_version", 1) != STOP_FORMAT:
            return None
        commits = stored.get("commits")
        pairs = stored.get("pairs")
        return Stop(int(stored["steps"]), str(stored["stopped_by"]), stored.get("half_width"),
                    None if commits is None else tuple(int(step) for step in commits),
                    None if pairs is None else int(pairs))
    # missing, unreadable (a FIFO or device is refused unopened), not JSON, or not a stop record
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # AttributeError: JSON that is no object
        return None


def write_commits(root: Path, commits: tuple[int, ...]) -> None:
    """Record the timed rounds' commits so far, for a continue to carry into stop.json."""
    write_text_atomically(root / COMMITS_FILE, json.dumps({"format_version": COMMITS_FORMAT, "commits": list(commits)}))


def read_commits(root: Path, through: int) -> tuple[int, ...]:
    """The timed rounds' commits up to step `through` (the checkpoint a continue resumes from, which is one)."""
    try:
        stored = json.loads(read_regular(root / COMMITS_FILE, root).decode("utf-8"))
        if isinstance(stored, dict):
            if stored.get("format_version") != COMMITS_FORMAT:
                raise ValueError("another format version")
            stored = stored["commits"]
        steps = {int(step) for step in stored}
    # missing, unreadable, damaged or foreign: only the resumed-from commit is certain
    except (OSError, ValueError, KeyError, TypeError):
        steps = set()
    return tuple(sorted(step for step in steps | {through} if step <= through))
