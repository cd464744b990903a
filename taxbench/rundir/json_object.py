"""The errors a run folder's readers raise, and the reading of one JSON object file (a manifest, a plan)."""

from __future__ import annotations

import json
from pathlib import Path

from taxbench import exit_codes
from taxbench.rundir.evidence import read_regular

JSON_OBJECT_LIMIT = 64 << 20  # manifests, op tables, layouts and weight records are KiB to a few MiB


class RecordError(ValueError):
    """A run directory or record file that cannot be analysed; the message names the file. Exit 2 (bad input: not
    a taxbench folder, records of another schema version) unless a subclass says otherwise."""

    exit_code = exit_codes.CONFIG_ERROR


class UnreadableRecords(RecordError):
    """Evidence that is there but cannot be read: a line that is not a JSON record, a damaged manifest, a file that
    cannot be opened or is no regular file inside the experiment. Incomplete evidence, exit 4 (README "exit codes")."""

    exit_code = exit_codes.INCOMPLETE


class ResultWriteError(RecordError):
    """A result of the analysis (summary.json, sweep.csv, the report) that cannot be written; names the path."""


def read_json_object(path: Path, what: str, inside: Path | None = None) -> dict:
    """A JSON object from `path`, a regular file inside `inside` (default: its own folder); UnreadableRecords naming
    the path (and `what` it should be) otherwise."""
    try:
        stored = json.loads(read_regular(path, inside or path.parent, JSON_OBJECT_LIMIT).decode("utf-8"))
    except OSError as exc:
        raise UnreadableRecords(f"{path}: cannot be read ({exc.strerror or exc})") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UnreadableRecords(f"{path}: not valid JSON ({exc}); the {what} is damaged") from exc
    if not isinstance(stored, dict):
        raise UnreadableRecords(f"{path}: not a JSON object; the {what} is damaged")
    return stored
