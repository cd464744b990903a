"""Measuring where a launch's wall clock goes: when the command and its processes started, and seconds spent inside
blocks. The schedule fills taxbench.rundir.cost_file.ScheduleCost with them and rank 0 writes it to
<experiment>/cost.json, the format's home beside the run folder's other files.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

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


class Stopwatch:
    """Seconds spent inside `with` blocks, added up."""

    def __init__(self) -> None:
        self.total = 0.0

    def __enter__(self) -> Stopwatch:
        self._start = time.perf_counter()
        return self

    def __exit__(self, *_: object) -> None:
        self.total += time.perf_counter() - self._start
