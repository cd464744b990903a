"""Per-rank trace streams: `<run_dir>/trace/trace.rank<R>.jsonl`, one JSON record per captured event.

A record is `{schema_version, seq, rank, step, kind, name, id, scope, in, out}`; `in`/`out` are lists of tensor
summaries `{shape, dtype, digest}` (digest is a 16-hex-digit fingerprint, or null when the tensor was larger than the
capture's max_numel). A record that communicates also holds `comm`: `{collectives: [names], group: [global ranks]
or null}` (a traced collective, or a module that runs collectives inside it). Records are written in batches (one
per traced step) and flushed per batch. Readers refuse another schema_version and report torn or malformed lines with
file and line number instead of crashing.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from taxbench import exit_codes
from taxbench.rundir.evidence import experiment_of, read_regular

# 2: digests of fingerprint format 2 (shape in the header, any dtype), not comparable to 1. 3: records that communicate
# say so (`comm`); a trace without it would let the diff name a rank that only received the difference.
TRACE_SCHEMA_VERSION = 3
TRACE_DIR = "trace"
RECORD_KEYS = ("schema_version", "seq", "rank", "step", "kind", "name", "id", "scope", "in", "out")
KINDS = ("collective", "pipeline", "optimizer", "parameter", "checkpoint", "module", "op")


class TraceError(ValueError):
    """A trace directory or file that cannot be read; the message names the file, the line and the fix. Exit 2 (no
    trace captured, another schema version) unless a subclass says otherwise."""

    exit_code = exit_codes.CONFIG_ERROR


class UnreadableTrace(TraceError):
    """Trace records that are there but cannot be read (torn, not JSON, damaged, a FIFO or a device): incomplete
    evidence, exit 4, as every other unreadable record (README "exit codes")."""

    exit_code = exit_codes.INCOMPLETE


def trace_dir(run_dir: Path) -> Path:
    return run_dir / TRACE_DIR


def trace_file(run_dir: Path, rank: int) -> Path:
    return trace_dir(run_dir) / f"trace.rank{rank}.jsonl"


_ENCODER = json.JSONEncoder(separators=(",", ":"))  # one encoder for every record: json.dumps builds one per call


class TraceWriter:
    """Appends batches of records to one rank's stream; one flush per batch."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = path.open("a", encoding="utf-8")

    def write_batch(self, records: Iterable[dict[str, Any]]) -> None:
        encode = _ENCODER.encode
        self._file.write("".join([encode({"schema_version": TRACE_SCHEMA_VERSION, **record}) + "\n"
                                  for record in records]))
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


def _check_record(record: Any, where: str) -> dict[str, Any]:
    if not isinstance(record, dict):
        raise UnreadableTrace(f"{where}: expected a JSON object, got {type(record).__name__}")
    version = record.get("schema_version")
    if version != TRACE_SCHEMA_VERSION:
        raise TraceError(
            f"{where}: trace schema_version={version!r}, this taxbench reads {TRACE_SCHEMA_VERSION}; diff traces "
            "written by the same taxbench version (re-capture the step with this version)"
        )
    missing = [key for key in RECORD_KEYS if key not in record]
    if missing:
        raise UnreadableTrace(f"{where}: trace record lacks {missing}; the file is not a taxbench trace or is damaged")
    if record["kind"] not in KINDS:
        raise UnreadableTrace(f"{where}: kind={record['kind']!r} is not a trace record kind {list(KINDS)}")
    for side in ("in", "out"):
        if not isinstance(record[side], list):
            raise UnreadableTrace(f"{where}: field {side!r} must be a list of tensor summaries")
    comm = record.get("comm")
    if comm is not None and not (isinstance(comm, dict) and isinstance(comm.get("collectives"), list)
                                 and (comm.get("group") is None or isinstance(comm.get("group"), list))):
        raise UnreadableTrace(f"{where}: field 'comm' must be {{collectives: [...], group: [...] or null}}")
    return record


def read_trace_file(path: Path) -> list[dict[str, Any]]:
    """The records of one trace file (<experiment>/<run>/trace/trace.rank<R>.jsonl), a regular file inside its
    experiment (a FIFO or device is refused unopened: taxbench.rundir.evidence)."""
    try:
        text = read_regular(path, experiment_of(path.parent.parent)).decode("utf-8", errors="replace")
    except OSError as exc:
        raise UnreadableTrace(f"{path}: cannot be read ({exc.strerror or exc})") from exc
    lines = text.splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if number == len(lines) and not text.endswith("\n"):
                raise UnreadableTrace(
                    f"{path}:{number}: the last trace record is torn (the writing process stopped mid-line); "
                    "records after it are missing, so a diff could mistake that for control-flow divergence. "
                    "Re-capture the step (e.g. with `taxbench localize`)"
                ) from exc
            raise UnreadableTrace(f"{path}:{number}: not a JSON record ({exc.msg}); the trace file is corrupt") from exc
        records.append(_check_record(record, f"{path}:{number}"))
    return records


def read_trace(run_dir: Path) -> dict[int, list[dict[str, Any]]]:
    """All ranks' trace records of one run, keyed by rank, each sorted by (step, seq)."""
    directory = trace_dir(run_dir)
    files = sorted(directory.glob("trace.rank*.jsonl"))
    if not files:
        raise TraceError(
            f"{directory}: no trace.rank<R>.jsonl files; capture a trace first (experiment.trace.enabled=true with "
            "experiment.trace.steps=[...], or `taxbench localize RUN_A RUN_B`)"
        )
    by_rank: dict[int, list[dict[str, Any]]] = {}
    for path in files:
        try:
            rank = int(path.name.removeprefix("trace.rank").removesuffix(".jsonl"))
        except ValueError as exc:
            raise TraceError(f"{path}: file name does not follow trace.rank<R>.jsonl") from exc
        records = read_trace_file(path)
        for record in records:
            if record["rank"] != rank:
                raise TraceError(f"{path}: holds a record of rank {record['rank']}; files must hold one rank each")
        by_rank[rank] = sorted(records, key=lambda r: (r["step"], r["seq"]))
    return by_rank
