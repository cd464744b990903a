"""Analysis: tax recovery from synthetic step times, warmup detection, first-mismatch reporting, record checks,
completeness against the manifest, fault events."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from taxbench.analysis.verdicts import DIFFERS, INCOMPLETE, compare_runs
from taxbench.rundir.read import RecordError, check_run, load_fault_events, load_run
from taxbench.rundir.records import METRICS, SCHEMA_VERSION, steps_file
from taxbench.rundir.run_manifest import load_manifest
from taxbench.rundir.step_stream import StepWriter
from taxbench.stats.tax import Checkpoints, estimate_tax, steps_for_half_width
from taxbench.stats.warmup import mser5, warmup_cut


def synthetic_arm(true_time: float, steps: int, block_steps: int, ranks: int, cv: float, seed: int,
                  warmup: int = 0, drift: np.ndarray | None = None) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    rows = []
    for step in range(1, steps + 1):
        for rank in range(ranks):
            base = true_time * (1 + (drift[step - 1] if drift is not None else 0.0))
            slow_start = 3.0 if step <= warmup else 1.0
            rows.append({"step": step, "rank": rank, "block": (step - 1) // block_steps,
                         "time_s": base * slow_start * float(rng.lognormal(0, cv))})
    return pd.DataFrame(rows)


@pytest.mark.parametrize("true_tax", [0.0, 0.05, 0.20])
def test_known_tax_is_recovered_within_its_interval(true_tax: float) -> None:
    steps, block = 240, 8
    # A shared drift over the allocation (both arms see it, as when interleaved) must cancel in the ratio.
    drift = np.linspace(0, 0.3, steps)
    baseline = synthetic_arm(0.010, steps, block, ranks=2, cv=0.02, seed=1, warmup=5, drift=drift)
    deterministic = synthetic_arm(0.010 * (1 + true_tax), steps, block, ranks=2, cv=0.02, seed=2, warmup=5,
                                  drift=drift)
    tax = estimate_tax([baseline], [deterministic], min_warmup=4)
    assert tax.low <= true_tax <= tax.high
    assert tax.hl_low <= true_tax <= tax.hl_high
    assert tax.high - tax.low < 0.02
    assert tax.warmup_steps >= 5  # the slow first steps are cut
    assert tax.pairs >= steps // block - math.ceil(tax.warmup_steps / block)


def test_mser5_finds_a_warmup_transient_and_flags_drift() -> None:
    rng = np.random.default_rng(0)
    steady = 1 + 0.01 * rng.standard_normal(200)
    steady[:20] += 2.0
    cut, drifting = mser5(steady)
    assert 20 <= cut <= 30 and not drifting
    _, drifting = mser5(np.linspace(1, 3, 200) + 0.001 * rng.standard_normal(200))
    assert drifting
    assert warmup_cut(steady, minimum=40).steps == 40


def test_every_timed_run_narrows_the_interval_around_the_same_tax() -> None:
    steps, block, true_tax = 120, 1, 0.03
    # A speed regime shared by every run of a round (the machine's state), which interleaving must cancel.
    regime = np.repeat(np.random.default_rng(7).choice([0.0, 0.4], size=steps // 6), 6)
    runs = {(arm, replica): synthetic_arm(0.010 * (1 + true_tax if arm == "d" else 1), steps, block, ranks=2,
                                          cv=0.05, seed=10 * replica + (arm == "d"), drift=regime)
            for arm in ("b", "d") for replica in (0, 1)}
    pair = estimate_tax([runs["b", 0]], [runs["d", 0]], min_warmup=0)
    every = estimate_tax([runs["b", 0], runs["b", 1]], [runs["d", 0], runs["d", 1]], min_warmup=0)
    assert every.timed_runs == 4 and pair.timed_runs == 2
    assert every.low <= true_tax <= every.high and pair.low <= true_tax <= pair.high
    assert every.half_width < pair.half_width / 1.2  # sqrt(2) in expectation


def test_the_round_after_each_checkpoint_is_left_out_of_the_tax() -> None:
    # An A/A pair whose deterministic arm always runs the first step after a checkpoint commit (every 10 steps), 30%
    # slower: as in A B B A rounds on one model, where that slot is always the first arm's.
    steps, every = 120, 10
    baseline = synthetic_arm(0.010, steps, 1, ranks=1, cv=0.01, seed=1)
    deterministic = synthetic_arm(0.010, steps, 1, ranks=1, cv=0.01, seed=2)
    after = (deterministic["step"] - 1) % every == 0
    deterministic.loc[after & (deterministic["step"] > 1), "time_s"] *= 1.3
    checkpoints = Checkpoints(every, block_steps=1)
    naive = estimate_tax([baseline], [deterministic], min_warmup=4)
    fair = estimate_tax([baseline], [deterministic], min_warmup=4, checkpoints=checkpoints)
    assert naive.low > 0.01  # the post-checkpoint steps alone make a tax
    assert fair.low <= 0 <= fair.high and fair.pairs == naive.pairs - 11
    assert [s for s in range(1, 30) if checkpoints.follows(s)] == [11, 21]
    assert not Checkpoints(0, 1).follows(11)
    # blocks of 4 end at 12, 20, 32, 40 after crossing a multiple of 10: the next block's first step is left out
    assert [s for s in range(1, 49) if Checkpoints(10, block_steps=4).follows(s)] == [13, 21, 33, 41]
    blocks = synthetic_arm(0.010, 48, 4, ranks=1, cv=0.01, seed=3)
    assert estimate_tax([blocks], [blocks], min_warmup=0, checkpoints=Checkpoints(10, 4)).pairs == 12  # blocks kept
    # Commits by time are recorded (stop.json), not a step rule: the recorded steps decide, whatever `every` says.
    recorded = Checkpoints.of({"checkpoint_every_steps": 10, "block_steps": 1}, [7, 30])
    assert [s for s in range(1, 49) if recorded.follows(s)] == [8, 31]
    assert [s for s in range(1, 49) if Checkpoints.of({"checkpoint_every_steps": 10, "block_steps": 4}, None)
            .follows(s)] == [13, 21, 33, 41]  # experiments from before: the step rule


def test_steps_needed_extrapolate_the_measured_half_width() -> None:
    rng = np.random.default_rng(3)
    baseline = synthetic_arm(0.010, 60, 1, ranks=1, cv=0.05, seed=int(rng.integers(1000)))
    deterministic = synthetic_arm(0.010, 60, 1, ranks=1, cv=0.05, seed=int(rng.integers(1000)))
    tax = estimate_tax([baseline], [deterministic], min_warmup=4)
    needed = steps_for_half_width(tax, tax.half_width / 2)  # half the width: four times the steady steps
    assert needed == tax.warmup_steps + math.ceil(4 * tax.steady_steps)
    assert steps_for_half_width(tax, tax.half_width * 2) < 60


def _stream(steps: int, ranks: int) -> pd.DataFrame:
    rows = [{"step": s, "rank": r, **{m: f"{hash((s, r, m)) & 0xFFFF:016x}" for m in METRICS}}
            for s in range(1, steps + 1) for r in range(ranks)]
    return pd.DataFrame(rows)


def test_identical_streams_agree() -> None:
    a = _stream(10, 2)
    verdict = compare_runs("repeatability", "a", a, "b", a.copy())
    assert verdict.agree and verdict.first_mismatch is None and verdict.compared_steps == 10


def test_first_mismatch_names_step_rank_and_metric_in_production_order() -> None:
    a = _stream(10, 2)
    b = a.copy()
    b.loc[(b["step"] == 7) & (b["rank"] == 0), "loss_bits"] = "ffff"
    b.loc[(b["step"] == 4) & (b["rank"] == 1), ["params", "optim"]] = "dead"
    verdict = compare_runs("repeatability", "a", a, "b", b)
    assert not verdict.agree
    m = verdict.first_mismatch
    assert (m.step, m.rank, m.metric) == (4, 1, "params")
    assert m.actual == "dead"


def test_missing_records_are_reported_as_control_flow_divergence() -> None:
    a = _stream(10, 2)
    b = a[~((a["step"] == 6) & (a["rank"] == 1))]
    m = compare_runs("g", "a", a, "b", b).first_mismatch
    assert (m.step, m.rank, m.metric) == (6, 1, "missing_record")


def test_comparison_from_a_step_ignores_earlier_differences() -> None:
    a = _stream(10, 1)
    b = a.copy()
    b.loc[b["step"] == 2, "grads"] = "0"
    assert compare_runs("restart_replay", "a", a, "b", b, from_step=5).agree


def _write(run: Path, records: list[dict]) -> None:
    writer = StepWriter(steps_file(run, 0))
    for record in records:
        writer.write(record)
    writer.close()


def test_reader_rejects_other_schema_versions(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    steps_file(run, 0).write_text(json.dumps({"schema_version": SCHEMA_VERSION + 1, "step": 1}) + "\n")
    with pytest.raises(RecordError, match=rf"steps.rank0.jsonl:1: schema_version={SCHEMA_VERSION + 1}"):
        load_run(run)


def test_reader_tolerates_a_torn_last_record_but_not_corruption_in_the_middle(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _write(run, [{"step": 1, "rank": 0}, {"step": 2, "rank": 0}])
    with steps_file(run, 0).open("a") as handle:
        handle.write('{"schema_version": 1, "step": 3, "ra')  # a crash mid-write
    assert list(load_run(run)["step"]) == [1, 2]
    lines = steps_file(run, 0).read_text().splitlines()
    steps_file(run, 0).write_text("\n".join([lines[0], "garbage", lines[1]]) + "\n")
    with pytest.raises(RecordError, match="steps.rank0.jsonl:2: not a JSON record"):
        load_run(run)


def test_a_torn_record_of_one_rank_does_not_swallow_the_next_ranks_records(tmp_path: Path) -> None:
    run = tmp_path / "run"
    for rank in (0, 1, 2):
        writer = StepWriter(steps_file(run, rank))
        for step in (1, 2):
            writer.write({"schema_version": SCHEMA_VERSION, "step": step, "rank": rank})
        writer.close()
    with steps_file(run, 0).open("a") as handle:
        handle.write('{"schema_version": 3, "step": 3, "ra')  # rank 0 crashed mid-write; ranks 1 and 2 did not
    steps_file(run, 3).write_text("\n \n")  # a rank that wrote nothing but blank lines
    frame = load_run(run)
    assert list(zip(frame["step"], frame["rank"], strict=True)) == [(1, 0), (2, 0), (1, 1), (2, 1), (1, 2), (2, 2)]
    assert load_run(run).equals(frame)  # the mirrors, which cover what lies before the torn tail


def test_truncate_after_drops_records_past_the_checkpoint(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _write(run, [{"step": s, "rank": 0} for s in range(1, 9)])
    writer = StepWriter(steps_file(run, 0))
    writer.truncate_after(5)
    writer.write({"step": 6, "rank": 0, "again": True})
    writer.close()
    frame = load_run(run)
    assert list(frame["step"]) == [1, 2, 3, 4, 5, 6]
    assert frame["again"].iloc[-1] is True


def test_missing_run_directory_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(RecordError, match="no steps.rank<R>.jsonl files"):
        load_run(tmp_path)


# ---- completeness: every rank, every step, once -------------------------------------------------------------------

def _grid_run(tmp_path: Path, steps: int, ranks: int) -> tuple[Path, pd.DataFrame]:
    run = tmp_path / "run"
    for rank in range(ranks):
        _write_rank(run, rank, [{"step": s, "rank": rank, **{m: "00" for m in METRICS}} for s in range(1, steps + 1)])
    return run, load_run(run, use_mirrors=False)


def _write_rank(run: Path, rank: int, records: list[dict]) -> None:
    writer = StepWriter(steps_file(run, rank))
    for record in records:
        writer.write(record)
    writer.close()


def test_check_run_names_missing_duplicated_and_stray_records_compactly(tmp_path: Path) -> None:
    run, frame = _grid_run(tmp_path, steps=60, ranks=3)
    assert check_run("det-1", run, frame, steps=60, world=3) == []
    truncated = frame[~((frame["rank"] == 1) & (frame["step"] >= 30))]
    assert check_run("det-1", run, truncated, 60, 3) == ["det-1 rank 1: steps 30-60 missing"]
    holes = frame[~frame["step"].isin([3, 5, 6, 7])]
    assert check_run("det-1", run, holes, 60, 3) == ["det-1 ranks 0-2: steps 3, 5-7 missing"]
    twice = pd.concat([frame, frame[frame["step"].isin([8, 9]) & (frame["rank"] == 2)]])
    assert check_run("det-1", run, twice, 60, 3) == ["det-1 rank 2: steps 8-9 recorded more than once"]
    stray = frame.copy()
    stray.loc[stray.index[-1], "step"] = 61
    assert check_run("det-1", run, stray, 60, 3) == [
        "det-1: 1 record outside steps 1-60 x ranks 0-2 (first: step 61, rank 2)", "det-1 rank 2: step 60 missing"]
    unsigned = frame.copy()
    unsigned.loc[unsigned.index[4], "params"] = None
    assert check_run("det-1", run, unsigned, 60, 3) == ["det-1: 1 record without a fingerprint (first: step 5, rank 0)"]


def test_check_run_compares_stream_files_with_the_world(tmp_path: Path) -> None:
    run, frame = _grid_run(tmp_path, steps=12, ranks=2)
    # the manifest says 3 ranks: rank 2's stream is missing
    assert check_run("r", run, frame, 12, 3) == ["r rank 2: no steps.rank2.jsonl (all 12 steps missing)"]
    # the manifest says 1 rank: rank 1's stream (and its records) should not exist
    assert check_run("r", run, frame, 12, 1) == [
        "r rank 1: steps.rank1.jsonl outside its world of 1 ranks (manifest layout.world_size)",
        "r: 12 records outside steps 1-12 x ranks 0-0 (first: step 1, rank 1)"]


def test_check_run_stays_fast_at_1000_ranks_by_1000_steps(tmp_path: Path) -> None:
    steps, world = 1000, 1000
    frame = pd.DataFrame({"step": np.repeat(np.arange(1, steps + 1), world), "rank": np.tile(np.arange(world), steps),
                          **{m: "0123456789abcdef" for m in METRICS}})
    run = tmp_path / "run"
    run.mkdir()
    for rank in range(world):
        steps_file(run, rank).touch()
    sparse = frame[(frame["step"] % 2 == 0) | (frame["rank"] % 3 == 0)]  # 333 patterns of 500 gaps each
    # CPU seconds of this process, not wall-clock: other jobs on the machine do not add to them.
    start = time.process_time()
    assert check_run("r", run, frame, steps, world) == []
    problems = check_run("r", run, sparse, steps, world)
    elapsed = time.process_time() - start
    assert problems == ["r ranks 1-2, 4-5, 7-8, 10-11, 13-14, 16-17, ... (333 ranges): steps 1, 3, 5, 7, 9, 11, ... "
                        "(500 ranges) missing"]
    assert elapsed < 5, elapsed  # about 0.5 CPU s here; a per-record Python loop would take CPU minutes


def test_gate_over_incomplete_runs_is_never_identical() -> None:
    a = _stream(10, 2)
    truncated = a[a["step"] <= 6]
    verdict = compare_runs("repeatability", "a", truncated, "b", truncated.copy(), problems=("a: steps 7-10 missing",))
    assert not verdict.agree and verdict.outcome == INCOMPLETE and verdict.first_mismatch is None
    assert verdict.compared_steps == 6 and verdict.to_dict()["problems"] == ["a: steps 7-10 missing"]
    # a fingerprint that differs in a record both runs hold once is still proof that the runs differ
    b = truncated.copy()
    b.loc[(b["step"] == 4) & (b["rank"] == 1), "optim"] = "dead"
    verdict = compare_runs("repeatability", "a", pd.concat([truncated, truncated.iloc[:2]]), "b", b,
                           problems=("a: step 1 recorded more than once",))
    assert verdict.outcome == DIFFERS and (verdict.first_mismatch.step, verdict.first_mismatch.metric) == (4, "optim")
    # nothing to compare is no evidence of agreement either
    nothing = compare_runs("restart_replay", "a", a, "b", a.copy(), from_step=10)
    assert not nothing.agree and nothing.outcome == INCOMPLETE and nothing.compared_steps == 0


def test_fault_events_are_read_and_bad_lines_named(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    assert load_fault_events(run) == []
    event = {"schema_version": SCHEMA_VERSION, "kind": "flip_param_bit", "step": 12, "rank": 1,
             "where": "between steps"}
    (run / "faults.rank1.jsonl").write_text(json.dumps(event) + "\n" + '{"schema_version": 1, "ki')  # torn tail
    assert [e.describe() for e in load_fault_events(run)] == [
        "fault flip_param_bit fired at step 12, rank 1 (between steps)"]
    (run / "faults.rank1.jsonl").write_text(json.dumps({**event, "schema_version": 9}) + "\n")
    with pytest.raises(RecordError, match=r"faults.rank1.jsonl:1: schema_version=9"):
        load_fault_events(run)
    (run / "faults.rank1.jsonl").write_text(json.dumps({**event, "step": "12"}) + "\n")
    with pytest.raises(RecordError, match=r"faults.rank1.jsonl:1: fault event lacks or mistypes \['step'\]"):
        load_fault_events(run)


def test_manifest_that_is_not_a_json_object_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "manifest.json").write_text('{"schema_version": 1, "config": ')
    with pytest.raises(RecordError, match=r"manifest.json: not valid JSON"):
        load_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text("[1, 2]")
    with pytest.raises(RecordError, match=r"manifest.json: not a JSON object"):
        load_manifest(tmp_path)
    (tmp_path / "manifest.json").write_bytes(b"\xff\xfe{")
    with pytest.raises(RecordError, match=r"manifest.json: not valid JSON"):
        load_manifest(tmp_path)
