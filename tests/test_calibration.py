"""The calibrated instrument: the estimator recovers a planted tax from step times whose truth is known exactly, an A/A
pair plants its tax and is labelled as a calibration, every interleaved run is timed, a precision target stops the
rounds, and an unfinished adaptive schedule is incomplete.

No test here depends on an idle machine: what a real run's estimate makes of a planted tax under load is
benchmarks/calibration.py's question (docs/calibration.md)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from helpers import Crash, compose_config, crash_after, run_schedule, step_records, tiny_config

from taxbench import exit_codes
from taxbench.analysis.experiment import CALIBRATION
from taxbench.analysis.summary import analyse, analyse_experiment
from taxbench.config.schema import ConfigError
from taxbench.design import INTERLEAVED
from taxbench.parallel.distributed import DistContext
from taxbench.rundir.stop_file import CAP, STOP_FILE, TARGET, Stop
from taxbench.schedule.stopping import MIN_ROUNDS, StoppingRule
from taxbench.stats.tax import estimate_tax

CALIBRATED = ("experiment.calibration=true", "experiment.block_steps=1", "experiment.checkpoint_every_steps=10")


def test_an_a_a_pair_plants_its_tax_in_every_deterministic_step_and_is_labelled_a_calibration(tmp_path: Path) -> None:
    # How close a real run's estimate lands to the plant depends on the machine's load (the arms' unplanted speeds,
    # a wait's last overrun): benchmarks/calibration.py measures that, idle and loaded (docs/calibration.md). Here:
    # what holds on any machine.
    cfg = tiny_config(*CALIBRATED, "experiment.steps=30", "experiment.planted_tax=0.5")
    run_schedule(cfg, tmp_path)
    for name in ("baseline-0", "deterministic-0", "deterministic-1", "baseline-1", "deterministic-resumed"):
        manifest = json.loads((tmp_path / name / "manifest.json").read_text())
        assert manifest["policy"]["deterministic"] is False, name  # both arms on the baseline policy
    planted = [r["planted_s"] for r in step_records(tmp_path / "deterministic-1")]
    assert planted[0] > 0 and all(p > 0 for p in planted)  # every deterministic step, from the first one
    # A wait is inside the timed step: the step's time holds it.
    assert all(r["time_s"] >= r["planted_s"] for r in step_records(tmp_path / "deterministic-1"))
    assert all(r["planted_s"] == 0 for r in step_records(tmp_path / "baseline-1"))
    summary = analyse(tmp_path)
    assert summary.outcome == CALIBRATION and summary.exit_code == exit_codes.OK and not summary.deterministic_ok
    assert summary.tax.timed_runs == 4  # baseline-0, deterministic-0, deterministic-1, baseline-1
    # The report's and wandb's per-block tax are the rounds the estimate used: not the slow one after each commit.
    ratios = analyse_experiment(tmp_path).block_ratios
    assert len(ratios) == summary.tax.pairs and not {10, 20} & set(ratios.index)
    stored = json.loads((tmp_path / "summary.json").read_text())
    assert stored["planted_tax"] == 0.5 and stored["calibration"] is True and "planted +50.00%" in stored["headline"]


def _calibration_pair(planted: float, rounds: int, seed: int, cv: float = 0.03) -> dict[str, list[pd.DataFrame]]:
    """Step times of an A/A pair as experiment.interleave=all times it (two runs per arm, one step per block), where
    the truth is known exactly: every step's unplanted time is drawn from one law for both arms, a slow start and a
    drift shared by the round (the machine's state), and the deterministic steps wait `planted` x their own time."""
    rng = np.random.default_rng(seed)
    steps = np.arange(1, rounds + 1)
    machine = (1 + 0.3 * np.sin(steps / 7)) * np.where(steps <= 3, 2.5, 1.0)
    def run(factor: float) -> pd.DataFrame:
        time_s = 0.01 * machine * rng.lognormal(0, cv, rounds) * factor
        return pd.DataFrame({"step": steps, "rank": 0, "block": steps - 1, "time_s": time_s})

    return {"baseline": [run(1.0), run(1.0)], "deterministic": [run(1 + planted), run(1 + planted)]}


@pytest.mark.parametrize("planted", [0.0, 0.1, 0.5])
def test_the_estimator_recovers_a_planted_tax_whose_truth_is_known_exactly(planted: float) -> None:
    pair = _calibration_pair(planted, rounds=60, seed=7)
    tax = estimate_tax(pair["baseline"], pair["deterministic"], min_warmup=2)
    assert tax.warmup_steps >= 3  # the slow start is cut
    assert tax.low <= planted <= tax.high and tax.hl_low <= planted <= tax.hl_high
    assert tax.half_width < 0.02  # 3% step noise over 57 rounds of 4 runs


def test_the_estimators_interval_covers_the_planted_tax_as_often_as_it_says() -> None:
    covered = 0
    for seed in range(200):
        pair = _calibration_pair(0.1, rounds=30, seed=seed)
        tax = estimate_tax(pair["baseline"], pair["deterministic"], min_warmup=2, confidence=0.95)
        covered += tax.low <= 0.1 <= tax.high
    assert 0.90 <= covered / 200 <= 0.99  # 95% nominal; 200 draws: 95% +/- 3%


def _rule(steps: int, target: float, cap: int) -> StoppingRule:
    exp = tiny_config(*CALIBRATED, f"experiment.steps={steps}", f"experiment.target_half_width={target}",
                      f"experiment.max_steps={cap}", "experiment.warmup_steps=2").experiment
    return StoppingRule(exp, INTERLEAVED["all"], DistContext(0, 1, 0, torch.device("cpu"), "gloo"))


def _play(rule: StoppingRule, times: dict[str, list[pd.DataFrame]]) -> Stop:
    """Feed the rule one round after another, as the schedule does, until it stops."""
    frames = {"baseline-0": times["baseline"][0], "baseline-1": times["baseline"][1],
              "deterministic-0": times["deterministic"][0], "deterministic-1": times["deterministic"][1]}
    for step in range(1, len(frames["baseline-0"]) + 1):
        rule.add_round({name: [float(frame["time_s"].iloc[step - 1])] for name, frame in frames.items()})
        stop = rule.stop_after(step)
        if stop is not None:
            return stop
    raise AssertionError("the rule never stopped")


def test_a_precision_target_adds_rounds_until_the_interval_is_that_narrow() -> None:
    # 8 steps are 6 post-warmup rounds, fewer than MIN_ROUNDS: rounds are added however narrow the first look is.
    rule = _rule(steps=8, target=0.02, cap=2000)
    stop = _play(rule, _calibration_pair(0.1, rounds=2000, seed=3))
    assert stop.stopped_by == TARGET and stop.steps > 8 and stop.half_width is not None and stop.half_width <= 0.02
    assert stop.steps - 2 >= MIN_ROUNDS
    # It stopped on the analysis's own estimate of the rounds it had.
    times = _calibration_pair(0.1, rounds=2000, seed=3)
    upto = {arm: [f[f["step"] <= stop.steps] for f in runs] for arm, runs in times.items()}
    assert estimate_tax(upto["baseline"], upto["deterministic"], min_warmup=2).half_width == stop.half_width


def test_a_noisy_machine_stops_the_rounds_at_the_step_cap_and_says_so() -> None:
    stop = _play(_rule(steps=12, target=0.02, cap=40), _calibration_pair(0.1, rounds=2000, seed=3, cv=0.5))
    assert stop.stopped_by == CAP and stop.steps == 40 and stop.half_width is not None and stop.half_width > 0.02


def test_a_real_adaptive_schedule_records_the_stop_its_rule_took(tmp_path: Path) -> None:
    # Whether a real run reaches its target depends on the machine's noise; what it records must not.
    cfg = tiny_config(*CALIBRATED, "experiment.steps=8", "experiment.planted_tax=0.10",
                      "experiment.target_half_width=0.05", "experiment.max_steps=40")
    run_schedule(cfg, tmp_path)
    stop = json.loads((tmp_path / STOP_FILE).read_text())
    assert stop["steps"] > 8  # fewer than MIN_ROUNDS post-warmup rounds: rounds are added on any machine
    if stop["stopped_by"] == TARGET:
        assert stop["half_width"] <= 0.05
    else:
        assert stop["stopped_by"] == CAP and stop["steps"] == 40
    summary = analyse(tmp_path)
    assert summary.steps == stop["steps"] and summary.stopped_by == stop["stopped_by"] and not summary.problems
    # The analysis estimates from the records what the rule estimated from the same step times in the rounds.
    assert summary.tax.half_width == pytest.approx(stop["half_width"], rel=1e-9)
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
