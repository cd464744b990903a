"""Preemption-safe progress of the runs in an experiment: block-boundary checkpoints and which of them are complete.

A checkpoint of step S is the directory `<run>/checkpoints/step<S>/` that every rank writes its part of
(taxbench.checkpoint.state: DCP's sharded files, its metadata and a small file of per-rank state). Each rank then
records the size and sha256 of every file it wrote in `step<S>/rank<R>.sha256`; once all ranks have (a barrier),
rank 0 records S in `<run>/checkpoints/progress.json`. Only recorded steps are resumed from, so a crash halfway through
saving never leaves a run resuming from a checkpoint that some rank lacks. The last two complete checkpoints are kept:
the two arms of the timed pair are committed together but recorded one after the other, so after a crash between the
two records the pair resumes both arms from the older, common step. A finished run's checkpoints are deleted.

Resuming is a collective decision (`resume_step`): every rank checks the files it wrote against their checksums, and
all ranks take the newest step whose files are intact on every rank, or start from scratch; a checkpoint passed over
is named on stderr. Checkpoints newer than the chosen step are forgotten, since the run rewrites those steps.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch.distributed as dist

from taxbench.diagnostics import logger
from taxbench.rundir.records import write_text_atomically

log = logger(__name__)
PROGRESS_FILE = "progress.json"
CHECKSUM_SUFFIX = ".sha256"
KEEP = 2


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be trusted: the message names the file and what is wrong with it."""


class Checkpointed(Protocol):
    def save_checkpoint(self, directory: Path) -> list[Path]:
        """Write this rank's part of the checkpoint into `directory` (a collective); the files this rank wrote."""
        ...


@dataclass
class Progress:
    complete: list[int] = field(default_factory=list)
    finished: bool = False
    problem: str | None = None  # progress.json exists but cannot be read: why


class RunCheckpoints:
    def __init__(self, run_dir: Path, rank: int) -> None:
        self.dir = run_dir / "checkpoints"
        self.rank = rank

    @property
    def run(self) -> str:
        return self.dir.parent.name

    def path(self, step: int) -> Path:
        """The checkpoint directory of `step` (shared by all ranks)."""
        return self.dir / f"step{step}"

    def checksum_path(self, step: int) -> Path:
        return self.path(step) / f"rank{self.rank}{CHECKSUM_SUFFIX}"

    def _progress(self) -> Progress:
        file = self.dir / PROGRESS_FILE
        try:
            text = file.read_text(encoding="utf-8")
        except FileNotFoundError:
            return Progress()
        except OSError as exc:
            return Progress(problem=f"{file}: unreadable ({exc.strerror or exc})")
        try:
            stored = json.loads(text)
            return Progress(sorted(int(s) for s in stored["complete"]), bool(stored["finished"]))
        except json.JSONDecodeError as exc:
            return Progress(problem=f"{file}: not valid JSON ({exc.msg}, line {exc.lineno})")
        except (KeyError, TypeError, ValueError):
            return Progress(problem=f"{file}: not a checkpoint progress record")

    def _write_progress(self, complete: Sequence[int], finished: bool) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        write_text_atomically(self.dir / PROGRESS_FILE, json.dumps({"complete": sorted(complete),
                                                                    "finished": finished}))

    def complete(self) -> list[int]:
        """Steps every rank has committed (empty when progress.json is unreadable)."""
        return self._progress().complete

    def latest(self) -> int | None:
        steps = self.complete()
        return steps[-1] if steps else None

    @property
    def finished(self) -> bool:
        return self._progress().finished

    def record_checksums(self, step: int, files: Sequence[Path]) -> None:
        """Record the size and sha256 of each file this rank wrote for `step`, as it lies on disk."""
        records = [{"file": path.name, "bytes": path.stat().st_size, "sha256": _sha256(path)} for path in files]
        write_text_atomically(self.checksum_path(step), json.dumps({"files": records}) + "\n")

    def problem(self, step: int) -> str | None:
        """What is wrong with this rank's files of the checkpoint of `step` (None: present and matching their
        checksums)."""
        directory, sidecar = self.path(step), self.checksum_path(step)
        if not directory.is_dir():
            return f"{directory}: missing"
        try:
            recorded = json.loads(sidecar.read_text(encoding="utf-8"))["files"]
            files = [(directory / str(r["file"]), int(r["bytes"]), str(r["sha256"])) for r in recorded]
        except FileNotFoundError:
            return f"{directory}: no checksum recorded ({sidecar.name} missing)"
        except (OSError, ValueError, KeyError, TypeError):
            return f"{sidecar}: unreadable checksum record"
        return next((p for path, size, digest in files if (p := _file_problem(path, size, digest, sidecar))), None)

    def require_intact(self, step: int) -> Path:
        """The checkpoint directory of `step`, this rank's files verified against their checksums (CheckpointError
        otherwise)."""
        problem = self.problem(step)
        if problem is not None:
            raise CheckpointError(problem)
        return self.path(step)

    def _steps_on_disk(self) -> list[int]:
        """Steps of which this rank holds a checksum record."""
        return sorted(step for file in self.dir.glob(f"step*/rank{self.rank}{CHECKSUM_SUFFIX}")
                      if (step := _step_of(file.parent)) is not None)

    def _candidates(self) -> list[int]:
        """Steps to consider resuming from: those recorded complete or, when progress.json is unreadable, the
        checkpoints this rank holds (the collective check then keeps only steps every rank holds intact)."""
        progress = self._progress()
        return self._steps_on_disk() if progress.problem else progress.complete

    def _files(self, directory: Path) -> list[Path]:
        """This rank's files in a checkpoint directory: those its checksum record lists, and any a killed write left
        (DCP names a rank's data files __<rank>_<n>.distcp; rank 0 writes the metadata)."""
        mine = {*directory.glob(f"__{self.rank}_*"), *directory.glob(f"rank{self.rank}.*")}
        try:
            recorded = json.loads((directory / f"rank{self.rank}{CHECKSUM_SUFFIX}").read_text(encoding="utf-8"))
            mine |= {directory / str(r["file"]) for r in recorded["files"]}
        except (OSError, ValueError, KeyError, TypeError):
            pass
        if self.rank == 0:
            mine |= {*directory.glob(".metadata*")}
        return sorted(mine)

    def _remove(self, step: int) -> None:
        """Delete this rank's files of `step`; the last rank to leave the directory removes it."""
        directory = self.path(step)
        for file in self._files(directory):
            file.unlink(missing_ok=True)
        try:
            directory.rmdir()
        except OSError:
            pass  # another rank's files are still there (or it is gone): that rank removes it

    def _record(self, step: int) -> None:
        progress = self._progress()
        self._write_progress(sorted(set(progress.complete) | {step})[-KEEP:], False)

    def _prune(self, keep: set[int]) -> None:
        for directory in self.dir.glob("step*"):
            step = _step_of(directory)
            if step is not None and step not in keep:
                self._remove(step)


def commit(step: int, runs: Sequence[tuple[RunCheckpoints, Checkpointed]]) -> None:
    """Save every run's state at `step` on this rank, then record the step once every rank has saved."""
    for checkpoints, trainer in runs:
        try:
            checkpoints.record_checksums(step, trainer.save_checkpoint(checkpoints.path(step)))
        except BaseException:  # DCP reports a failed write as a BaseException (CheckpointException)
            checkpoints._remove(step)
            raise
    _barrier()
    if runs and runs[0][0].rank == 0:
        for checkpoints, _ in runs:
            checkpoints._record(step)
    _barrier()
    for checkpoints, _ in runs:
        checkpoints._prune(set(checkpoints.complete()))


def finish(runs: Sequence[RunCheckpoints]) -> None:
    """Record `runs` as finished (a restart skips them), then drop their checkpoints: nothing resumes from them."""
    _barrier()
    if runs and runs[0].rank == 0:
        for checkpoints in runs:
            # The checkpoint files go next, so none is listed as complete any more.
            checkpoints._write_progress([], True)
    _barrier()
    for checkpoints in runs:
        checkpoints._prune(set())


def resume_step(runs: Sequence[RunCheckpoints]) -> int | None:
    """The newest step at which every rank holds an intact checkpoint of every one of `runs` (None: from scratch).

    A collective: every rank calls it with the same runs, and all get the same answer. Rank 0 names on stderr each
    checkpoint passed over. Checkpoints newer than the answer are forgotten: the runs rewrite those steps.
    """
    if not runs:
        return None
    candidates = set.intersection(*(set(r._candidates()) for r in runs))
    mine = {step: next((p for r in runs if (p := r.problem(step)) is not None), None) for step in candidates}
    views: list[dict[int, str | None]] = _all_gather(mine)
    common = set.intersection(*(set(view) for view in views))
    chosen = max((s for s in common if all(view[s] is None for view in views)), default=None)
    if runs[0].rank == 0:
        _warn_fallback(runs, views, chosen)
        log.debug("%s start from %s", " and ".join(sorted({r.run for r in runs})),
                  "scratch" if chosen is None else f"the checkpoint of step {chosen}")
    _forget_after(runs, chosen)
    return chosen


def _warn_fallback(runs: Sequence[RunCheckpoints], views: list[dict[int, str | None]], chosen: int | None) -> None:
    for checkpoints in runs:
        problem = checkpoints._progress().problem
        if problem is not None:
            log.warning("%s; using the checkpoints present instead", problem)
    passed_over = sorted(((step, problem) for view in views for step, problem in view.items()
                          if problem is not None and (chosen is None or step > chosen)), reverse=True)
    if not passed_over:
        return
    names = " and ".join(sorted({r.run for r in runs}))
    target = f"step {chosen}" if chosen is not None else "scratch (no intact checkpoint left)"
    more = f" (and {len(passed_over) - 1} more)" if len(passed_over) > 1 else ""
    log.warning("%s%s; %s resume from %s", passed_over[0][1], more, names, target)


def _forget_after(runs: Sequence[RunCheckpoints], step: int | None) -> None:
    keep = {s for r in runs for s in r._candidates() if step is not None and s <= step}
    if runs[0].rank == 0:
        for checkpoints in runs:
            progress = checkpoints._progress()
            complete = [s for s in progress.complete if s in keep] if not progress.problem else sorted(keep)
            if complete != progress.complete or progress.problem:
                checkpoints._write_progress(complete, False)
    _barrier()
    for checkpoints in runs:
        checkpoints._prune(keep)


def _step_of(directory: Path) -> int | None:
    head = directory.name.removeprefix("step")
    return int(head) if head.isdigit() else None


def _file_problem(path: Path, size: int, digest: str, sidecar: Path) -> str | None:
    try:
        actual_size = path.stat().st_size
        if actual_size < size:
            return f"{path}: truncated ({actual_size} of {size} bytes)"
        if actual_size != size:
            return f"{path}: checksum mismatch ({actual_size} bytes, {size} recorded)"
        if _sha256(path) != digest:
            return f"{path}: checksum mismatch (sha256 differs from {sidecar.name})"
    except FileNotFoundError:
        return f"{path}: missing"
    except OSError as exc:
        return f"{path}: unreadable ({exc.strerror or exc})"
    return None


def _sha256(path: Path) -> str:
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _all_gather(value: Any) -> list[Any]:
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, value)
        return gathered
    return [value]


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
