"""Where an experiment's wall clock went, as shares: startup (command to the first timed step), timed steps,
gate-only runs, checkpoint commits, fingerprints, analysis, and the rest (the loop around the steps: data, records,
the round's all-reduce, trainer builds between runs). From the schedule's cost.json (taxbench.schedule.cost), the
records' fingerprint_s and the analysis's own time. The parts add up to the wall clock; an unknown start (no /proc)
leaves startup in "other"."""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import pandas as pd

from taxbench.schedule.cost import ScheduleCost

PARTS = ("startup", "timed_steps", "gate_only_runs", "checkpoints", "fingerprints", "analysis", "other")


@dataclass(frozen=True)
class CostSplit:
    wall_s: float
    seconds: dict[str, float]  # PARTS -> seconds

    def share(self, part: str) -> float:
        return self.seconds[part] / self.wall_s if self.wall_s > 0 else math.nan

    def to_dict(self) -> dict[str, Any]:
        return {"wall_s": self.wall_s, "seconds": self.seconds,
                "share": {part: self.share(part) for part in PARTS}}

    def line(self) -> str:
        """'startup 12% · timed steps 40% · ...' for the console and the report."""
        return " · ".join(f"{part.replace('_', ' ')} {self.share(part):.0%}" for part in PARTS)


def _fingerprint_s(frame: pd.DataFrame) -> float:
    """Rank 0's fingerprint time over the run (the ranks fingerprint in step)."""
    if "fingerprint_s" not in frame or frame.empty:
        return 0.0
    return float(frame.loc[frame["rank"].to_numpy() == 0, "fingerprint_s"].fillna(0.0).sum())


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
    return CostSplit(wall, seconds)
