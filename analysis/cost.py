"""Where an experiment's wall clock went, as shares: startup (command to the first timed step, with its parts), timed
steps, gate-only runs, checkpoint commits, fingerprints, analysis, and the rest (the loop around the steps: data,
records, the round's all-reduce, trainer builds between runs). From the schedule's cost.json
(taxbench.schedule.cost), the records' fingerprint_s and the analysis's own time. The parts add up to the wall clock;
an unknown start (no /proc) leaves startup in "other"."""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import pandas as pd

from taxbench.rundir.cost_file import ScheduleCost
from taxbench.rundir.step_record import FINGERPRINT_S, RANK

PARTS = ("startup", "timed_steps", "gate_only_runs", "checkpoints", "fingerprints", "analysis", "other")
# The startup's own parts: the command until rank 0's process started (imports, config, preflight, starting the
# ranks), until its process group was up (the rank's setup and the rendezvous), until the schedule began, and until
# the first timed step began (building the first runs' models, data and digests).
STARTUP_PARTS = ("to_ranks", "to_process_group", "to_schedule", "first_build")


@dataclass(frozen=True)
class CostSplit:
    wall_s: float
    seconds: dict[str, float]  # PARTS -> seconds
    startup_s: dict[str, float] | None = None  # STARTUP_PARTS -> seconds (None: a launch that did not record them)

    def share(self, part: str) -> float:
        return self.seconds[part] / self.wall_s if self.wall_s > 0 else math.nan

    def to_dict(self) -> dict[str, Any]:
        return {"wall_s": self.wall_s, "seconds": self.seconds,
                "share": {part: self.share(part) for part in PARTS}, "startup_s": self.startup_s}

    def line(self) -> str:
        """'startup 12% · timed steps 40% · ...' for the console and the report."""
        return " · ".join(f"{part.replace('_', ' ')} {self.share(part):.0%}" for part in PARTS)

    def startup_line(self) -> str | None:
        """'to ranks 3.1 s · to process group 0.4 s · ...', where the launch recorded its startup's parts."""
        if self.startup_s is None:
            return None
        return " · ".join(f"{part.replace('_', ' ')} {self.startup_s[part]:.1f} s" for part in STARTUP_PARTS)


def startup_parts(cost: ScheduleCost) -> dict[str, float] | None:
    marks = (cost.started_unix, cost.rank_started_unix, cost.process_group_unix, cost.schedule_start_unix,
             cost.first_step_unix)
    if any(mark is None for mark in marks):
        return None
    times = [float(mark) for mark in marks if mark is not None]
    return {part: max(end - begin, 0.0) for part, begin, end in zip(STARTUP_PARTS, times[:-1], times[1:], strict=True)}


def _fingerprint_s(frame: pd.DataFrame) -> float:
    """Rank 0's fingerprint time over the run (the ranks fingerprint in step)."""
    if FINGERPRINT_S not in frame or frame.empty:
        return 0.0
    return float(frame.loc[frame[RANK].to_numpy() == 0, FINGERPRINT_S].fillna(0.0).sum())


def cost_split(cost: ScheduleCost | None, runs: Mapping[str, pd.DataFrame], timed: Collection[str],
               analysis_s: float) -> CostSplit | None:
    """The split of one launch (None: an experiment from before cost.json)."""
    if cost is None:
        return None
    started = cost.started_unix if cost.started_unix is not None else cost.schedule_start_unix
    wall = cost.end_unix - started + analysis_s
    first = cost.first_step_unix
    startup = first - started if first is not None and cost.started_unix is not None else 0.0
    fingerprints = {name: _fingerprint_s(frame) for name, frame in runs.items()}
    gate_fingerprints = sum(value for name, value in fingerprints.items() if name not in timed)
    gate_checkpoints = cost.checkpoints_s - cost.rounds_checkpoints_s
    seconds = {
        "startup": startup,
        "timed_steps": cost.timed_steps_s,
        "gate_only_runs": max(cost.gate_runs_s - gate_checkpoints - gate_fingerprints, 0.0),
        "checkpoints": cost.checkpoints_s,
        "fingerprints": sum(fingerprints.values()),
        "analysis": analysis_s,
    }
    seconds["other"] = max(wall - sum(seconds.values()), 0.0)
    return CostSplit(wall, seconds, startup_parts(cost))
