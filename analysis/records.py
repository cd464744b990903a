"""Load step records of run directories into pandas, rejecting other schema versions, and check them for gaps.

Each rank's JSONL stream is parsed by pyarrow's multithreaded JSON reader (a thousand times fewer Python calls than
`json.loads` per line); a parse problem falls back to a line-by-line reader only to name the offending line.

The parsed run is cached beside the streams as parquet (`.steps.parquet`) and tied to what it was made from: its
footer stores each stream's name, size and SHA-256, and a digest of the decoded table. A cache hit re-hashes the
streams (SHA-256 runs at GB/s, far faster than parsing JSON) and the table it read back, so an edited stream, a
stale or foreign cache, or a flipped byte anywhere in the cache file means a rebuild from the JSONL, never a
different frame. mtimes are not part of the key: a copy that changes them (cp, rsync without -t) keeps its cache.

`check_run` checks a loaded run against its manifest: every rank of the world, every step 1..steps, nothing twice,
nothing outside that grid. Its findings make an experiment "incomplete" (taxbench.analysis.summary).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.json as pa_json
import pyarrow.parquet as pq

from taxbench.records import MANIFEST, METRICS, SCHEMA_VERSION

CACHE_FILE = ".steps.parquet"
_CACHE_KEY = b"taxbench.streams"
_CACHE_FORMAT = 2  # 1: names, sizes and mtimes only (trusted by name); 2: content hashes and a table digest
_STREAM_NAME = re.compile(r"steps\.rank(\d+)\.jsonl")
_FAULTS_NAME = re.compile(r"faults\.rank(\d+)\.jsonl")

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
    "fingerprint_s": pa.float64(),
    "device_s": pa.float64(),
    "planted_s": pa.float64(),
    "mem_peak_bytes": pa.int64(),
    "mem_reserved_bytes": pa.int64(),
    "loss": pa.float64(),
    "grad_norm": pa.float64(),
    **{metric: pa.string() for metric in METRICS},
}
_PARSE = pa_json.ParseOptions(explicit_schema=pa.schema(_FIELD_TYPES), unexpected_field_behavior="infer")


class RecordError(ValueError):
    """A run directory or record file that cannot be analysed; the message names the file."""


class ResultWriteError(RecordError):
    """A result of the analysis (summary.json, sweep.csv, the report) that cannot be written; names the path."""


# ------------------------------------------------------------------------------------------------ reading streams
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


def _parse(data: pa.Buffer) -> pa.Table:
    options = pa_json.ReadOptions(block_size=4 << 20)  # blocks are parsed in parallel; 4 MiB measured best here
    return pa_json.read_json(pa.BufferReader(data), read_options=options, parse_options=_PARSE)


def _version_ok(table: pa.Table) -> bool:
    versions = table.column("schema_version")
    return versions.null_count == 0 and bool((versions.to_numpy() == SCHEMA_VERSION).all())


_NOT_BLANK = re.compile(rb"\S")


@dataclass
class _Streams:
    """A run's streams read into one buffer: each stream's whole records, back to back, ready for one parse."""

    files: list[Path]
    buffer: bytearray
    spans: list[tuple[int, int]]  # where each stream's whole records lie in `buffer`
    key: list[list[Any]]  # each file as read: name, size, SHA-256 (the parquet cache's key)

    @property
    def end(self) -> int:
        return self.spans[-1][1] if self.spans else 0

    def blank(self) -> bool:
        return _NOT_BLANK.search(self.buffer, 0, self.end) is None


def _read_into_one_buffer(files: list[Path]) -> _Streams:
    """Each stream straight into one preallocated buffer (no per-file bytes, no join). A torn final record of a
    crashed run is dropped (everything before it stands) by letting the next stream overwrite it."""
    sizes = [_size(f) for f in files]
    buffer = bytearray(sum(sizes))
    view = memoryview(buffer)
    spans: list[tuple[int, int]] = []
    key: list[list[Any]] = []
    position = 0
    for path, size in zip(files, sizes, strict=True):
        try:
            with path.open("rb", buffering=0) as handle:
                read = 0
                while read < size and (n := handle.readinto(view[position + read: position + size])):
                    read += n
        except OSError as exc:
            raise RecordError(f"{path}: cannot be read ({exc.strerror or exc})") from exc
        key.append([path.name, read, hashlib.sha256(view[position: position + read]).hexdigest()])
        end = position + read
        if read and buffer[end - 1] != ord("\n"):
            end = buffer.rfind(b"\n", position, end) + 1 or position
        spans.append((position, end))
        position = end
    view.release()
    return _Streams(files, buffer, spans, key)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError as exc:
        raise RecordError(f"{path}: cannot be read ({exc.strerror or exc})") from exc


def _read_streams(streams: _Streams) -> pa.Table | None:
    """All streams parsed in one pass (records carry their rank); a failure is traced back to its file and line."""
    if streams.blank():
        return None
    try:
        table = _parse(pa.py_buffer(streams.buffer).slice(0, streams.end))
    except pa.ArrowInvalid:
        table = None
    if table is not None and _version_ok(table):
        return table
    chunks = [bytes(streams.buffer[start:end]) for start, end in streams.spans]
    for path, chunk in zip(streams.files, chunks, strict=True):
        if chunk.strip():
            error = _diagnose(path, chunk)
            if not str(error).endswith("was it written by taxbench?"):
                raise error
    raise _diagnose(streams.files[0], chunks[0])


def stream_files(run_dir: Path) -> list[Path]:
    """The run's steps.rank<R>.jsonl streams, sorted by name."""
    return sorted(run_dir.glob("steps.rank*.jsonl"))


# ------------------------------------------------------------------------------------------------- parquet cache
def _file_sha256(path: Path) -> str:
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _column_digest(digest: Any, column: pa.ChunkedArray) -> None:
    """Feed one column's values to `digest` in a form that does not depend on chunking or on null slots' bytes."""
    array = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    digest.update(array.is_null().to_numpy(zero_copy_only=False).tobytes())
    kind = array.type
    if pa.types.is_integer(kind) or pa.types.is_floating(kind):
        digest.update(np.ascontiguousarray(array.fill_null(0).to_numpy()).tobytes())
    elif pa.types.is_boolean(kind):
        digest.update(array.fill_null(False).to_numpy(zero_copy_only=False).tobytes())
    elif (pa.types.is_string(kind) or pa.types.is_large_string(kind)) and len(array):
        filled = array.fill_null("")
        width = np.int32 if pa.types.is_string(kind) else np.int64
        _, offsets_buffer, data_buffer = filled.buffers()
        offsets = np.frombuffer(offsets_buffer, dtype=width)[filled.offset: filled.offset + len(filled) + 1]
        digest.update((offsets - offsets[0]).tobytes())
        if data_buffer is not None:
            digest.update(memoryview(data_buffer)[int(offsets[0]): int(offsets[-1])])
    else:  # a nested field a newer writer added: rare and small, so the slow exact form will do
        digest.update(repr(array.to_pylist()).encode())


def table_digest(table: pa.Table) -> str:
    """SHA-256 of a table's column names, types and values: equal digests mean equal frames from to_pandas()."""
    digest = hashlib.sha256()
    digest.update(f"{table.num_rows}\n{table.schema.remove_metadata()}\n".encode())
    for column in table.columns:
        _column_digest(digest, column)
    return digest.hexdigest()


def _streams_unchanged(files: list[Path], stored: Any) -> bool:
    """Whether the streams are byte for byte the ones the cache was built from (sizes first: cheap to refuse)."""
    if not isinstance(stored, list) or [s[0] if isinstance(s, list) and s else None for s in stored] != [
            f.name for f in files]:
        return False
    try:
        if any(f.stat().st_size != s[1] for f, s in zip(files, stored, strict=True)):
            return False
        return all(_file_sha256(f) == s[2] for f, s in zip(files, stored, strict=True))
    except (OSError, IndexError):
        return False


def _read_cache(run_dir: Path, files: list[Path]) -> pd.DataFrame | None:
    """The cached frame when it provably is what the streams parse to; None (rebuild) on any doubt."""
    path = run_dir / CACHE_FILE
    try:
        key = json.loads((pq.read_schema(path).metadata or {}).get(_CACHE_KEY, b"null"))
        if not isinstance(key, dict) or key.get("format") != _CACHE_FORMAT:
            return None
        if not _streams_unchanged(files, key.get("streams")):
            return None
        table = pq.read_table(path, page_checksum_verification=True).replace_schema_metadata(None)
        if table.num_rows != key.get("rows") or table_digest(table) != key.get("table"):
            return None
        return table.to_pandas()
    except (OSError, ValueError, pa.ArrowException):  # unreadable, damaged or foreign: rebuild from the streams
        return None


def _write_cache(run_dir: Path, table: pa.Table, streams: list[list[Any]]) -> None:
    key = {"format": _CACHE_FORMAT, "streams": streams, "rows": table.num_rows, "table": table_digest(table)}
    tmp = run_dir / (CACHE_FILE + ".tmp")
    try:
        pq.write_table(table.replace_schema_metadata({_CACHE_KEY: json.dumps(key).encode()}), tmp,
                       write_page_checksum=True, compression="none")  # 15% larger, written 1.6x and read 2x faster
        tmp.replace(run_dir / CACHE_FILE)
    except OSError:
        tmp.unlink(missing_ok=True)  # a read-only results folder: analyse without caching


def load_run(run_dir: Path, cache: bool = True, empty_ok: bool = False) -> pd.DataFrame:
    """All ranks' step records of one run, sorted by (step, rank).

    A run without records is an error unless `empty_ok` (the completeness check then reports every step missing).
    """
    files = stream_files(run_dir)
    if not files:
        if empty_ok:
            return empty_run()
        raise RecordError(f"{run_dir}: no steps.rank<R>.jsonl files; is this a taxbench run directory?")
    if cache and (frame := _read_cache(run_dir, files)) is not None:
        return frame
    streams = _read_into_one_buffer(files)
    table = _read_streams(streams)
    if table is None:
        if empty_ok:
            return empty_run()
        raise RecordError(f"{run_dir}: the step record files are empty")
    # One chunk per column first: sorting a table of many parse blocks takes about 3x longer.
    table = table.combine_chunks().sort_by([("step", "ascending"), ("rank", "ascending")])
    if cache:
        _write_cache(run_dir, table, streams.key)
    return table.to_pandas()


# ------------------------------------------------------------------------------------------------------ manifest
def read_json_object(path: Path, what: str) -> dict:
    """A JSON object from `path`; a RecordError naming the path (and `what` it should be) otherwise."""
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise RecordError(f"{path}: cannot be read ({exc.strerror or exc})") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RecordError(f"{path}: not valid JSON ({exc}); the {what} is damaged") from exc
    if not isinstance(stored, dict):
        raise RecordError(f"{path}: not a JSON object; the {what} is damaged")
    return stored


def load_manifest(run_dir: Path) -> dict:
    path = run_dir / MANIFEST
    if not path.exists():
        raise RecordError(f"{path}: missing manifest; the run never started (or this is not a taxbench run folder)")
    manifest = read_json_object(path, "manifest")
    if manifest.get("schema_version") != SCHEMA_VERSION:
        raise RecordError(f"{path}: schema_version={manifest.get('schema_version')!r}, expected {SCHEMA_VERSION}")
    return manifest


def manifest_value(manifest: dict, run_dir: Path, dotted: str) -> Any:
    """manifest[a][b]... for "a.b...", or a RecordError naming the manifest and the key it lacks."""
    node: Any = manifest
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            raise RecordError(f"{run_dir / MANIFEST}: lacks {dotted}; the manifest is damaged or from another tool")
        node = node[part]
    return node


def step_times(frame: pd.DataFrame) -> pd.DataFrame:
    """Per-step time of the whole job (the slowest rank) with its block, sorted by step."""
    grouped = frame.groupby("step", sort=True).agg(time_s=("time_s", "max"), block=("block", "first"))
    return grouped.reset_index()


def step_losses(frame: pd.DataFrame) -> pd.Series:
    """Per-step loss of the whole job (the mean over ranks: data-parallel ranks each record their own batch's loss),
    indexed by step."""
    return frame.groupby("step", sort=True)["loss"].mean()


def empty_run() -> pd.DataFrame:
    """The frame of a run that recorded no step (every known column, no rows)."""
    return pa.schema(_FIELD_TYPES).empty_table().to_pandas()


# ------------------------------------------------------------------------------------------------- completeness
def compact_ranges(values: np.ndarray | list[int], limit: int = 6) -> str:
    """Sorted integers as ranges: [3, 5, 6, 7] -> "3, 5-7"; more than `limit` ranges end in "... (N ranges)"."""
    values = np.unique(np.asarray(values, dtype=np.int64))
    if values.size == 0:
        return "none"
    breaks = np.flatnonzero(np.diff(values) != 1)
    return _format_intervals(values[np.r_[0, breaks + 1]], values[np.r_[breaks, values.size - 1]], limit)


def _format_intervals(lows: np.ndarray, highs: np.ndarray, limit: int = 6) -> str:
    shown = zip(lows[:limit].tolist(), highs[:limit].tolist(), strict=True)
    parts = [str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in shown]
    more = f", ... ({len(lows)} ranges)" if len(lows) > limit else ""
    return ", ".join(parts) + more


def _ranks_text(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + compact_ranges(ranks)


def _steps_text(lows: np.ndarray, highs: np.ndarray) -> str:
    single = len(lows) == 1 and lows[0] == highs[0]
    return ("step " if single else "steps ") + _format_intervals(lows, highs)


def _grouped_by_rank(run: str, ranks: np.ndarray, lows: np.ndarray, highs: np.ndarray, what: str) -> list[str]:
    """One line per set of ranks sharing the same step intervals: "run ranks 0-3: steps 30-60 missing"."""
    by_rank: dict[int, list[tuple[int, int]]] = {}
    for rank, lo, hi in zip(ranks.tolist(), lows.tolist(), highs.tolist(), strict=True):
        by_rank.setdefault(rank, []).append((lo, hi))
    groups: dict[tuple[tuple[int, int], ...], list[int]] = {}
    for rank, intervals in by_rank.items():
        groups.setdefault(tuple(intervals), []).append(rank)
    lines = []
    for intervals, members in sorted(groups.items(), key=lambda item: min(item[1])):
        lo, hi = np.array([i[0] for i in intervals]), np.array([i[1] for i in intervals])
        lines.append(f"{run} {_ranks_text(members)}: {_steps_text(lo, hi)} {what}")
    return lines


def _runs_of_consecutive(ranks: np.ndarray, steps: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rank, first step, last step) of each run of consecutive steps; input sorted by (rank, step), unique."""
    if ranks.size == 0:
        return ranks, steps, steps
    breaks = np.flatnonzero((np.diff(ranks) != 0) | (np.diff(steps) != 1))
    starts, ends = np.r_[0, breaks + 1], np.r_[breaks, ranks.size - 1]
    return ranks[starts], steps[starts], steps[ends]


def _missing_intervals(ranks: np.ndarray, steps: np.ndarray, expected_steps: int, world: int,
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rank, first, last) of every gap in 1..expected_steps, from the present (rank, step) pairs (sorted, unique)."""
    rank_of, first, last = _runs_of_consecutive(ranks, steps)
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    if rank_of.size:
        rank_starts = np.r_[True, rank_of[1:] != rank_of[:-1]]
        rank_ends = np.r_[rank_starts[1:], True]
        head = rank_starts & (first > 1)  # before a rank's first present run
        parts.append((rank_of[head], np.ones(int(head.sum()), np.int64), first[head] - 1))
        inner = ~rank_ends  # between a run and the next run of the same rank
        parts.append((rank_of[inner], last[inner] + 1, first[1:][inner[:-1]] - 1))
        tail = rank_ends & (last < expected_steps)  # after a rank's last present run
        parts.append((rank_of[tail], last[tail] + 1, np.full(int(tail.sum()), expected_steps, np.int64)))
    silent = np.setdiff1d(np.arange(world), rank_of)  # ranks without a single record of the grid
    parts.append((silent, np.ones(silent.size, np.int64), np.full(silent.size, expected_steps, np.int64)))
    rank_out, lo_out, hi_out = (np.concatenate([part[i] for part in parts]).astype(np.int64) for i in range(3))
    order = np.lexsort((lo_out, rank_out))
    return rank_out[order], lo_out[order], hi_out[order]


def stream_ranks(run_dir: Path) -> tuple[list[int], list[str]]:
    """Ranks of the run's steps.rank<R>.jsonl files, and the names of stream-like files that name no rank."""
    ranks, odd = [], []
    for path in stream_files(run_dir):
        match = _STREAM_NAME.fullmatch(path.name)
        (ranks.append(int(match.group(1))) if match else odd.append(path.name))
    return sorted(ranks), odd


def load_checked_run(run_dir: Path, manifest: dict, steps: int) -> tuple[pd.DataFrame, list[str]]:
    """One run's records and what keeps them from covering `steps` x its manifest's ranks."""
    world = int(manifest_value(manifest, run_dir, "layout.world_size"))
    frame = load_run(run_dir, empty_ok=True)
    return frame, check_run(run_dir.name, run_dir, frame, steps, world)


def check_run(run: str, run_dir: Path, frame: pd.DataFrame, steps: int, world: int) -> list[str]:
    """What keeps `frame` from being the full grid of steps 1..steps x ranks 0..world-1, one line per finding.

    Vectorised over the records (sorting and run-length encoding), with Python only per gap, so a run of 1000
    ranks x 1000 steps is checked in well under a second.
    """
    problems = []
    file_ranks, odd = stream_ranks(run_dir)
    if odd:
        problems.append(f"{run}: {', '.join(odd)} name no rank (expected steps.rank<R>.jsonl)")
    outside = [r for r in file_ranks if r >= world]
    if outside:
        problems.append(f"{run} {_ranks_text(outside)}: {_stream_names(outside)} outside its world of {world} "
                        "ranks (manifest layout.world_size)")
    no_file = sorted(set(range(world)) - set(file_ranks))
    if no_file:
        problems.append(f"{run} {_ranks_text(no_file)}: no {_stream_names(no_file)} (all {steps} steps missing)")

    step = frame["step"].to_numpy(dtype=np.float64, na_value=np.nan)
    rank = frame["rank"].to_numpy(dtype=np.float64, na_value=np.nan)
    inside = (step >= 1) & (step <= steps) & (rank >= 0) & (rank < world)  # NaN compares False: no step, no rank
    if not inside.all():
        first = int(np.flatnonzero(~inside)[0])
        problems.append(f"{run}: {_records(int((~inside).sum()))} outside steps 1-{steps} x ranks 0-{world - 1} "
                        f"(first: step {_number(step[first])}, rank {_number(rank[first])})")
    keys = np.sort(rank[inside].astype(np.int64) * (steps + 1) + step[inside].astype(np.int64))
    repeated = np.zeros(keys.size, dtype=bool)
    repeated[1:] = keys[1:] == keys[:-1]
    unique = keys[~repeated]
    unique_rank, unique_step = unique // (steps + 1), unique % (steps + 1)
    gaps = _missing_intervals(unique_rank, unique_step, steps, world)
    keep = ~np.isin(gaps[0], no_file)  # already reported as a missing file
    problems += _grouped_by_rank(run, *(part[keep] for part in gaps), "missing")
    twice = np.unique(keys[repeated])
    problems += _grouped_by_rank(run, *_runs_of_consecutive(twice // (steps + 1), twice % (steps + 1)),
                                 "recorded more than once")
    unsigned = frame[list(METRICS)].isna().any(axis=1).to_numpy() & inside
    if unsigned.any():
        first = int(np.flatnonzero(unsigned)[0])
        problems.append(f"{run}: {_records(int(unsigned.sum()))} without a fingerprint (first: step "
                        f"{_number(step[first])}, rank {_number(rank[first])})")
    return problems


def _stream_names(ranks: list[int]) -> str:
    return f"steps.rank{ranks[0]}.jsonl" if len(ranks) == 1 else "step record files"


def _records(count: int) -> str:
    return f"{count} record" + ("" if count == 1 else "s")


def _number(value: float) -> str:
    return "none" if np.isnan(value) else str(int(value)) if value == int(value) else str(value)


# ---------------------------------------------------------------------------------------------------- fault events
@dataclass(frozen=True)
class FaultEvent:
    """An injected fault that fired (written by the trainer to faults.rank<R>.jsonl)."""

    kind: str
    step: int
    rank: int
    where: str

    def describe(self) -> str:
        return f"fault {self.kind} fired at step {self.step}, rank {self.rank} ({self.where})"


_FAULT_FIELDS = {"kind": str, "step": int, "rank": int, "where": str}


def _fault_event(record: Any, where: str) -> FaultEvent:
    if not isinstance(record, dict):
        raise RecordError(f"{where}: not a JSON object")
    if record.get("schema_version") != SCHEMA_VERSION:
        raise _version_error(Path(where.rsplit(":", 1)[0]), int(where.rsplit(":", 1)[1]), record.get("schema_version"))
    wrong = [k for k, kind in _FAULT_FIELDS.items() if not isinstance(record.get(k), kind)
             or isinstance(record.get(k), bool)]
    if wrong:
        raise RecordError(f"{where}: fault event lacks or mistypes {wrong}; the file is damaged")
    return FaultEvent(record["kind"], record["step"], record["rank"], record["where"])


def load_fault_events(run_dir: Path) -> list[FaultEvent]:
    """Every fault event of a run (faults.rank<R>.jsonl), sorted by (step, rank); a torn last line is dropped."""
    events = []
    for path in sorted(run_dir.glob("faults.rank*.jsonl")):
        if not _FAULTS_NAME.fullmatch(path.name):
            continue
        streams = _read_into_one_buffer([path])
        text = streams.buffer[: streams.end].decode("utf-8", errors="replace")
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise RecordError(f"{path}:{number}: not a JSON record ({exc.msg})") from exc
            events.append(_fault_event(record, f"{path}:{number}"))
    return sorted(events, key=lambda e: (e.step, e.rank))
