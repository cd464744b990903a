"""Load step records of run directories into pandas, rejecting other schema versions.

Each rank's JSONL stream is parsed by pyarrow's multithreaded JSON reader (a thousand times fewer Python calls than
`json.loads` per line); a parse problem falls back to a line-by-line reader only to name the offending line. The
parsed run is cached beside the streams as parquet, keyed by the streams' names, sizes and mtimes, so re-analysing a
finished run reads columnar data instead of text.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.json as pa_json
import pyarrow.parquet as pq

from taxbench.records import MANIFEST, METRICS, SCHEMA_VERSION

CACHE_FILE = ".steps.parquet"
_CACHE_KEY = b"taxbench.streams"

# Types of the known fields; fields a newer writer adds are inferred. Fixing these keeps a column that is null in one
# file (device_s on CPU) and a number in another from failing to concatenate.
_FIELD_TYPES = {
    "schema_version": pa.int64(),
    "arm": pa.string(),
    "replica": pa.string(),
    "rank": pa.int64(),
    "step": pa.int64(),
    "block": pa.int64(),
    "data_s": pa.float64(),
    "tokens": pa.int64(),
    "time_s": pa.float64(),
    "window_s": pa.float64(),
    "device_s": pa.float64(),
    "loss": pa.float64(),
    "grad_norm": pa.float64(),
    **{metric: pa.string() for metric in METRICS},
}
_PARSE = pa_json.ParseOptions(explicit_schema=pa.schema(_FIELD_TYPES), unexpected_field_behavior="infer")


class RecordError(ValueError):
    """A run directory or record file that cannot be analysed; the message names the file."""


def _version_error(path: Path, number: int, version: object) -> RecordError:
    return RecordError(
        f"{path}:{number}: schema_version={version!r}, this taxbench reads {SCHEMA_VERSION}; analyse it with "
        "the taxbench version that wrote it"
    )


def _diagnose(path: Path, data: bytes) -> RecordError:
    """The precise complaint about a stream the fast reader refused (slow, only on the error path)."""
    for number, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            return RecordError(f"{path}:{number}: not a JSON record ({exc.msg})")
        if not isinstance(record, dict):
            return RecordError(f"{path}:{number}: not a JSON object")
        if record.get("schema_version") != SCHEMA_VERSION:
            return _version_error(path, number, record.get("schema_version"))
    return RecordError(f"{path}: records have inconsistent field types; was it written by taxbench?")


def _stream_bytes(path: Path) -> bytes:
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        data = data[: data.rfind(b"\n") + 1]  # torn final record of a crashed run: everything before it stands
    return data


def _parse(data: bytes) -> pa.Table:
    options = pa_json.ReadOptions(block_size=4 << 20)  # blocks are parsed in parallel; 4 MiB measured best here
    return pa_json.read_json(io.BytesIO(data), read_options=options, parse_options=_PARSE)


def _version_ok(table: pa.Table) -> bool:
    versions = table.column("schema_version")
    return versions.null_count == 0 and bool((versions.to_numpy() == SCHEMA_VERSION).all())


def _read_streams(files: list[Path]) -> pa.Table | None:
    """All streams parsed in one pass (records carry their rank); a failure is traced back to its file and line."""
    chunks = [_stream_bytes(f) for f in files]
    data = b"".join(chunks)
    if not data.strip():
        return None
    try:
        table = _parse(data)
    except pa.ArrowInvalid:
        table = None
    if table is not None and _version_ok(table):
        return table
    for path, chunk in zip(files, chunks, strict=True):
        if chunk.strip():
            error = _diagnose(path, chunk)
            if not str(error).endswith("was it written by taxbench?"):
                raise error
    raise _diagnose(files[0], chunks[0])


def _streams_key(files: list[Path]) -> bytes:
    return json.dumps([[f.name, (s := f.stat()).st_size, s.st_mtime_ns] for f in files]).encode()


def _read_cache(run_dir: Path, key: bytes) -> pd.DataFrame | None:
    path = run_dir / CACHE_FILE
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException):
        return None
    if (table.schema.metadata or {}).get(_CACHE_KEY) != key:
        return None
    return table.to_pandas()


def _write_cache(run_dir: Path, table: pa.Table, key: bytes) -> None:
    tmp = run_dir / (CACHE_FILE + ".tmp")
    try:
        pq.write_table(table.replace_schema_metadata({_CACHE_KEY: key}), tmp)
        tmp.replace(run_dir / CACHE_FILE)
    except OSError:
        tmp.unlink(missing_ok=True)  # a read-only results folder: analyse without caching


def load_run(run_dir: Path, cache: bool = True) -> pd.DataFrame:
    """All ranks' step records of one run, sorted by (step, rank)."""
    files = sorted(run_dir.glob("steps.rank*.jsonl"))
    if not files:
        raise RecordError(f"{run_dir}: no steps.rank<R>.jsonl files; is this a taxbench run directory?")
    key = _streams_key(files)
    if cache and (frame := _read_cache(run_dir, key)) is not None:
        return frame
    table = _read_streams(files)
    if table is None:
        raise RecordError(f"{run_dir}: the step record files are empty")
    table = table.sort_by([("step", "ascending"), ("rank", "ascending")])
    if cache:
        _write_cache(run_dir, table, key)
    return table.to_pandas()


def load_manifest(run_dir: Path) -> dict:
    path = run_dir / MANIFEST
    if not path.exists():
        raise RecordError(f"{path}: missing manifest")
    manifest = json.loads(path.read_text(encoding="utf-8"))
    if manifest.get("schema_version") != SCHEMA_VERSION:
        raise RecordError(f"{path}: schema_version={manifest.get('schema_version')!r}, expected {SCHEMA_VERSION}")
    return manifest


def step_times(frame: pd.DataFrame) -> pd.DataFrame:
    """Per-step time of the whole job (the slowest rank) with its block, sorted by step."""
    grouped = frame.groupby("step", sort=True).agg(time_s=("time_s", "max"), block=("block", "first"))
    return grouped.reset_index()
