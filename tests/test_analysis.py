"""Analysis: tax recovery from synthetic step times, warmup detection, first-mismatch reporting, record checks."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from taxbench.analysis.records import RecordError, load_run
from taxbench.analysis.tax import estimate_tax, steps_for_half_width
from taxbench.analysis.verdicts import compare_runs
from taxbench.analysis.warmup import mser5, warmup_cut
from taxbench.records import METRICS, SCHEMA_VERSION, StepWriter, steps_file


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
    tax = estimate_tax(baseline, deterministic, min_warmup=4)
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


def test_steps_for_half_width_matches_design_table() -> None:
    assert steps_for_half_width(0.01) == pytest.approx(31, abs=1)
    assert steps_for_half_width(0.02) == pytest.approx(123, abs=1)
    assert steps_for_half_width(0.03) == pytest.approx(277, abs=1)


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
    with pytest.raises(RecordError, match=r"steps.rank0.jsonl:1: schema_version=2"):
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
