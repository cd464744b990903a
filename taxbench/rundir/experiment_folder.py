"""The experiment folder `<out_dir>/<name>[/point<N>]`: claimed by one launch at a time, never clobbered.

A launch holds an exclusive lock on `<root>/.taxbench.lock` (POSIX record lock: released by the kernel when the
process dies, and honoured on NFS) from before it looks at the folder until its report is written. A second launch,
or a `continue_existing` while the first still runs, is refused naming the holder. Results already in the folder
are never overwritten: only `experiment.continue_existing=true` with the same config may add to them. A folder this
launch created is removed again when the claim is refused, so a refused launch leaves nothing behind.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import struct
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TextIO

from omegaconf import OmegaConf

from taxbench.config.pairing import experiment_differences
from taxbench.config.schema import ConfigError, TaxbenchConfig
from taxbench.design import ALL_RUNS, TIMED
from taxbench.oserrors import describe_os_error
from taxbench.redaction import redact, redact_text
from taxbench.rundir.evidence import check_regular, open_regular
from taxbench.rundir.read import RecordError
from taxbench.rundir.run_manifest import load_manifest

LOCK_FILE = ".taxbench.lock"
# In the folder a Hydra multirun creates for its points (<out_dir>/<name>/point<N>/): the mark that makes it a sweep
# `taxbench report` may analyse as a whole (any other folder that is no experiment is refused).
SWEEP_MARKER = ".taxbench-sweep"


def experiment_root(cfg: TaxbenchConfig, point: int | None = None) -> Path:
    """Where the experiment's runs go; `point` numbers the points of a multirun, which share experiment.name."""
    root = Path(cfg.experiment.out_dir) / cfg.experiment.name
    return root if point is None else root / f"point{point}"


@contextmanager
def claimed(cfg: TaxbenchConfig, root: Path) -> Iterator[Path]:
    """Create (or reopen, to continue) the experiment folder and hold its lock for the duration of the block.

    A folder this claim created is removed again if it is still empty at the end (a refused or failed launch)."""
    created = _create(root)
    try:
        with _lock(root):
            _check_reuse(root, cfg)
            yield root
    finally:
        if created and _holds_nothing(root):
            shutil.rmtree(root, ignore_errors=True)


def _holds_nothing(root: Path) -> bool:
    return all(entry.name == LOCK_FILE for entry in root.iterdir()) if root.is_dir() else False


def _create(root: Path) -> bool:
    """Make the folder (and out_dir); True when this call created the experiment folder itself."""
    try:
        root.mkdir(parents=True)
        return True
    except FileExistsError:
        if not root.is_dir():
            raise ConfigError(f"{root} exists and is not a folder; pick another experiment.name") from None
        return False
    except OSError as exc:
        raise ConfigError(f"cannot create the experiment folder: {describe_os_error(exc)}") from exc


def _lock(root: Path) -> TextIO:
    path = root / LOCK_FILE
    handle = path.open("a+", encoding="utf-8")
    try:
        fcntl.lockf(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = Holder.of(handle.read(4096))
        handle.close()
        raise ConfigError(
            f"{root} is in use by {holder.describe()}; wait for it to finish, or pick another experiment.name"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(json.dumps({
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started_utc": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": redact_text(" ".join(sys.argv)),
    }))
    handle.flush()
    return handle


def _check_reuse(root: Path, cfg: TaxbenchConfig) -> None:
    holds_results = any((root / ref.name).exists() for ref in ALL_RUNS)
    if not holds_results:
        return
    if not cfg.experiment.continue_existing:
        raise ConfigError(
            f"{root} already holds results; pick another experiment.name (or out_dir) instead of overwriting "
            "them, or continue an interrupted experiment with experiment.continue_existing=true"
        )
    _require_same_config(root, cfg)


def _require_same_config(root: Path, cfg: TaxbenchConfig) -> None:
    try:
        stored = load_manifest(root / TIMED["deterministic"].name).run_config
    except RecordError as exc:
        raise ConfigError(f"cannot continue {root}: {exc}; start a new experiment.name") from exc

    # The stored config went through redaction; compare like with like.
    current = redact(OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True, enum_to_str=True))
    changed = experiment_differences(stored, current)
    if changed:
        lines = "\n".join(f"  {key}: was {a!r}, now {b!r}" for key, a, b in changed)
        raise ConfigError(
            f"experiment.continue_existing=true needs the config {root} was started with; changed:\n{lines}"
        )


def mark_sweep(folder: Path) -> None:
    """Create a multirun's sweep folder and mark it as taxbench's own; a folder that already exists is marked only
    while it is empty (someone else's folder of that name stays unmarked, so no report treats it as a sweep)."""
    try:
        folder.mkdir(parents=True)
    except FileExistsError:
        if not folder.is_dir() or any(folder.iterdir()):
            return
    except OSError as exc:
        raise ConfigError(f"cannot create the sweep folder: {describe_os_error(exc)}") from exc
    record = {"created_utc": datetime.now(UTC).isoformat(timespec="seconds"),
              "command": redact_text(" ".join(sys.argv))}
    try:
        with open(folder / SWEEP_MARKER, "x", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")
    except FileExistsError:
        pass  # another point of the sweep marked it first


def is_marked_sweep(folder: Path) -> bool:
    """Whether a taxbench multirun created `folder` as its sweep folder (a regular file SWEEP_MARKER in it)."""
    try:
        check_regular(folder / SWEEP_MARKER, folder)
    except OSError:
        return False
    return True


@dataclass(frozen=True)
class Holder:
    """The launch that holds an experiment folder, as its lock file records it."""

    pid: int | None
    host: str | None
    started_utc: str | None
    command: str | None

    @classmethod
    def of(cls, recorded: str) -> Holder:
        """What `_lock` wrote; a lock file that holds no such record names no pid or host."""
        try:
            fields = json.loads(recorded)
        except ValueError:
            fields = None
        if not isinstance(fields, dict):
            return cls(None, None, None, None)
        pid = fields.get("pid")
        return cls(pid if isinstance(pid, int) else None, _text(fields.get("host")), _text(fields.get("started_utc")),
                   _text(fields.get("command")))

    def who(self) -> str:
        """"the launch with pid 4242 on host node7"."""
        if self.pid is None and self.host is None:
            return "another launch (its lock file names no pid or host)"
        return f"the launch with pid {self.pid} on host {self.host}"

    def describe(self) -> str:
        """"the launch with pid 4242 on host node7 (started 2026-12-05T11:00:00+00:00: python -m taxbench ...)"."""
        since = ": ".join(part for part in (self.started_utc, self.command) if part)
        return self.who() + (f" (started {since})" if since and self.pid is not None else "")


def _text(value: object) -> str | None:
    return value if isinstance(value, str) else None


def held_by(folder: Path) -> Holder | None:
    """Who holds `folder`'s launch lock right now (its pid, host and command), or None when no live launch does.

    Call it only from a process that launches nothing: POSIX record locks belong to the process, and closing any
    descriptor of the lock file would drop a lock this process held itself."""
    path = folder / LOCK_FILE
    try:
        fd = open_regular(path, folder)
    except OSError:
        return None  # no lock file (or none taxbench wrote): nobody holds the folder
    with os.fdopen(fd, "rb") as handle:
        # F_GETLK asks whether a read lock could be placed without placing one, so this probe never makes a launch
        # that starts at this instant find the folder "in use".
        probe = struct.pack(_FLOCK, fcntl.F_RDLCK, os.SEEK_SET, 0, 0, 0)
        answer = struct.unpack(_FLOCK, fcntl.fcntl(handle.fileno(), fcntl.F_GETLK, probe))
        if answer[0] == fcntl.F_UNLCK:
            return None
        return Holder.of(handle.read(4096).decode("utf-8", errors="replace"))


_FLOCK = "hhqqi"  # struct flock: l_type, l_whence, l_start, l_len, l_pid (native alignment, 64-bit off_t)
