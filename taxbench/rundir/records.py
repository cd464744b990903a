"""The run-directory contract: step records and fault events (append-only JSONL per rank) and the manifest.

`<out>/<experiment>/<arm>-<replica>/manifest.json` and `steps.rank<R>.jsonl`, one JSON object per step. Every line
is flushed when written, so a crash loses at most the record being written; a resumed run first drops records past
its checkpoint so nothing is duplicated. Readers reject any other schema_version. Beside each stream lies its
columnar mirror `steps.rank<R>.arrow` (taxbench.rundir.step_stream), which analysis trusts only as far as it provably
matches the stream's bytes. A run with an injected fault also holds `faults.rank<R>.jsonl`: one event per fault that
actually fired on that rank (kind, step, rank, where).

Files that are replaced whole (manifest, checkpoints, their progress record) are written to a `.tmp` sibling and
renamed into place; a failed write (a full disk) removes the `.tmp` and raises `RunWriteError` naming the file.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from taxbench.oserrors import describe_os_error

# 2: fingerprint format 2 (shape in the digest header); 3: layout-invariant initial weights (taxbench.workloads.init):
# the same recipe starts from other values than under 2, so fingerprints of 2 and 3 are not comparable
SCHEMA_VERSION = 3

# Fingerprinted metrics in the order they are produced within a step; the first mismatch is reported in this order.
METRICS = ("loss_bits", "grads", "grad_norm_bits", "params", "optim")

MANIFEST = "manifest.json"


def steps_file(run_dir: Path, rank: int) -> Path:
    return run_dir / f"steps.rank{rank}.jsonl"


def op_table_file(run_dir: Path, rank: int) -> Path:
    """A profile run's op table (taxbench.rundir.op_table.OpTable) of one rank."""
    return run_dir / f"ops.rank{rank}.json"


# The layout of logical_weights.json's digests (taxbench.parallel.logical_digest); 2: persistent buffers are
# digested too (format 1 files cover parameters only and are refused).
WEIGHTS_FORMAT = 2


def weights_file(run_dir: Path) -> Path:
    """A layouts run's layout-invariant weight digests at its first and last step (taxbench.parallel.logical_digest)."""
    return run_dir / "logical_weights.json"


def faults_file(run_dir: Path, rank: int) -> Path:
    return run_dir / f"faults.rank{rank}.jsonl"


class RunWriteError(OSError):
    """A run-directory file could not be written: "no space left on <path>" or "<path>: <reason>"."""

    def __str__(self) -> str:
        return str(self.strerror)


def write_error(path: Path, exc: BaseException) -> RunWriteError | None:
    """The RunWriteError for a failed write of `path`, or None when `exc` is no I/O failure.

    torch.save reports a failed write as a RuntimeError ("basic_ios::clear: iostream error", "file write failed")
    that may or may not chain the OSError behind it; a full file system is then recognised by its free space.
    """
    cause: BaseException | None = exc
    while cause is not None and not isinstance(cause, OSError):
        cause = cause.__cause__ or cause.__context__
    if isinstance(cause, OSError):
        code = cause.errno or errno.EIO
        return RunWriteError(code, describe_os_error(OSError(code, cause.strerror or str(cause)), path), str(path))
    if isinstance(exc, RuntimeError) and _no_space_left(path):
        return RunWriteError(errno.ENOSPC, describe_os_error(OSError(errno.ENOSPC, "no space"), path), str(path))
    return None


def _as_write_error(path: Path, exc: OSError) -> RunWriteError:
    error = write_error(path, exc)
    assert error is not None  # an OSError always is one
    return error


def _no_space_left(path: Path) -> bool:
    try:
        stat = os.statvfs(path.parent)
    except OSError:
        return False
    return stat.f_bavail * stat.f_frsize < 1 << 20 or (stat.f_files > 0 and stat.f_favail == 0)


def write_atomically(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Write `path` whole or not at all: into `<path>.tmp` (flushed to disk), then renamed over `path`."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with tmp.open("wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as exc:
        _remove_quietly(tmp)
        error = write_error(path, exc)
        if error is None:
            raise
        raise error from exc


def write_text_atomically(path: Path, text: str) -> None:
    write_atomically(path, lambda handle: handle.write(text.encode("utf-8")))


def _remove_quietly(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass  # the write error is what the user needs to hear about


class JsonlWriter:
    """Appends one JSON record per line to a stream (step records, fault events), flushing each line."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("a", encoding="utf-8")
        except OSError as exc:
            raise self._error(exc) from exc

    def truncate_after(self, step: int) -> None:
        """Drop records past `step` (written after the checkpoint a resume starts from)."""
        self._file.close()
        truncate_jsonl_after(self.path, step)
        self._file = self.path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        try:
            self._file.write(json.dumps({"schema_version": SCHEMA_VERSION, **record}, separators=(",", ":")) + "\n")
            self._file.flush()
        except OSError as exc:
            raise self._error(exc) from exc

    def sync(self) -> None:
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
        except OSError as exc:
            raise self._error(exc) from exc

    @property
    def closed(self) -> bool:
        return self._file.closed

    def close(self) -> None:
        if not self.closed:
            try:
                self.sync()
            finally:
                self._close_quietly()

    def _close_quietly(self) -> None:
        try:
            self._file.close()
        except OSError:
            pass  # a buffered tail that cannot be written: sync() has raised for it already

    def _error(self, exc: OSError) -> RunWriteError:
        return _as_write_error(self.path, exc)


class FaultLog(JsonlWriter):
    """`faults.rank<R>.jsonl`: one flushed event per injected fault that actually fired on this rank."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        super().__init__(faults_file(run_dir, rank))
        self.rank = rank

    def fired(self, kind: str, step: int, where: str) -> None:
        self.write({"kind": kind, "step": step, "rank": self.rank, "where": where})
        self.sync()


def truncate_jsonl_after(path: Path, step: int) -> None:
    """Atomically keep only the records of a JSONL stream whose "step" is <= `step` (and drop a torn last line)."""
    if not path.exists():
        return
    kept = [line for line, record in jsonl_records(path) if record.get("step", 0) <= step]
    write_text_atomically(path, "".join(k + "\n" for k in kept))  # a mirror of more than this no longer verifies


def step_record(path: Path, step: int) -> dict[str, Any] | None:
    """The last record of `step` in a JSONL stream (None when there is none)."""
    found = None
    if path.exists():
        for _, record in jsonl_records(path):
            if record.get("step") == step:
                found = record
    return found


def jsonl_records(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """Every (line, record) of a JSONL stream, a torn last line left out."""
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn last line from a crash
        if isinstance(record, dict):
            records.append((line, record))
    return records


def write_manifest_text(run_dir: Path, text: str) -> None:
    """<run_dir>/manifest.json, atomically (taxbench.rundir.run_manifest.Manifest.write makes the text)."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _as_write_error(run_dir, exc) from exc
    write_text_atomically(run_dir / MANIFEST, text)
