"""Preemption-safe progress of the runs in an experiment: block-boundary checkpoints and which of them are complete.

Every rank saves `<run>/checkpoints/step<S>.rank<R>.pt`; once all ranks have saved (a barrier), rank 0 records S in
`<run>/checkpoints/progress.json`. Only recorded steps are resumed from, so a crash halfway through saving never
leaves a run resuming from a checkpoint that some rank lacks. The last two complete checkpoints are kept: the two
arms of the timed pair are committed together but recorded one after the other, so after a crash between the two
records the pair resumes both arms from the older, common step. A finished run's checkpoints are deleted.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch.distributed as dist

PROGRESS_FILE = "progress.json"
KEEP = 2


class Checkpointed(Protocol):
    def save_checkpoint(self, path: Path) -> None: ...


class RunCheckpoints:
    def __init__(self, run_dir: Path, rank: int) -> None:
        self.dir = run_dir / "checkpoints"
        self.rank = rank

    def path(self, step: int) -> Path:
        return self.dir / f"step{step}.rank{self.rank}.pt"

    def _progress(self) -> dict[str, Any]:
        file = self.dir / PROGRESS_FILE
        if not file.exists():
            return {"complete": [], "finished": False}
        return json.loads(file.read_text(encoding="utf-8"))

    def _write_progress(self, progress: dict[str, Any]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / (PROGRESS_FILE + ".tmp")
        tmp.write_text(json.dumps(progress), encoding="utf-8")
        os.replace(tmp, self.dir / PROGRESS_FILE)

    def complete(self) -> list[int]:
        return sorted(int(s) for s in self._progress()["complete"])

    def latest(self) -> int | None:
        steps = self.complete()
        return steps[-1] if steps else None

    @property
    def finished(self) -> bool:
        return bool(self._progress()["finished"])

    def _record(self, step: int) -> None:
        progress = self._progress()
        progress["complete"] = sorted(set(progress["complete"]) | {step})[-KEEP:]
        self._write_progress(progress)

    def _prune(self) -> None:
        kept = set(self.complete())
        for file in self.dir.glob(f"step*.rank{self.rank}.pt"):
            step = int(file.name.split(".")[0].removeprefix("step"))
            if step not in kept:
                file.unlink(missing_ok=True)


def commit(step: int, runs: Sequence[tuple[RunCheckpoints, Checkpointed]]) -> None:
    """Save every run's state at `step` on this rank, then record the step once every rank has saved."""
    for checkpoints, trainer in runs:
        trainer.save_checkpoint(checkpoints.path(step))
    _barrier()
    if runs and runs[0][0].rank == 0:
        for checkpoints, _ in runs:
            checkpoints._record(step)
    _barrier()
    for checkpoints, _ in runs:
        checkpoints._prune()


def finish(runs: Sequence[RunCheckpoints]) -> None:
    """Record `runs` as finished (a restart skips them), then drop their checkpoints: nothing resumes from them."""
    _barrier()
    if runs and runs[0].rank == 0:
        for checkpoints in runs:
            # The checkpoint files go next, so none is listed as complete any more.
            checkpoints._write_progress({"complete": [], "finished": True})
    _barrier()
    for checkpoints in runs:
        for file in checkpoints.dir.glob(f"step*.rank{checkpoints.rank}.pt"):
            file.unlink(missing_ok=True)


def common_resume_step(runs: Sequence[RunCheckpoints]) -> int | None:
    """The newest step that every one of `runs` holds a complete checkpoint of (None: start from scratch)."""
    common = set.intersection(*(set(r.complete()) for r in runs)) if runs else set()
    return max(common) if common else None


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
