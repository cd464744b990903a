"""One wording for file-system failures users hit (disk full, read-only folder, permission): a line, not a traceback."""

from __future__ import annotations

import errno
from pathlib import Path


def describe_os_error(exc: OSError, path: str | Path | None = None) -> str:
    """"no space left on <path>" for a full disk, else "<path>: <reason>"; `path` defaults to the error's own."""
    where = path if path is not None else (exc.filename if exc.filename is not None else "?")
    if exc.errno == errno.ENOSPC:
        return f"no space left on {where}; free space or point the output elsewhere"
    if exc.errno == errno.EROFS:
        return f"{where}: read-only file system; choose a writable folder"
    return f"{where}: {exc.strerror or exc}"
