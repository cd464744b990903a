"""Step streams and their columnar mirrors: written on close, trusted only as far as they provably match the JSONL."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pytest

from taxbench.rundir.read import load_run, stream_files
from taxbench.rundir.records import SCHEMA_VERSION, steps_file
from taxbench.rundir.step_stream import (
    StepWriter,
    covers,
    mirror_file,
    parse_records,
    read_run_mirror,
    read_stream,
    refresh_mirror,
    run_mirror_file,
    write_mirror,
)


def _record(step: int, rank: int = 0) -> dict:
    return {"arm": "baseline", "replica": "0", "rank": rank, "step": step, "time_s": 0.1 + step / 7, "loss": 1 / step,
            "device_s": None, "params": f"{step * 7919:016x}"}


def _written(run: Path, steps: range, rank: int = 0, close: bool = True) -> Path:
    writer = StepWriter(steps_file(run, rank))
    for step in steps:
        writer.write(_record(step, rank))
    if close:
        writer.close()
    else:
        writer.sync()  # a crash after the block's fsync: no close, so no mirror refresh
    return writer.path


def test_closing_a_stream_mirrors_every_line_exactly(tmp_path: Path) -> None:
    stream = _written(tmp_path, range(1, 6))
    read = read_stream(stream)
    assert read.mirror_current and read.rest == b"" and read.covered == stream.stat().st_size
    assert read.mirrored.equals(parse_records(stream.read_bytes()))  # the same parser made both
    assert read.mirrored.column("schema_version").to_pylist() == [SCHEMA_VERSION] * 5
    assert mirror_file(stream).stat().st_mode & 0o777 == stream.stat().st_mode & 0o777  # readable as its stream is
    assert not list(tmp_path.glob("*.tmp"))


def test_a_crash_before_close_leaves_the_jsonl_to_parse_and_analysis_mirrors_it(tmp_path: Path) -> None:
    stream = _written(tmp_path, range(1, 4), close=False)
    assert not mirror_file(stream).exists()
    with stream.open("a") as handle:
        handle.write('{"schema_version": 3, "step": 4, "ra')  # torn mid-line
    frame = load_run(tmp_path, leave_mirrors=True)
    assert list(frame["step"]) == [1, 2, 3]
    read = read_stream(stream)
    assert read.mirror_current and read.covered == stream.read_bytes().rfind(b"\n") + 1  # the torn line is not
    assert load_run(tmp_path, leave_mirrors=True).equals(frame)


def test_a_resumed_stream_is_mirrored_as_it_ends_up(tmp_path: Path) -> None:
    stream = _written(tmp_path, range(1, 9))
    writer = StepWriter(stream)
    writer.truncate_after(5)  # the mirror of steps 1-8 now claims more bytes than the stream holds
    assert read_stream(stream).mirrored is None
    for step in (6, 7):
        writer.write(_record(step))
    writer.close()
    read = read_stream(stream)
    assert read.mirror_current and read.mirrored.column("step").to_pylist() == list(range(1, 8))
    assert load_run(tmp_path, leave_mirrors=True).equals(load_run(tmp_path, use_mirrors=False))


def test_lines_appended_after_the_mirror_are_parsed_and_joined_in_order(tmp_path: Path) -> None:
    stream = _written(tmp_path, range(1, 4))
    with stream.open("a") as handle:
        handle.write(json.dumps({"schema_version": SCHEMA_VERSION, **_record(4), "extra": "new field"}) + "\n")
    read = read_stream(stream)
    assert read.mirrored is not None and read.mirrored.num_rows == 3 and read.rest.count(b"\n") == 1
    frame = load_run(tmp_path, use_mirrors=False)
    assert list(frame["step"]) == [1, 2, 3, 4] and frame["extra"].isna().tolist() == [True] * 3 + [False]
    assert load_run(tmp_path, leave_mirrors=True).equals(frame)  # mirror + parsed rest, then the refreshed mirror
    assert load_run(tmp_path, leave_mirrors=True).equals(frame)


@pytest.mark.parametrize("damage", ["other format", "empty", "foreign bytes", "stale digest"])
def test_an_unusable_mirror_is_no_error_and_no_evidence(tmp_path: Path, damage: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    stream = _written(tmp_path, range(1, 5))
    truth = load_run(tmp_path, use_mirrors=False)
    table = parse_records(stream.read_bytes())
    size = stream.stat().st_size
    if damage == "other format":  # intact and matching, but written by a taxbench with another mirror format
        with monkeypatch.context() as patched:
            patched.setattr("taxbench.rundir.step_stream.MIRROR_FORMAT", 9)
            write_mirror(stream, table, size, read_stream(stream).digest)
    elif damage == "empty":
        mirror_file(stream).write_bytes(b"")
    elif damage == "foreign bytes":
        mirror_file(stream).write_bytes(b"PAR1" * 64)
    else:  # a well-formed mirror whose rows differ from the stream (another run's): its digest is not this stream's
        other = table.set_column(table.schema.get_field_index("params"), "params", pa.array(["f" * 16] * 4))
        write_mirror(stream, other, size, bytes(16))
    assert read_stream(stream).mirrored is None
    assert load_run(tmp_path, leave_mirrors=True).equals(truth)
    assert read_stream(stream).mirror_current  # analysis replaced it


def test_refresh_mirror_of_an_unparsable_stream_raises_and_the_writer_only_warns(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    writer = StepWriter(steps_file(tmp_path, 0))
    writer.write(_record(1))
    with writer.path.open("a") as handle:
        handle.write("not json\n")
    with pytest.raises(pa.ArrowInvalid):
        refresh_mirror(writer.path)
    writer.close()  # the run does not fail over its mirror: analysis will name the bad line
    assert "no columnar mirror written" in capsys.readouterr().err
    assert not mirror_file(writer.path).exists()


def test_ranks_load_in_rank_order_without_a_gather(tmp_path: Path) -> None:
    for rank in (10, 2, 0, 1):  # steps.rank10 sorts before steps.rank2 by name
        _written(tmp_path, range(1, 4), rank=rank)
    frame = load_run(tmp_path, leave_mirrors=True)
    assert list(frame["rank"]) == [0] * 3 + [1] * 3 + [2] * 3 + [10] * 3
    assert list(frame["step"]) == [1, 2, 3] * 4


def _run_of(tmp_path: Path, ranks: int = 3) -> tuple[Path, pd.DataFrame]:
    """A run of `ranks` closed streams, its frame parsed from the JSONL, and its run mirror left by a first load."""
    run = tmp_path / "exp" / "baseline-0"
    for rank in range(ranks):
        _written(run, range(1, 6), rank=rank)
    truth = load_run(run, use_mirrors=False)
    assert not run_mirror_file(run).exists()  # a parse writes no mirror
    assert load_run(run, leave_mirrors=True).equals(truth) and run_mirror_file(run).is_file()
    return run, truth


def test_a_run_mirror_is_left_by_the_first_load_and_gives_the_same_frame(tmp_path: Path) -> None:
    run, truth = _run_of(tmp_path)
    for stream in run.glob("steps.rank*.arrow"):
        stream.unlink()  # the next load reads the run mirror alone: the streams' own mirrors are not needed
    mirror = read_run_mirror(run)
    assert mirror is not None and [c.name for c in mirror[1]] == [f"steps.rank{r}.jsonl" for r in range(3)]
    assert load_run(run, leave_mirrors=True).equals(truth)
    assert not mirror_file(steps_file(run, 0)).exists()  # so the run mirror was used, and nothing rewritten


@pytest.mark.parametrize("change", ["edited", "appended", "torn tail", "added", "removed", "mirror damaged"])
def test_a_run_mirror_is_used_only_for_exactly_the_streams_it_covers(tmp_path: Path, change: str) -> None:
    run, _ = _run_of(tmp_path)
    stream = steps_file(run, 1)
    if change == "edited":  # same length, one digit changed: only the hash tells
        data = stream.read_bytes()
        stream.write_bytes(data.replace(b'"step":3', b'"step":4', 1))
    elif change == "appended":
        with stream.open("a") as handle:
            handle.write(json.dumps({"schema_version": SCHEMA_VERSION, **_record(6, rank=1)}) + "\n")
    elif change == "torn tail":  # a crashed writer's half line is no record: the run mirror still covers it all
        with stream.open("a") as handle:
            handle.write('{"schema_version": 3, "ste')
    elif change == "added":
        _written(run, range(1, 6), rank=3)
    elif change == "removed":
        stream.unlink()
        mirror_file(stream).unlink()
    else:
        data = bytearray(run_mirror_file(run).read_bytes())
        data[len(data) // 2] ^= 1
        run_mirror_file(run).write_bytes(bytes(data))
    covered = read_run_mirror(run)
    usable = covered is not None and [c.name for c in covered[1]] == [p.name for p in stream_files(run)] and all(
        covers(run / c.name, c) for c in covered[1])
    assert usable == (change == "torn tail")
    truth = load_run(run, use_mirrors=False)
    assert load_run(run, leave_mirrors=True).equals(truth)  # whatever the mirrors: the JSONL's frame
    assert read_run_mirror(run) is not None and load_run(run, leave_mirrors=True).equals(truth)  # rewritten
