"""Fingerprint columns packed as unsigned integers (taxbench.rundir.hex_columns): lossless or not done, and the gates
decide the same whichever way a run's fingerprints are held."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from taxbench.analysis.experiment import compute_experiment
from taxbench.analysis.synthetic import Injection, SyntheticExperiment, write_experiment
from taxbench.analysis.verdicts import compare_runs
from taxbench.design import GATES
from taxbench.rundir import step_stream
from taxbench.rundir.hex_columns import hex_text, pack_column, unpacked
from taxbench.rundir.read import load_run
from taxbench.rundir.records import METRICS, steps_file


def _as_loaded(values: list[str | None]) -> pd.Series:
    """A column as load_run gives it (arrow-backed large strings)."""
    return pa.table({"v": pa.array(values, pa.large_string())}).to_pandas()["v"]


def packed(column: pd.Series) -> pd.Series:
    """A column as load_run(fields=...) holds it: packed where lossless, else the column itself."""
    strings = pa.chunked_array([pa.array(column.array, from_pandas=True)])
    held = pack_column(strings)
    return column if held is strings else pd.Series(held.to_numpy(), index=column.index, name=column.name)


@pytest.mark.parametrize(("values", "dtype"), [
    (["0123456789abcdef", "ffffffffffffffff", "0000000000000000"], np.uint64),
    (["deadbeef", "00000001"], np.uint32),  # float32 bits
    (["3f80", "0000"], np.uint16),  # bf16 / fp16 bits
    (["ab", "00"], np.uint8),
])
def test_lowercase_hex_of_one_width_is_packed_and_spelled_back_exactly(values: list[str], dtype: type) -> None:
    for column in (_as_loaded(values), pd.Series(values, dtype=object)):
        held = packed(column)
        assert held.dtype == dtype
        assert [hex_text(v, held.dtype) for v in held] == values
        assert unpacked(held).tolist() == values


@pytest.mark.parametrize("values", [
    ["ABCDEF0123456789"],  # uppercase: "abcd..." would read the same as an integer
    ["abc", "def"],  # no unsigned width
    ["abcd", "abcdef01"],  # widths differ within the column
    ["abcd", None],  # a missing fingerprint (check_run names it; the gates drop it)
    ["0x12"],
    ["ab\u00e9d"],  # not ASCII
    ["abcdef0123456789ab"],  # wider than 64 bits
])
def test_anything_else_stays_the_strings_it_was(values: list[str | None]) -> None:
    column = pa.chunked_array([pa.array(values, pa.large_string())])
    assert pack_column(column) is column


def _frame(steps: int, ranks: int, hexes: dict[str, str] | None = None) -> pd.DataFrame:
    rows = [{"step": s, "rank": r, **{m: f"{(s * 1_000_003 + r * 7919 + i) * 0x9E3779B97F4A7C15 % 2**64:016x}"
                                     for i, m in enumerate(METRICS)}}
            for r in range(ranks) for s in range(1, steps + 1)]
    frame = pa.Table.from_pylist(rows).cast(pa.schema(
        [("step", pa.int64()), ("rank", pa.int64()), *((m, pa.large_string()) for m in METRICS)])).to_pandas()
    for m, value in (hexes or {}).items():
        frame.loc[(frame["step"] == 4) & (frame["rank"] == 1), m] = value
    return frame


def _packed(frame: pd.DataFrame) -> pd.DataFrame:
    out = frame.assign(**{m: packed(frame[m]) for m in METRICS})
    assert all(out[m].dtype == np.uint64 for m in METRICS)
    return out


@pytest.mark.parametrize("case", ["identical", "differs", "missing", "incomplete", "replay"])
def test_the_gates_decide_alike_on_packed_mixed_and_text_fingerprints(case: str) -> None:
    reference = _frame(8, 3)
    candidate = _frame(8, 3, {"params": "00000000000000ff"} if case != "identical" else None)
    problems: tuple[str, ...] = ()
    from_step = 0
    if case == "missing":  # the merge path: a record one run lacks
        candidate = candidate[~((candidate["step"] == 2) & (candidate["rank"] == 2))].reset_index(drop=True)
    if case == "incomplete":  # records both runs hold once are compared, never identical
        candidate = candidate[candidate["step"] <= 6].reset_index(drop=True)
        problems = ("b: steps 7-8 missing",)
    if case == "replay":
        from_step = 4
    expected = compare_runs("g", "a", reference, "b", candidate, from_step, problems).to_dict()
    for ref, cand in ((_packed(reference), _packed(candidate)), (_packed(reference), candidate),
                      (reference, _packed(candidate))):
        assert compare_runs("g", "a", ref, "b", cand, from_step, problems).to_dict() == expected


def test_fingerprints_of_other_widths_never_agree_as_numbers() -> None:
    """A float32's bits 00000005 and a digest 0000000000000005 are the same integer, not the same record."""
    short = _as_loaded(["00000005"] * 2)
    reference = pd.DataFrame({"step": [1, 2], "rank": [0, 0], **{m: packed(_as_loaded(["0" * 15 + "5"] * 2))
                                                                 for m in METRICS}})
    candidate = reference.assign(loss_bits=packed(short))
    assert candidate["loss_bits"].dtype == np.uint32
    verdict = compare_runs("g", "a", reference, "b", candidate)
    mismatch = verdict.first_mismatch
    assert not verdict.agree and mismatch is not None
    assert (mismatch.step, mismatch.metric, mismatch.expected, mismatch.actual) == (
        1, "loss_bits", "0000000000000005", "00000005")


def test_an_experiment_is_analysed_on_packed_fingerprints_with_the_verdicts_of_its_records(tmp_path: Path) -> None:
    root = write_experiment(tmp_path / "exp", SyntheticExperiment(ranks=3, steps=24, block_steps=4, warmup_steps=4,
                                                                  resume_step=8),
                            Injection("deterministic-1", step=11, rank=2, metric="grads"))
    analysis = compute_experiment(root)
    assert all(frame[m].dtype == np.uint64 for frame in analysis.runs.values() for m in METRICS)
    for verdict, gate in zip(analysis.summary.verdicts, GATES, strict=True):
        from_step = 8 if gate.after_resume else 0
        as_recorded = compare_runs(gate.name, gate.reference.name, load_run(root / gate.reference.name),
                                   gate.candidate.name, load_run(root / gate.candidate.name), from_step)
        assert verdict.to_dict() == as_recorded.to_dict()
    first = analysis.summary.verdicts[0].first_mismatch
    assert first is not None and (first.step, first.rank, first.metric, first.actual) == (11, 2, "grads", "f" * 16)


@pytest.mark.parametrize("odd_record", [False, True])
def test_fields_of_a_run_read_batch_by_batch_are_the_records_values(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     odd_record: bool) -> None:
    """The run mirror is read batch by batch, each cut to the fields asked for; where one batch cannot pack (an
    uppercase digest in one record) the batches do not concatenate and the whole run is read and packed at once:
    that column then stays text, and every value is the record's either way."""
    monkeypatch.setattr(step_stream, "RUN_BATCH_ROWS", 5)
    root = write_experiment(tmp_path / "exp", SyntheticExperiment(ranks=2, steps=12, block_steps=4, warmup_steps=4,
                                                                  resume_step=4))
    run = root / "deterministic-1"
    if odd_record:
        stream = steps_file(run, 1)
        lines = stream.read_text().splitlines(keepends=True)
        record = json.loads(lines[8])
        lines[8] = json.dumps(record | {"params": record["params"].upper()}) + "\n"
        stream.write_text("".join(lines))
    truth = load_run(run, use_mirrors=False)  # the JSONL's records, parsed
    load_run(run, leave_mirrors=True)  # leaves the run mirror
    with pa.OSFile(str(step_stream.run_mirror_file(run))) as source:
        assert sum(1 for _ in ipc.open_stream(source)) == 5  # 24 records in batches of 5
    fields = ("step", "rank", "time_s", *METRICS)
    kept = load_run(run, fields=fields)
    assert list(kept.columns) == [name for name in truth.columns if name in fields]
    assert (kept["params"].dtype == np.uint64) != odd_record
    for name in fields:
        assert unpacked(kept[name]).tolist() == truth[name].tolist(), name


@pytest.mark.parametrize("damage", ["flipped byte", "cut short", "digest only"])
def test_fields_cut_from_a_damaged_run_mirror_are_never_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             damage: str) -> None:
    """Batches are cut to the fields as they are read, before the mirror's hash is checked at its end: a damaged
    mirror's batches are dropped and the run is read from its streams."""
    monkeypatch.setattr(step_stream, "RUN_BATCH_ROWS", 5)
    root = write_experiment(tmp_path / "exp", SyntheticExperiment(ranks=2, steps=12, block_steps=4, warmup_steps=4,
                                                                  resume_step=4))
    run = root / "baseline-1"
    truth = load_run(run, use_mirrors=False)
    load_run(run, leave_mirrors=True)  # leaves the run mirror
    mirror = step_stream.run_mirror_file(run)
    data = bytearray(mirror.read_bytes())
    if damage == "flipped byte":  # inside a value of the last batch: it still decodes
        data[-200] ^= 1
    mirror.write_bytes(bytes(data[: len(data) // 2]) if damage == "cut short" else
                       bytes(data[-16:]) if damage == "digest only" else bytes(data))
    assert step_stream.read_run_mirror(run, lambda batch: pa.Table.from_batches([batch])) is None
    kept = load_run(run, fields=METRICS)
    for name in METRICS:
        assert unpacked(kept[name]).tolist() == truth[name].tolist(), name
