"""A rank's step stream: its JSONL records and their columnar mirror `steps.rank<R>.arrow` beside them.

The JSONL stream stays the record of truth (readable, flushed per line, a crash loses one line at most). Parsing it
is what analysis of a big run costs: 1,000 ranks x 1,000 steps is 352 MiB of JSON per run, parsed at ~200 MB/s on two
cores. So each stream also gets a mirror: the parsed records of a prefix of the stream as one Arrow IPC record batch,
read back at memory speed. It proves what it mirrors:
- its schema metadata holds how many bytes of the JSONL it mirrors and their xxh3-128 hash;
- after the IPC stream's end it holds the xxh3-128 of all its own bytes before it.
A reader uses a mirror only for the bytes it provably mirrors: it hashes that prefix of the JSONL (xxh3 runs at
memory speed, ~13 GB/s here) and the mirror itself; on any doubt (no mirror, a stale, torn, damaged or foreign one)
those bytes are parsed from the JSONL instead. A mirror's rows are what `parse_records` made of those very bytes, so a
mirrored record and a parsed one are the same values.

The trainer refreshes its rank's mirror when it closes the stream; analysis writes one for any stream whose mirror
does not cover it (older runs, a crash before close). Mirrors are replaced atomically and verified on every read, so a
writer and an analysis racing on one can only cost a re-parse, never change a frame.

A run's mirror `steps.arrow` holds every stream's mirrored rows, as the reader concatenates them, in record batches of
RUN_BATCH_ROWS rows (taxbench.rundir.read.load_run writes it, so the analysis a launch ends with leaves one). It names
each stream with the length and xxh3-128 of the complete lines it holds the rows of, and is used only when the run's
streams are exactly those, each hashing to its digest with no complete line after it: then it is the very table the
streams would give. Read batch by batch into memory of its own, through the hash, it saves the reader 1,000 small
mirrors and the copy that joins them, and a reader that keeps a few fields of each batch never holds the whole run.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.json as pa_json
import xxhash

from taxbench.diagnostics import logger
from taxbench.rundir import step_record as record
from taxbench.rundir.evidence import check_regular, experiment_of, open_regular
from taxbench.rundir.records import METRICS, JsonlWriter

log = logger(__name__)

MIRROR_FORMAT = 1
RUN_MIRROR = "steps.arrow"  # a run's mirror of all its streams (their names are steps.rank<R>.jsonl)
_METADATA_KEY = b"taxbench.mirror"
_DIGEST_BYTES = 16  # xxh3-128
_CHUNK = 1 << 20  # JSONL prefixes are hashed through one reused buffer of this size (it stays in cache)
RUN_BATCH_ROWS = 1 << 16  # rows per record batch of a run's mirror: ~17 MiB of a 1,000-rank run's 265 MiB

# Types of the known fields; fields a newer writer adds are inferred. Fixing these keeps a column that is null in one
# stream (device_s on CPU) and a number in another from failing to concatenate. Strings are large_string, what pandas'
# string dtype holds: anything else is cast (copied) on every to_pandas.
STEP_FIELDS: dict[str, pa.DataType] = {
    record.SCHEMA_VERSION_FIELD: pa.int64(),
    record.ARM: pa.large_string(),
    record.REPLICA: pa.large_string(),
    record.RANK: pa.int64(),
    record.STEP: pa.int64(),
    record.BLOCK: pa.int64(),
    record.DATA_S: pa.float64(),
    record.TOKENS: pa.int64(),
    record.TIME_S: pa.float64(),
    record.WINDOW_S: pa.float64(),
    record.FINGERPRINT_S: pa.float64(),
    record.DEVICE_S: pa.float64(),
    record.PLANTED_S: pa.float64(),
    record.MEM_PEAK_BYTES: pa.int64(),
    record.MEM_RESERVED_BYTES: pa.int64(),
    record.LOSS: pa.float64(),
    record.GRAD_NORM: pa.float64(),
    **{metric: pa.large_string() for metric in METRICS},
}
STEP_SCHEMA = pa.schema(STEP_FIELDS)
_PARSE = pa_json.ParseOptions(explicit_schema=STEP_SCHEMA, unexpected_field_behavior="infer")
_READ = pa_json.ReadOptions(block_size=4 << 20)  # blocks are parsed in parallel; 4 MiB measured best here


def parse_records(data: pa.Buffer | bytes | bytearray | memoryview) -> pa.Table:
    """JSON lines -> a table with STEP_FIELDS' types (raises pyarrow.ArrowInvalid on anything else)."""
    buffer = data if isinstance(data, pa.Buffer) else pa.py_buffer(data)
    return pa_json.read_json(pa.BufferReader(buffer), read_options=_READ, parse_options=_PARSE)


def mirror_file(stream: Path) -> Path:
    return stream.with_suffix(".arrow")


@dataclass
class StreamRead:
    """One JSONL stream as a reader sees it: the verified mirrored rows and the complete lines after them."""

    path: Path
    mirrored: pa.Table | None  # rows of the JSONL's first `covered` bytes (None: no usable mirror)
    covered: int
    rest: bytes  # the stream's complete lines after `covered` (a torn final line of a crashed writer is dropped)
    complete: int  # bytes of complete lines in the stream: covered + len(rest)
    digest: bytes  # xxh3-128 of the stream's first `complete` bytes

    @property
    def mirror_current(self) -> bool:
        """Whether the mirror covers every complete line (nothing to parse, nothing to refresh)."""
        return self.mirrored is not None and self.covered == self.complete


def read_stream(stream: Path, use_mirror: bool = True) -> StreamRead:
    """Read `stream`, through its mirror as far as the mirror provably matches the stream's bytes (OSError if the
    stream cannot be read, taxbench.rundir.evidence.NotEvidence if it is no regular file inside its experiment; an
    unusable mirror is no error)."""
    inside = experiment_of(stream.parent)
    fd = open_regular(stream, inside)  # before the mirror: a FIFO or device is refused without reading anything
    mirror = _read_mirror(mirror_file(stream), inside) if use_mirror else None
    with os.fdopen(fd, "rb", buffering=0) as handle:
        if mirror is not None and mirror[1] <= os.fstat(handle.fileno()).st_size:
            table, covered, expected = mirror
            hasher = _hash_prefix(handle, covered)
            if hasher is not None and hasher.digest() == expected:
                return _with_rest(stream, handle, table, covered, hasher)
            handle.seek(0)
        return _with_rest(stream, handle, None, 0, xxhash.xxh3_128())


_buffers = threading.local()


def _hash_prefix(handle, length: int) -> xxhash.xxh3_128 | None:  # noqa: ANN001 (a raw binary file)
    """xxh3-128 of the next `length` bytes, read through one buffer per thread (it stays in cache, and a fresh one
    per stream costs more in page faults than the hashing); None when the file ends first."""
    if getattr(_buffers, "view", None) is None:
        _buffers.view = memoryview(bytearray(_CHUNK))
    view = _buffers.view
    hasher = xxhash.xxh3_128()
    left = length
    while left:
        n = handle.readinto(view[: min(left, _CHUNK)])
        if not n:
            return None
        hasher.update(view[:n])
        left -= n
    return hasher


def _with_rest(stream: Path, handle, table: pa.Table | None, covered: int,  # noqa: ANN001
               hasher: xxhash.xxh3_128) -> StreamRead:
    rest = handle.read()
    complete = rest.rfind(b"\n") + 1  # a final line without its newline is a torn write: not a record yet
    rest = rest[:complete] if complete != len(rest) else rest
    hasher.update(rest)
    return StreamRead(stream, table, covered, rest, covered + len(rest), hasher.digest())


def _read_mirror(path: Path, inside: Path) -> tuple[pa.Table, int, bytes] | None:
    """(rows, JSONL bytes mirrored, their xxh3-128) of an intact mirror of this format; None for anything else (also
    for a mirror that is no regular file inside the experiment `inside`: a FIFO there is never opened).

    The rows are a view of the memory-mapped file (page-cache pages, no copy): callers copy what they keep, so that
    no frame changes under its reader when someone rewrites the file in place.
    """
    read = _read_hashed(path, inside)
    if read is None:
        return None
    table, key = read
    try:
        covered, digest = int(key["jsonl_bytes"]), bytes.fromhex(key["jsonl_xxh3"])
    except (KeyError, TypeError, ValueError):
        return None
    return (table, covered, digest) if covered >= 0 else None


def _read_hashed(path: Path, inside: Path) -> tuple[pa.Table, dict] | None:
    """(rows, metadata key) of an intact IPC file of this mirror format (its trailing xxh3-128 checked), the rows a
    view of the memory-mapped file; None for anything else."""
    try:
        check_regular(path, inside)
        with pa.memory_map(str(path)) as source:
            data = source.read_buffer()
    except (OSError, pa.ArrowException):
        return None
    if data.size <= _DIGEST_BYTES:
        return None
    body = data.slice(0, data.size - _DIGEST_BYTES)
    if xxhash.xxh3_128_digest(body) != data.slice(data.size - _DIGEST_BYTES).to_pybytes():
        return None
    try:
        table = ipc.open_stream(body).read_all()
        key = json.loads((table.schema.metadata or {})[_METADATA_KEY])
    except (pa.ArrowException, KeyError, TypeError, ValueError):
        return None
    if not isinstance(key, dict) or key.get("format") != MIRROR_FORMAT:
        return None
    return table.replace_schema_metadata(None), key


def write_mirror(stream: Path, table: pa.Table, covered: int, digest: bytes) -> None:
    """Mirror `table` (the records of the stream's first `covered` bytes, whose xxh3-128 is `digest`) atomically.

    Not fsynced: a mirror lost or torn by a power cut fails its own hash and the JSONL is parsed instead.
    """
    _write_hashed(mirror_file(stream), table.combine_chunks(),
                  {"format": MIRROR_FORMAT, "jsonl_bytes": covered, "jsonl_xxh3": digest.hex()})


class _HashingSink:
    """A binary file that hashes (xxh3-128) what is written through it: the IPC writer's sink."""

    closed = False

    def __init__(self, handle) -> None:  # noqa: ANN001 (a binary file)
        self.handle, self.hasher = handle, xxhash.xxh3_128()

    def write(self, data) -> int:  # noqa: ANN001 (a buffer)
        self.hasher.update(data)
        return self.handle.write(data)

    def flush(self) -> None:
        self.handle.flush()


def _write_hashed(path: Path, table: pa.Table, key: dict, batch_rows: int | None = None) -> None:
    """`table` as an IPC stream carrying `key` (in record batches of at most `batch_rows` rows; None: as chunked),
    then the xxh3-128 of those bytes; replaced atomically, streamed to the file (a run's mirror is hundreds of MiB:
    never a second copy in memory)."""
    table = table.replace_schema_metadata({_METADATA_KEY: json.dumps(key).encode()})
    # A name of this process and thread (writer and analysis may race on one mirror); created with the umask's mode,
    # as the JSONL beside it (NamedTemporaryFile would make it readable by its owner only).
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666), "wb") as handle:
            sink = _HashingSink(handle)
            with ipc.new_stream(sink, table.schema) as writer:
                writer.write_table(table, max_chunksize=batch_rows)
            handle.write(sink.hasher.digest())
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


# ------------------------------------------------------------------------------------------------ a run's mirror
@dataclass(frozen=True)
class Covered:
    """What a run's mirror holds of one stream: the rows of its first `length` bytes (its complete lines), whose
    xxh3-128 is `digest`."""

    name: str
    length: int
    digest: bytes


def run_mirror_file(run_dir: Path) -> Path:
    return run_dir / RUN_MIRROR


def write_run_mirror(run_dir: Path, table: pa.Table, streams: list[Covered]) -> None:
    """Mirror a run: `table` is the concatenation, in this order, of the rows of each of `streams` (record batches of
    RUN_BATCH_ROWS rows)."""
    key = {"format": MIRROR_FORMAT, "streams": [[c.name, c.length, c.digest.hex()] for c in streams]}
    _write_hashed(run_mirror_file(run_dir), table, key, RUN_BATCH_ROWS)


def read_run_mirror(run_dir: Path, keep: Callable[[pa.RecordBatch], pa.Table] | None = None,
                    ) -> tuple[pa.Table, list[Covered]] | None:
    """(rows, what they cover of each stream) of the run's intact mirror, in memory of its own; None for none or an
    unusable one. Whether the streams still hold those bytes is the caller's to check (`covers`).

    Read one record batch at a time through the hash: with `keep`, the rows are what `keep` makes of each batch (say,
    a few of its columns, copied), so the reader holds one batch of the run at a time besides them. Nothing `keep`
    returns is used before the mirror's own hash proves every byte it was made of."""
    path = run_mirror_file(run_dir)
    try:
        handle = os.fdopen(open_regular(path, experiment_of(run_dir)), "rb", buffering=0)
    except OSError:
        return None
    with handle:
        source = _HashingSource(handle)
        try:
            reader = ipc.open_stream(source)
            key = json.loads((reader.schema.metadata or {})[_METADATA_KEY])
            parts = [keep(batch) if keep else pa.Table.from_batches([batch]) for batch in reader]
            proven = source.rest_is_digest()
        except (OSError, pa.ArrowException, KeyError, TypeError, ValueError):
            return None
    if not proven or not isinstance(key, dict) or key.get("format") != MIRROR_FORMAT:
        return None
    try:
        streams = [Covered(str(name), int(length), bytes.fromhex(digest)) for name, length, digest in key["streams"]]
        table = pa.concat_tables(parts) if parts else reader.schema.empty_table()
    except (KeyError, TypeError, ValueError, pa.ArrowException):
        return None
    return table.replace_schema_metadata(None), streams


class _HashingSource:
    """A binary file that hashes (xxh3-128) what is read through it: the IPC reader's source. A mirror's bytes end
    in the xxh3-128 of all bytes before them; `rest_is_digest` checks that once the reader is done."""

    closed = False

    def __init__(self, handle) -> None:  # noqa: ANN001 (a raw binary file)
        self.handle, self.hasher = handle, xxhash.xxh3_128()

    def read(self, size: int = -1) -> bytes:
        data = self.handle.readall() if size is None or size < 0 else _read_exactly(self.handle, size)
        self.hasher.update(data)
        return data

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def rest_is_digest(self) -> bool:
        """Whether the bytes after those read so far are the hash of all bytes before the last 16, then that hash."""
        rest = self.handle.readall()
        if len(rest) < _DIGEST_BYTES:
            return False
        self.hasher.update(rest[:-_DIGEST_BYTES])
        return self.hasher.digest() == rest[-_DIGEST_BYTES:]


def _read_exactly(handle, size: int) -> bytes:  # noqa: ANN001 (a raw binary file)
    """`size` bytes, or fewer where the file ends first (a raw read may return less than asked)."""
    parts, left = [], size
    while left:
        data = handle.read(left)
        if not data:
            break
        parts.append(data)
        left -= len(data)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def covers(stream: Path, covered: Covered) -> bool:
    """Whether `covered` is exactly the stream's complete lines: its first `length` bytes hash to `digest` and no
    complete line follows them (a torn last line is no record, as in read_stream). False, never an error, for a
    stream that cannot be read: the per-stream reader names what is wrong with it."""
    try:
        fd = open_regular(stream, experiment_of(stream.parent))
    except OSError:
        return False
    with os.fdopen(fd, "rb", buffering=0) as handle:
        try:
            if os.fstat(handle.fileno()).st_size < covered.length:
                return False
            hasher = _hash_prefix(handle, covered.length)
            return hasher is not None and hasher.digest() == covered.digest and b"\n" not in handle.read()
        except OSError:
            return False


def records_of(read: StreamRead) -> pa.Table:
    """Every complete record of the stream: the mirrored rows, then the rest parsed (pyarrow.ArrowInvalid or
    ArrowTypeError when the rest is no JSON records of compatible types)."""
    parts = [t for t in (read.mirrored, parse_records(read.rest) if read.rest.strip() else None) if t is not None]
    return pa.concat_tables(parts, promote_options="default") if parts else STEP_SCHEMA.empty_table()


def refresh_mirror(stream: Path) -> None:
    """Bring the stream's mirror up to date with every complete line (what a writer does when it closes).

    Raises OSError when a file cannot be read or written, and what records_of raises when the JSONL does not parse.
    """
    read = read_stream(stream)
    if not read.mirror_current:
        write_mirror(stream, records_of(read), read.complete, read.digest)


class StepWriter(JsonlWriter):
    """A rank's step records: a JSONL stream whose mirror is brought up to date when the stream is closed."""

    def close(self) -> None:
        if self.closed:
            return
        super().close()
        try:
            refresh_mirror(self.path)
        except (OSError, pa.ArrowException) as exc:  # analysis parses the JSONL instead (and reports what is wrong)
            log.warning("%s: no columnar mirror written (%s); analysis will parse the JSONL", self.path, exc)
