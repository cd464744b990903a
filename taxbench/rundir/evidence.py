"""Files analysis reads as evidence are regular files inside the experiment, checked before they are opened.

A FIFO blocks its reader forever, a device (a symlink to /dev/zero) never ends, and a symlink to a file outside the
experiment is another experiment's evidence read without a word. So every record file is looked at with lstat/stat
first and refused, naming what it is, unless it is a regular file whose real path lies inside the experiment folder
(symlinks between the experiment's own runs are allowed). The open itself is non-blocking and its result checked again
(fstat), so a file swapped for a FIFO between the check and the open cannot block either.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path


class NotEvidence(OSError):
    """A record file that is not a regular file inside its experiment: a FIFO, a device, a socket, a folder, or a
    symlink that leaves the experiment. The message names the file and what it is."""

    def __str__(self) -> str:
        return str(self.strerror)


_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder"))


def kind_of(mode: int) -> str:
    """What a file of this st_mode is, in words ("a FIFO (named pipe)"); "a regular file" for one."""
    if stat.S_ISREG(mode):
        return "a regular file"
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _refuse(path: Path, what: str) -> NotEvidence:
    return NotEvidence(errno.EINVAL, f"{path}: {what}, not a regular file of the experiment; records must be regular "
                                     "files inside the experiment folder (replace it with the file itself)", str(path))


def check_regular(path: Path, inside: Path) -> os.stat_result:
    """The stat of `path` when it is a regular file whose real path lies inside `inside` (the experiment folder);
    NotEvidence naming what it is otherwise, FileNotFoundError when it does not exist. Opens nothing."""
    link = os.lstat(path)
    if stat.S_ISLNK(link.st_mode):
        target = path.resolve()
        if not target.is_relative_to(inside.resolve()):
            raise _refuse(path, f"a symlink to {target}, outside the experiment {inside}")
    info = os.stat(path)
    if not stat.S_ISREG(info.st_mode):
        raise _refuse(path, kind_of(info.st_mode))
    return info


def open_regular(path: Path, inside: Path) -> int:
    """A read-only file descriptor of `path` after check_regular; opened non-blocking (a file swapped for a FIFO after
    the check does not block) and checked again with fstat. The caller closes it."""
    check_regular(path, inside)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _refuse(path, kind_of(mode))
        os.set_blocking(fd, True)  # regular files never block; later reads need no EAGAIN handling
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: Path, inside: Path, limit: int | None = None) -> bytes:
    """The bytes of `path`, a regular file inside `inside` (see check_regular), of at most `limit` bytes when given
    (a manifest of gigabytes is no manifest: refused before it is read)."""
    with os.fdopen(open_regular(path, inside), "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        if limit is not None and size > limit:
            raise NotEvidence(errno.EFBIG, f"{path}: {size} bytes, more than the {limit} bytes such a record can "
                                           "hold; the file is not what its name says", str(path))
        return handle.read() if limit is None else handle.read(limit + 1)


def experiment_of(run_dir: Path) -> Path:
    """The experiment folder a run folder lies in (`<experiment>/<run>/`): what its files must stay inside."""
    return run_dir.parent
