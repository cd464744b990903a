"""<experiment>/cost.json: where a launch's wall clock went (rank 0 writes it): startup, the timed rounds and the timed
steps in them, the gate-only runs, and checkpoint commits. Analysis adds the fingerprints (from the records) and its
own time, and reports each as a share of the wall clock (taxbench.analysis.cost), since on a large allocation every
second of it is paid. taxbench.schedule.cost measures what it holds.

It describes the last launch only: a continued experiment's earlier attempts are not in it. Versioned by
`format_version` (COST_FORMAT); a file without one is of version 1, as every cost.json before the field was.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from taxbench.rundir.evidence import read_regular
from taxbench.rundir.records import write_text_atomically

COST_FILE = "cost.json"
COST_FORMAT = 1


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
        write_text_atomically(root / COST_FILE, json.dumps({"format_version": COST_FORMAT, **asdict(self)}, indent=2))


OPTIONAL_TIMES = ("first_step_unix", "rank_started_unix", "process_group_unix")


def read_cost(root: Path) -> ScheduleCost | None:
    """The launch's cost record; None when it is missing (an older experiment), unreadable (a FIFO or device is
    refused unopened), not JSON, of another format version, or not a cost record (a field unknown or not a number)."""
    try:
        stored = json.loads(read_regular(root / COST_FILE, root, limit=1 << 20).decode("utf-8"))
        if stored.pop("format_version", 1) != COST_FORMAT:
            return None
        cost = ScheduleCost(**stored)
    except (OSError, ValueError, TypeError, AttributeError):  # AttributeError: JSON that is no object
        return None
    numbers = all(isinstance(value, int | float) and not isinstance(value, bool)
                  for name, value in asdict(cost).items() if not (name in OPTIONAL_TIMES and value is None))
    return cost if numbers else None
