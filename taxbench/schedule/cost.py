"""Where a launch's wall clock goes (<experiment>/cost.json, rank 0): startup, the timed rounds and the timed steps in
them, the gate-only runs, and checkpoint commits. Analysis adds the fingerprints (from the records) and its own time,
and reports each as a share of the wall clock (analysis.cost), since on a large allocation every second of it is paid.

It describes the last launch only: a continued experiment's earlier attempts are not in it.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from taxbench.rundir.evidence import read_regular
from taxbench.rundir.records import write_text_atomically

COST_FILE = "cost.json"
STARTED_ENV = "TAXBENCH_STARTED_UNIX"  # the command's start (a launcher sets it for the ranks it spawns)


def process_start_unix(pid: int | str = "self") -> float | None:
    """When process `pid` started (Unix time), from /proc; None where there is no /proc.

    /proc gives the start in clock ticks since boot; its age is taken against the boot-time clock now, not added to
    /proc/stat's btime, which is whole seconds (and drifts from the wall clock): that put up to a second into the
    startup's parts."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - int(fields[19]) / os.sysconf("SC_CLK_TCK")
        return time.time() - age
    except (OSError, ValueError, IndexError, AttributeError):  # AttributeError: no CLOCK_BOOTTIME (not Linux)
        return None


def command_started_unix() -> float | None:
    """The command's start: the launcher's, or this process's own (an in-process or externally started rank)."""
    stored = os.environ.get(STARTED_ENV)
    try:
        return float(stored) if stored else process_start_unix()
    except ValueError:
        return process_start_unix()


@dataclass
class ScheduleCost:
    started_unix: float | None = None  # the command's start (None: unknown)
    rank_started_unix: float | None = None  # rank 0's process started (forked or spawned; None: unknown)
    process_group_unix: float | None = None  # rank 0's default process group was up
    schedule_start_unix: float = 0.0  # Experiment.run began
    first_step_unix: float | None = None  # the timed rounds' first step began (None: rounds skipped by a continue)
    end_unix: float = 0.0  # the schedule ended
    rounds_s: float = 0.0  # wall clock of the timed rounds
    timed_steps_s: float = 0.0  # the timed steps in them (slowest rank's time per step, every timed run)
    gate_runs_s: float = 0.0  # wall clock of the runs after the rounds (gate-only, knob and profile runs)
    checkpoints_s: float = 0.0  # commits, all runs (inside rounds_s and gate_runs_s)
    rounds_checkpoints_s: float = 0.0  # commits in the rounds

    def write(self, root: Path) -> None:
        write_text_atomically(root / COST_FILE, json.dumps(asdict(self), indent=2))


OPTIONAL_TIMES = ("first_step_unix", "rank_started_unix", "process_group_unix")


def read_cost(root: Path) -> ScheduleCost | None:
    """The launch's cost record; None when it is missing (an older experiment), unreadable (a FIFO or device is
    refused unopened), not JSON or not a cost record (a field that is not a number)."""
    try:
        stored = json.loads(read_regular(root / COST_FILE, root, limit=1 << 20).decode("utf-8"))
        cost = ScheduleCost(**stored)
    except (OSError, ValueError, TypeError):
        return None
    numbers = all(isinstance(value, int | float) and not isinstance(value, bool)
                  for name, value in asdict(cost).items() if not (name in OPTIONAL_TIMES and value is None))
    return cost if numbers else None


class Stopwatch:
    """Seconds spent inside `with` blocks, added up."""

    def __init__(self) -> None:
        self.total = 0.0

    def __enter__(self) -> Stopwatch:
        self._start = time.perf_counter()
        return self

    def __exit__(self, *_: object) -> None:
        self.total += time.perf_counter() - self._start
