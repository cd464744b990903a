"""The calibrated instrument: a planted tax is recovered, an A/A pair is labelled as a calibration, every
interleaved run is timed, a precision target stops the rounds, and an unfinished adaptive schedule is incomplete."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from helpers import Crash, compose_config, crash_after, run_schedule, step_records, tiny_config

from taxbench import exit_codes
from taxbench.analysis.experiment import CALIBRATION
from taxbench.analysis.summary import analyse, analyse_experiment
from taxbench.config.schema import ConfigError
from taxbench.rundir.records import STOP_FILE
from taxbench.schedule.stopping import MIN_ROUNDS

CALIBRATED = ("experiment.calibration=true", "experiment.block_steps=1", "experiment.checkpoint_every_steps=10")


def test_a_planted_tax_is_recovered_by_an_a_a_pair_labelled_as_a_calibration(tmp_path: Path) -> None:
    cfg = tiny_config(*CALIBRATED, "experiment.steps=60", "experiment.planted_tax=0.5")
    run_schedule(cfg, tmp_path)
    for name in ("baseline-0", "deterministic-0", "deterministic-1", "baseline-1", "deterministic-resumed"):
        manifest = json.loads((tmp_path / name / "manifest.json").read_text())
        assert manifest["policy"]["deterministic"] is False, name  # both arms on the baseline policy
    planted = [r["planted_s"] for r in step_records(tmp_path / "deterministic-1")]
    assert planted[0] > 0 and all(p > 0 for p in planted)  # every deterministic step, from the first one
    assert all(r["planted_s"] == 0 for r in step_records(tmp_path / "baseline-1"))
    summary = analyse(tmp_path)
    assert summary.outcome == CALIBRATION and summary.exit_code == exit_codes.OK and not summary.deterministic_ok
    assert summary.tax.timed_runs == 4  # baseline-0, deterministic-0, deterministic-1, baseline-1
    # The truth is what the plant did, measured from the records apart from the estimator: the fraction it waited
    # (sum of waits over the steps' own unplanted time) times the A/A pair's unplanted difference. Each run trains
    # a model of its own, and the runs of one arm can share an offset of a few percent in either sign (seen with the
    # wait slept or spun alike); the estimate's interval is over rounds and does not cover it, so a bare "+50%"
    # truth failed CI at +45.1% [43.1, 47.2] on a quiet machine.
    realized, unplanted_ratio = _what_the_plant_did(tmp_path, summary.tax.warmup_steps)
    assert abs(realized - 0.5) <= 0.02  # the plant delivered what was asked, overruns taken off later waits
    # Without the plant the arms train at about the same speed (14% apart was seen with eight other jobs on the two
    # cores); a wait outside the timed step would read as 1/1.5 here.
    assert 0.8 <= unplanted_ratio <= 1.25
    truth = (1 + realized) * unplanted_ratio - 1
    # Unbiased within its interval (twice the half-width: the benchmark, not a unit test, measures the coverage).
    assert abs(summary.tax.tax - truth) <= 2 * summary.tax.half_width
    # The report's and wandb's per-block tax are the rounds the estimate used: not the slow one after each commit.
    ratios = analyse_experiment(tmp_path).block_ratios
    assert len(ratios) == summary.tax.pairs and not {10, 20, 30, 40, 50} & set(ratios.index)
    stored = json.loads((tmp_path / "summary.json").read_text())
    assert stored["planted_tax"] == 0.5 and stored["calibration"] is True and "planted +50.00%" in stored["headline"]


def _what_the_plant_did(root: Path, warmup: int) -> tuple[float, float]:
    """After the warmup: the fraction of their own unplanted time the deterministic runs' waits added (a ratio of
    sums), and the median unplanted deterministic step over the median baseline step (each arm's runs pooled)."""
    def steps(arm: str) -> list[dict]:
        return [r for i in (0, 1) for r in step_records(root / f"{arm}-{i}") if r["step"] > warmup]

    deterministic = steps("deterministic")
    unplanted = [r["time_s"] - r["planted_s"] for r in deterministic]
    realized = sum(r["planted_s"] for r in deterministic) / sum(unplanted)
    return realized, statistics.median(unplanted) / statistics.median(r["time_s"] for r in steps("baseline"))


def test_a_precision_target_adds_rounds_until_the_interval_is_that_narrow(tmp_path: Path) -> None:
    # 8 steps are 6 post-warmup rounds, fewer than the rule's MIN_ROUNDS: rounds are added however quiet the machine
    # (with 20 steps a quiet CI runner's first look was already narrow enough, and nothing was added).
    cfg = tiny_config(*CALIBRATED, "experiment.steps=8", "experiment.planted_tax=0.10",
                      "experiment.target_half_width=0.02", "experiment.max_steps=2000")
    assert cfg.experiment.steps - cfg.experiment.warmup_steps < MIN_ROUNDS
    run_schedule(cfg, tmp_path)
    stop = json.loads((tmp_path / STOP_FILE).read_text())
    assert stop["stopped_by"] == "target_half_width" and stop["half_width"] <= 0.02
    summary = analyse(tmp_path)
    assert summary.steps == stop["steps"] > 8 and not summary.problems
    assert summary.tax.half_width <= 0.02 and summary.stopped_by == "target_half_width"
    assert summary.tax.low > 0  # the planted 10% is seen (how close it lands is benchmarks/calibration.py's job)
    for name in ("baseline-0", "deterministic-1"):  # every timed run took the decided steps
        assert [r["step"] for r in step_records(tmp_path / name)] == list(range(1, stop["steps"] + 1))
    # The gate-only run does not grow with the rounds: experiment.gate_steps (0: experiment.steps)
    assert [r["step"] for r in step_records(tmp_path / "deterministic-resumed")] == list(range(1, 9))


def test_the_step_cap_stops_an_unreachable_target_and_says_so(tmp_path: Path) -> None:
    cfg = tiny_config(*CALIBRATED, "experiment.steps=12", "experiment.target_half_width=0.0001",
                      "experiment.max_steps=24")
    run_schedule(cfg, tmp_path)
    summary = analyse(tmp_path)
    assert summary.stopped_by == "max_steps" and summary.steps == 24 and not summary.problems


def test_an_adaptive_schedule_continued_after_a_crash_completes_without_duplicates(tmp_path: Path) -> None:
    cfg = tiny_config(*CALIBRATED, "experiment.steps=12", "experiment.target_half_width=0.0001",
                      "experiment.max_steps=36", "experiment.checkpoint_every_steps=6")
    with pytest.raises(Crash):
        run_schedule(cfg, tmp_path, crash_after(4 * 20 + 2))  # past `steps`, in the added rounds
    assert not (tmp_path / STOP_FILE).exists()  # the rounds never finished: analysis has no length to pass
    run_schedule(cfg, tmp_path)
    summary = analyse(tmp_path)
    assert summary.steps == 36 and not summary.problems and summary.exit_code == exit_codes.OK


def test_a_damaged_stop_record_on_continue_reruns_the_rounds_instead_of_failing(tmp_path: Path) -> None:
    cfg = tiny_config(*CALIBRATED, "experiment.steps=12", "experiment.checkpoint_every_steps=6")
    with pytest.raises(Crash):
        run_schedule(cfg, tmp_path, crash_after(4 * 12 + 2))  # the rounds finished, the resumed run had begun
    (tmp_path / STOP_FILE).write_text('{"steps": 12, "stopp')  # torn by a full disk, say
    run_schedule(cfg, tmp_path)
    assert json.loads((tmp_path / STOP_FILE).read_text())["steps"] == 12
    summary = analyse(tmp_path)
    assert summary.steps == 12 and not summary.problems and summary.exit_code == exit_codes.OK


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("experiment.interleave=some", "experiment.interleave='some' must be one of ['all', 'pair', 'policy']"),
        ("experiment.interleave=policy experiment.ablation=true",
         "experiment.interleave=policy with experiment.ablation=true: the knob arms are not timed on the shared model"),
        ("experiment.planted_tax=-0.1", "experiment.planted_tax=-0.1 must be in [0, 10)"),
        ("experiment.target_half_width=2", "experiment.target_half_width=2.0 must be in [0, 1)"),
    ],
)
def test_bad_calibration_settings_are_refused_with_the_fix(override: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        compose_config("experiment.name=x", *override.split())


def test_max_steps_below_steps_is_refused() -> None:
    with pytest.raises(ConfigError, match="experiment.max_steps=30 must be >= experiment.steps=60"):
        compose_config("experiment.name=x", "experiment.target_half_width=0.01", "experiment.max_steps=30")
