"""Load step records of run directories into pandas, rejecting other schema versions, and check them for gaps.

A run is read through its run mirror (taxbench.rundir.step_stream: every stream's rows in one Arrow IPC file) when it
provably covers the run's streams, byte for byte. Otherwise each rank's stream is read through its own columnar
mirror (used only as far as it provably matches the JSONL's bytes), and whatever the mirror does not cover is parsed
by pyarrow's JSON reader (a thousand times fewer Python calls than `json.loads` per line); a parse problem falls back
to a line-by-line reader only to name the offending line. Reading writes nothing: writing mirrors is a step the
caller asks for (`leave_mirrors`, or load_run(leave_mirrors=True)), which gives a stream whose mirror is missing or
behind a new one, and the run a new run mirror, so the next analysis reads columnar data. An edited, added or removed
stream, a stale or foreign mirror, or a flipped byte anywhere in a mirror means the per-stream path or parsing the
JSONL, never a different frame. mtimes play no part: a copy (cp, rsync without -t) keeps its mirrors.

`check_run` checks a loaded run against its manifest: every rank of the world, every step 1..steps, nothing twice,
nothing outside that grid. `identity_problems` and `config_problems` check that the evidence is its run's: the
manifest and every record name the folder they lie in, the manifest's config is the one its config_sha256 was taken
of and the experiment's, its policy the config's for its arm. All findings make an experiment "incomplete"
(taxbench.analysis.experiment). They catch evidence moved or mixed up between runs and edits that forget a field, not a
careful forgery of every field (the config hash is a plain sha256 anyone can recompute).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from taxbench.config.pairing import differences, experiment_differences
from taxbench.config.schema import load_config
from taxbench.design import knob_of, knob_policies, plan_ablation
from taxbench.redaction import redact
from taxbench.rundir.evidence import experiment_of, read_regular
from taxbench.rundir.hex_columns import pack_column
from taxbench.rundir.json_object import RecordError, UnreadableRecords
from taxbench.rundir.provenance import config_hash
from taxbench.rundir.records import MANIFEST, METRICS, SCHEMA_VERSION
from taxbench.rundir.run_manifest import Manifest
from taxbench.rundir.step_record import STEP
from taxbench.rundir.step_stream import (
    STEP_SCHEMA,
    Covered,
    covers,
    mirror_file,
    read_run_mirror,
    read_stream,
    records_of,
    run_mirror_file,
    write_mirror,
    write_run_mirror,
)
from taxbench.rundir.write_scope import may_write

_STREAM_NAME = re.compile(r"steps\.rank(\d+)\.jsonl")
_FAULTS_NAME = re.compile(r"faults\.rank(\d+)\.jsonl")
_READERS = 2  # streams read, hashed and parsed side by side (file reads, xxh3 and pyarrow release the GIL)


# ------------------------------------------------------------------------------------------------ reading streams
def _version_error(path: Path, number: int, version: object) -> RecordError:
    return RecordError(
        f"{path}:{number}: schema_version={version!r}, this taxbench reads {SCHEMA_VERSION}; analyse it with "
        "the taxbench version that wrote it"
    )


def _diagnose(path: Path) -> RecordError:
    """The precise complaint about a stream the fast reader refused (slow, only on the error path)."""
    try:
        data = read_regular(path, experiment_of(path.parent))
    except OSError as exc:
        return UnreadableRecords(f"{path}: cannot be read ({exc.strerror or exc})")
    for number, line in enumerate(data[: data.rfind(b"\n") + 1].decode("utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            return UnreadableRecords(f"{path}:{number}: not a JSON record ({exc.msg})")
        if not isinstance(record, dict):
            return UnreadableRecords(f"{path}:{number}: not a JSON object")
        if record.get("schema_version") != SCHEMA_VERSION:
            return _version_error(path, number, record.get("schema_version"))
    return UnreadableRecords(f"{path}: records have inconsistent field types; was it written by taxbench?")


def _first_complaint(files: list[Path]) -> RecordError:
    """The first stream's precise complaint; the generic one when no single stream is wrong by itself."""
    errors = [_diagnose(f) for f in files]
    return next((e for e in errors if not str(e).endswith("was it written by taxbench?")), errors[0])


def _version_ok(table: pa.Table) -> bool:
    versions = table.column("schema_version")
    return versions.null_count == 0 and bool((versions.to_numpy() == SCHEMA_VERSION).all())


def _stream_records(path: Path, use_mirror: bool, leave_mirror: bool) -> tuple[pa.Table, Covered]:
    """One stream's records and the bytes they are the rows of: its verified mirror, then its JSONL lines after what
    the mirror covers, parsed; with `leave_mirror` a mirror that does not cover every complete line is (re)written
    for the next reader."""
    try:
        read = read_stream(path, use_mirror)
    except OSError as exc:  # also taxbench.rundir.evidence.NotEvidence: a FIFO, a device, a symlink leaving it
        raise UnreadableRecords(f"{path}: cannot be read ({exc.strerror or exc})") from exc
    try:
        table = records_of(read)
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        raise _diagnose(path) from None
    if leave_mirror and not read.mirror_current:
        _leave(mirror_file(path), lambda: write_mirror(path, table, read.complete, read.digest))
    return table, Covered(path.name, read.complete, read.digest)


def _leave(mirror: Path, write: Callable[[], None]) -> None:
    """Write a mirror for the next reader, unless in a folder a live launch holds (taxbench.rundir.write_scope) or
    a read-only results folder: analysis then goes on without leaving it."""
    try:
        if may_write(mirror):
            write()
    except OSError:
        pass


def _concat(where: Path, tables: list[pa.Table]) -> pa.Table:
    try:
        return pa.concat_tables(tables, promote_options="default")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise UnreadableRecords(f"{where}: records have inconsistent field types ({exc}); was it written by "
                                "taxbench?") from exc


def stream_files(run_dir: Path) -> list[Path]:
    """The run's steps.rank<R>.jsonl streams in rank order (names that carry no rank last, by name)."""
    def rank_first(path: Path) -> tuple[int, int, str]:
        match = _STREAM_NAME.fullmatch(path.name)
        return (0, int(match.group(1)), "") if match else (1, 0, path.name)

    return sorted(run_dir.glob("steps.rank*.jsonl"), key=rank_first)


def load_run(run_dir: Path, use_mirrors: bool = True, empty_ok: bool = False,
             fields: Collection[str] | None = None, leave_mirrors: bool = False) -> pd.DataFrame:
    """All ranks' step records of one run, sorted by (rank, step).

    Rank-major because that is how the records lie (a stream per rank, in step order): the frame of 1,000 ranks x
    1,000 steps needs no gather. The run is read through its run mirror when that provably covers every stream, else
    each stream through its own mirror as far as that provably matches it (taxbench.rundir.step_stream);
    `use_mirrors=False` parses every JSONL line instead. Either way the frame is the same. Reading writes nothing
    unless the caller asks for it: `leave_mirrors` (re)writes every mirror that is missing or behind, and the run
    mirror, for the next reader (not in a folder a live launch holds: taxbench.rundir.write_scope). A run without
    records is an error unless `empty_ok` (the completeness check then reports every step missing).

    `fields`: only those record fields (as far as the run has them), the fingerprints among them packed
    (taxbench.rundir.hex_columns): what an analysis keeps of a big run. The run mirror is then cut to them batch by
    batch as it is read, so the whole run is never in memory at once.
    """
    files = stream_files(run_dir)
    if not files:
        if empty_ok:
            return empty_run() if fields is None else _kept(empty_run(), fields)
        raise RecordError(f"{run_dir}: no steps.rank<R>.jsonl files; is this a taxbench run directory?")
    keep = None if fields is None else partial(_kept_batch, fields={*fields, "schema_version", "step", "rank"})
    table = _run_mirrored(run_dir, files, keep) if use_mirrors else None
    if table is None:
        table = _streams_read(run_dir, files, use_mirrors, use_mirrors and leave_mirrors)
        if keep is not None:
            table = keep(table)
    if not table.num_rows:
        if empty_ok:
            return empty_run() if fields is None else _kept(empty_run(), fields)
        raise UnreadableRecords(f"{run_dir}: the step record files are empty")
    if not _version_ok(table):  # a mirror written by another taxbench version
        raise _first_complaint(files)
    table = _sorted_by_rank_and_step(table)
    if fields is not None:
        table = table.select([name for name in table.column_names if name in fields])
    # split_blocks keeps numeric columns zero-copy instead of consolidating them into 2-D blocks (5x faster here);
    # self_destruct lets each column's Arrow memory go once converted (the table is not used after).
    frame = table.to_pandas(split_blocks=True, self_destruct=True)
    if fields is not None:  # the batches' memory back to the system, not kept in the pool: 80 MB at 5 runs' peak
        pa.default_memory_pool().release_unused()
    return frame


def _kept_batch(part: pa.RecordBatch | pa.Table, fields: Collection[str]) -> pa.Table:
    """`fields` of a batch (or table) of records, in memory of their own, fingerprints packed where lossless. Batches
    whose fingerprints pack differently do not concatenate: the run mirror is then passed over, and the whole run
    packed at once."""
    table = pa.Table.from_batches([part]) if isinstance(part, pa.RecordBatch) else part
    columns = {}
    for name in (name for name in table.column_names if name in fields):
        column = table.column(name)
        packed = pack_column(column) if name in METRICS else column
        # else a copy: the batch's columns share its buffers, and the ones not kept go with it
        columns[name] = packed if packed is not column else pa.chunked_array(
            [pa.concat_arrays([chunk]) for chunk in column.chunks], column.type)
    return pa.table(columns)


def _kept(frame: pd.DataFrame, fields: Collection[str]) -> pd.DataFrame:
    """An empty run's frame, cut to `fields`."""
    return frame[[name for name in frame.columns if name in fields]]


def _halves(files: list[Path]) -> list[list[Path]]:
    """The streams in one task per reader: 1,000 tasks cost 0.1 s."""
    return [files[: len(files) // 2], files[len(files) // 2:]]


def _run_mirrored(run_dir: Path, files: list[Path],
                  keep: Callable[[pa.RecordBatch], pa.Table] | None = None) -> pa.Table | None:
    """The run's rows from its run mirror (what `keep` makes of each batch) when it covers exactly `files`, each to
    its last complete line; None otherwise (no run mirror, a damaged or stale one, a stream edited, added or
    removed)."""
    mirror = read_run_mirror(run_dir, keep)
    if mirror is None:
        return None
    table, covered = mirror
    if [c.name for c in covered] != [f.name for f in files]:
        return None
    by_name = dict(zip((f.name for f in files), covered, strict=True))
    with ThreadPoolExecutor(_READERS) as pool:
        proven = all(pool.map(lambda part: all(covers(f, by_name[f.name]) for f in part), _halves(files)))
    return table if proven else None


def _streams_read(run_dir: Path, files: list[Path], use_mirrors: bool, leave_mirrors: bool) -> pa.Table:
    """The run's rows stream by stream (each through its own mirror as far as it goes), in memory of their own; with
    `leave_mirrors` the streams' mirrors and a run mirror of them are left for the next reader."""
    with ThreadPoolExecutor(_READERS) as pool:
        reads = [r for part in pool.map(lambda part: _records_of(part, use_mirrors, leave_mirrors), _halves(files))
                 for r in part]
    table = _copied(_concat(run_dir, [t for t, _ in reads]))
    if leave_mirrors and table.num_rows and _version_ok(table):
        _leave(run_mirror_file(run_dir), lambda: write_run_mirror(run_dir, table, [c for _, c in reads]))
    return table


def _copied(table: pa.Table) -> pa.Table:
    """The table in one chunk per column, in memory of its own: mirrors are memory-mapped files, and a frame must
    not change under its reader when someone rewrites one in place (combine_chunks keeps a lone chunk as it is)."""
    columns = [pa.concat_arrays(column.chunks) if column.num_chunks else column for column in table.columns]
    return pa.Table.from_arrays(columns, schema=table.schema)


def _records_of(files: list[Path], use_mirrors: bool, leave_mirrors: bool) -> list[tuple[pa.Table, Covered]]:
    return [_stream_records(path, use_mirrors, leave_mirrors) for path in files]


def leave_mirrors(root: Path) -> None:
    """The step of its own that writes Arrow mirrors: for every run folder at or below `root` (an experiment, a sweep,
    a layouts or stacks folder), the mirrors of its streams and the run mirror, where missing or behind, so that the
    analysis that follows, and every later one, reads columnar data. Nothing in a folder a live launch holds
    (taxbench.rundir.write_scope); a run that cannot be read is left to the analysis to report."""
    for run_dir in sorted({stream.parent for stream in root.rglob("steps.rank*.jsonl")}):
        try:
            load_run(run_dir, empty_ok=True, fields=(STEP,), leave_mirrors=True)
        except RecordError:
            continue


def _sorted_by_rank_and_step(table: pa.Table) -> pa.Table:
    """The table in (rank, step) order, stable: as it is when every stream holds its own rank in step order."""
    step, rank = table.column("step"), table.column("rank")
    if step.null_count or rank.null_count:  # records without a step or rank (check_run names them): last
        return table.sort_by([("rank", "ascending"), ("step", "ascending")])
    steps, ranks = step.to_numpy(), rank.to_numpy()
    in_order = (ranks[1:] > ranks[:-1]) | ((ranks[1:] == ranks[:-1]) & (steps[1:] >= steps[:-1]))
    return table if in_order.all() else table.take(np.lexsort((steps, ranks)))


# ------------------------------------------------------------------------------------------------------ manifest
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
    return STEP_SCHEMA.empty_table().to_pandas()


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


# The record fields the checks of load_checked_run read: identity, then the grid and its fingerprints.
CHECKED_FIELDS = ("arm", "replica", "step", "rank", *METRICS)


def load_checked_run(run_dir: Path, manifest: Manifest, steps: int, config: dict[str, Any],
                     fields: Collection[str] | None = None) -> tuple[pd.DataFrame, list[str]]:
    """One run's records and what keeps them from covering `steps` x its manifest's ranks, or from being this run's
    own: a manifest or records of another run copied into its folder, a config edited or not the experiment's
    (`config`). `fields`: the frame holds only those, as load_run(fields=...) gives them (the checks read theirs
    first)."""
    world = manifest.world_size
    frame = load_run(run_dir, empty_ok=True, fields=None if fields is None else {*fields, *CHECKED_FIELDS})
    problems = (identity_problems(run_dir, manifest, frame) + config_problems(run_dir, manifest, config)
                + check_run(run_dir.name, run_dir, frame, steps, world))
    if fields is not None:
        frame = frame.drop(columns=[name for name in frame.columns if name not in fields])
    return frame, problems


def config_problems(run_dir: Path, manifest: Manifest, config: dict[str, Any]) -> list[str]:
    """What says the manifest's config is not this experiment's: a config that is not the one its config_sha256 was
    taken of (edited after the run), one that differs from the experiment's `config` in anything a continue may not
    change, a policy that is not the config's for the run's arm."""
    where = run_dir / MANIFEST
    own, stored = manifest.config, manifest.config_sha256
    if not isinstance(own, dict) or not isinstance(stored, str):
        return [f"{where}: lacks its config or provenance.config_sha256; the manifest is damaged or edited"]
    problems = []
    if config_hash(own) != stored:
        problems.append(f"{where}: config_sha256 {stored[:12]}... is not the hash of its config "
                        f"({config_hash(own)[:12]}...): the config was edited after the run")
    changed = experiment_differences(own, config)
    if changed:
        problems.append(f"{where}: config differs from the experiment's: {_changed_text(changed)}")
    arm = manifest.arm
    try:
        policy = arm_policy(config, arm)
    except (KeyError, TypeError, ValueError) as exc:
        return [*problems, f"{where}: the experiment's config gives arm {arm} no policy to check it against "
                           f"({type(exc).__name__}: {exc})"]
    if policy is not None and differences(manifest.policy, policy):
        problems.append(f"{where}: policy is not the one the config gives arm {arm}: "
                        f"{_changed_text(differences(manifest.policy, policy))}")
    return problems


def arm_policy(config: dict[str, Any], arm: Any) -> dict[str, Any] | None:
    """The policy `config` gives `arm`, as a manifest records it: arms.<arm>, or a knob arm's (taxbench.design: the
    pair's policy with one knob switched); None for an arm the config does not name (the folder names are checked
    elsewhere)."""
    arms = config.get("arms") or {}
    if not isinstance(arm, str) or (arm not in arms and knob_of(arm) is None):
        return None
    if arm in arms:
        return arms[arm]
    typed = load_config(config)  # a knob arm's policy, whether or not the config still asks for the ablation
    policies = knob_policies(plan_ablation(typed.arms, typed.cluster.device))
    return dataclasses.asdict(policies[arm]) if arm in policies else None


def _changed_text(changed: list[tuple[str, Any, Any]], limit: int = 3) -> str:
    """The differing settings, values redacted (a manifest of an older taxbench may hold secrets)."""
    shown = "; ".join(f"{key} {redact(a)!r} here, {redact(b)!r} in the experiment" for key, a, b in changed[:limit])
    return shown + (f"; ... ({len(changed)} settings)" if len(changed) > limit else "")


def identity_problems(run_dir: Path, manifest: Manifest, frame: pd.DataFrame) -> list[str]:
    """Whether the manifest and every record name the run whose folder they sit in, one line per finding."""
    run = run_dir.name
    named = {"run": str(manifest.run), "arm": str(manifest.arm), "replica": str(manifest.replica)}
    if named["run"] != run or f"{named['arm']}-{named['replica']}" != run:
        return [f"{run_dir / 'manifest.json'}: describes run {named['run']} (arm {named['arm']}, replica "
                f"{named['replica']}), not {run}; was it copied from another run?"]
    if frame.empty:
        return []
    if "arm" not in frame or "replica" not in frame:
        return [f"{run_dir}: step records that name no arm and replica; was it written by taxbench?"]
    foreign = ((frame["arm"].astype(str) != named["arm"]) | (frame["replica"].astype(str) != named["replica"]))
    foreign = foreign.to_numpy()
    if not foreign.any():
        return []
    first = int(np.flatnonzero(foreign)[0])
    rank, step = frame["rank"].iloc[first], frame["step"].iloc[first]
    other = f"{frame['arm'].iloc[first]}-{frame['replica'].iloc[first]}"
    return [f"{run_dir / f'steps.rank{_number(rank)}.jsonl'}: {_records(int(foreign.sum()))} of run {other}, not "
            f"{run} (first: step {_number(step)}, rank {_number(rank)}); copied from another run?"]


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
    keys = rank[inside].astype(np.int64) * (steps + 1) + step[inside].astype(np.int64)
    if not (keys[1:] >= keys[:-1]).all():  # load_run's frames are in (rank, step) order: no sort needed
        keys = np.sort(keys)
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
        raise UnreadableRecords(f"{where}: not a JSON object")
    if record.get("schema_version") != SCHEMA_VERSION:
        raise _version_error(Path(where.rsplit(":", 1)[0]), int(where.rsplit(":", 1)[1]), record.get("schema_version"))
    wrong = [k for k, kind in _FAULT_FIELDS.items() if not isinstance(record.get(k), kind)
             or isinstance(record.get(k), bool)]
    if wrong:
        raise UnreadableRecords(f"{where}: fault event lacks or mistypes {wrong}; the file is damaged")
    return FaultEvent(record["kind"], record["step"], record["rank"], record["where"])


def load_fault_events(run_dir: Path) -> list[FaultEvent]:
    """Every fault event of a run (faults.rank<R>.jsonl), sorted by (step, rank); a torn last line is dropped."""
    events = []
    for path in sorted(run_dir.glob("faults.rank*.jsonl")):
        if not _FAULTS_NAME.fullmatch(path.name):
            continue
        try:
            data = read_regular(path, experiment_of(run_dir))
        except OSError as exc:
            raise UnreadableRecords(f"{path}: cannot be read ({exc.strerror or exc})") from exc
        text = data[: data.rfind(b"\n") + 1].decode("utf-8", errors="replace")  # a torn last line is dropped
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UnreadableRecords(f"{path}:{number}: not a JSON record ({exc.msg})") from exc
            events.append(_fault_event(record, f"{path}:{number}"))
    return sorted(events, key=lambda e: (e.step, e.rank))
