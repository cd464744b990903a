"""Baseline equivalence: the deterministic loss curve against the baseline pair's run-to-run noise, step by step."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy.signal import lfilter

from taxbench import exit_codes
from taxbench.analysis.document import HTML_FILE, MARKDOWN_FILE
from taxbench.analysis.equivalence import (
    ALL_IDENTICAL,
    DIFFERS,
    EQUIVALENT,
    IDENTICAL_BASELINES,
    NOISE,
    NOT_EVALUATED,
    NOT_JUDGED,
    REQUIRED_SHARE,
    compare_loss_curves,
)
from taxbench.analysis.report import EQUIVALENCE_PNG, write_experiment_report
from taxbench.analysis.summary import analyse_experiment
from taxbench.analysis.synthetic import SyntheticExperiment, change_config, write_experiment

STEPS = 200


def loss_curves(seed: int, offset: float = 0.0, correlation: float = 0.7,
                noise: tuple[float, float] = (1e-3, 2e-2)) -> tuple[pd.Series, pd.Series, pd.Series, np.ndarray]:
    """baseline-0, baseline-1 and deterministic losses per step, and the per-run noise sigma(t).

    Every run sees the same batches (a falling curve with a large batch-to-batch term shared by all runs); each run
    adds its own trajectory noise, AR(1)-correlated between steps and growing over training as runs part."""
    rng = np.random.default_rng(seed)
    steps = np.arange(1, STEPS + 1)
    shared = 3 + 2 * np.exp(-steps / 40) + 0.2 * rng.standard_normal(STEPS)
    sigma = np.geomspace(*noise, STEPS)

    def run() -> np.ndarray:
        innovation = np.sqrt(1 - correlation**2)
        return shared + sigma * lfilter([innovation], [1, -correlation], rng.standard_normal(STEPS))

    b0, b1, d = run(), run(), run() + offset
    return pd.Series(b0, index=steps), pd.Series(b1, index=steps), pd.Series(d, index=steps), sigma


# ---------------------------------------------------------------------------------------------------- the statistic
@pytest.mark.parametrize("correlation", [0.0, 0.7])
def test_a_deterministic_curve_that_is_one_more_baseline_draw_is_equivalent(correlation: float) -> None:
    verdicts = [compare_loss_curves(*loss_curves(seed, correlation=correlation)[:3], from_step=10)
                for seed in range(100)]
    assert all(v.verdict == EQUIVALENT and v.statistic >= REQUIRED_SHARE for v in verdicts)
    first = verdicts[0]
    assert first.n_steps == STEPS - 10 and first.steps[0] == 11 and first.basis == NOISE
    assert first.describe().startswith("equivalent within baseline noise: ")


def test_an_offset_or_a_divergence_beyond_the_baseline_noise_differs() -> None:
    for seed in range(20):
        b0, b1, d, sigma = loss_curves(seed)
        offset = compare_loss_curves(b0, b1, d + 4 * sigma, from_step=10)
        assert offset.verdict == DIFFERS and offset.statistic < REQUIRED_SHARE
    diverging = d + np.where(d.index > 120, 0.002 * (d.index - 120), 0.0)  # fine until step 120, then drifts away
    result = compare_loss_curves(b0, b1, diverging, from_step=10)
    assert result.verdict == DIFFERS
    assert result.inside[result.steps <= 120].all() and not result.inside[result.steps > 160].any()


def test_one_outlying_step_does_not_fail_the_curve() -> None:
    b0, b1, d, _ = loss_curves(3)
    spiked = d.copy()
    spiked[100] += 1.0  # a loss spike in the deterministic run alone
    result = compare_loss_curves(b0, b1, spiked, from_step=10)
    unspiked = compare_loss_curves(b0, b1, d, from_step=10)
    assert result.verdict == EQUIVALENT and not result.inside[result.steps == 100].any()
    assert int((~result.inside).sum()) == int((~unspiked.inside).sum()) + 1


def test_the_band_follows_the_noise_step_by_step_not_pooled() -> None:
    """An offset smaller than the late noise but far beyond the early noise fails: pooling the whole run's spread
    would hide it behind the late steps."""
    b0, b1, d, sigma = loss_curves(5, noise=(1e-3, 1e-1))
    offset = float(np.median(sigma))
    pooled_gap = float(np.sqrt(np.mean(np.square(b1 - b0))))
    assert 3 * offset < 3 * pooled_gap  # within a band pooled over the run
    result = compare_loss_curves(b0, b1, d + offset, from_step=10)
    assert result.verdict == DIFFERS
    assert not result.inside[result.steps <= 40].any() and result.inside[result.steps > 100].all()


def test_identical_baselines_use_the_relative_floor() -> None:
    steps = np.arange(1, 41)
    baseline = pd.Series(5.0 / np.sqrt(steps), index=steps)
    same = compare_loss_curves(baseline, baseline.copy(), baseline.copy(), from_step=2)
    assert same.verdict == EQUIVALENT and same.basis == ALL_IDENTICAL and same.statistic == 1.0
    assert same.describe() == f"{EQUIVALENT}: {ALL_IDENTICAL} (38 steps)"
    close = compare_loss_curves(baseline, baseline, baseline * (1 + 2e-6), from_step=2)  # summation-order noise
    assert close.verdict == EQUIVALENT and close.basis == IDENTICAL_BASELINES
    assert close.describe().endswith("; baseline runs bitwise identical: band is 0.01% of the loss")
    apart = compare_loss_curves(baseline, baseline, baseline * 1.01, from_step=2)
    # a band at its floor measures no noise: it cannot call the curve different (a passing CPU proxy run looks so)
    assert apart.verdict == NOT_JUDGED and apart.statistic == 0.0 and apart.basis == IDENTICAL_BASELINES
    assert apart.describe().startswith("not judged (baseline noise is zero here): 0 of 38 steps inside the band")
    assert apart.to_dict()["equivalent"] is False


def test_missing_or_broken_curves_are_not_evaluated_and_a_nan_deterministic_loss_differs() -> None:
    b0, b1, d, _ = loss_curves(7)
    short = compare_loss_curves(b0, b1, d[:12], from_step=10)
    assert short.verdict == NOT_EVALUATED and short.describe() == "not evaluated: only 2 steps after step 10 (needs 5)"
    assert np.isnan(short.statistic) and short.n_steps == 0
    broken = b1.copy()
    broken[50] = np.nan
    assert compare_loss_curves(b0, broken, d, from_step=10).basis == "baseline loss not finite at step 50"
    diverged = d.where(d.index < 100, np.nan)
    result = compare_loss_curves(b0, b1, diverged, from_step=10)
    assert result.verdict == DIFFERS and np.isinf(result.deviation[-1])
    stored = result.to_dict()  # the largest finite deviation, and the non-finite steps counted apart (never null)
    assert np.isfinite(stored["max_deviation"]) and stored["max_deviation_missing"] is None
    assert stored["first_nonfinite_step"] == 100 and stored["nonfinite_steps"] == int((d.index >= 100).sum())


# ------------------------------------------------------------------------------------------------ in the experiment
def test_summary_json_holds_equivalence_apart_from_the_bitwise_outcome(tmp_path: Path) -> None:
    noisy = SyntheticExperiment(ranks=2, steps=60, seed=2, loss_noise=0.01)
    summary = analyse_experiment(write_experiment(tmp_path / "noisy", noisy)).summary
    stored = json.loads((tmp_path / "noisy" / "summary.json").read_text())["equivalence"]
    assert stored["verdict"] == EQUIVALENT == summary.equivalence.verdict
    assert stored["n_steps"] == 60 - noisy.warmup_steps and stored["threshold"] == REQUIRED_SHARE
    assert stored["runs"] == ["baseline-0", "baseline-1", "deterministic-0"] and stored["statistic"] >= 0.95

    offset = SyntheticExperiment(ranks=2, steps=60, seed=2, loss_noise=0.01, loss_offset=0.2)
    shifted = analyse_experiment(write_experiment(tmp_path / "offset", offset)).summary
    assert shifted.equivalence.verdict == DIFFERS
    assert shifted.deterministic_ok and shifted.exit_code == exit_codes.OK  # statistical: never a bitwise gate


def test_incomplete_runs_are_not_evaluated_and_a_calibration_pair_still_is(tmp_path: Path) -> None:
    root = write_experiment(tmp_path / "exp", SyntheticExperiment(ranks=2, steps=30, block_steps=3, seed=4,
                                                                  loss_noise=0.01))
    change_config(root, lambda config: config["experiment"].update(calibration=True))
    calibration = analyse_experiment(root).summary
    assert calibration.outcome == "calibration" and calibration.equivalence.verdict == EQUIVALENT

    (root / "baseline-1" / "steps.rank1.jsonl").unlink()
    incomplete = analyse_experiment(root).summary
    assert incomplete.outcome == "incomplete" and incomplete.equivalence.verdict == NOT_EVALUATED
    assert incomplete.equivalence.basis.startswith("incomplete records: baseline-1 rank 1: no steps.rank1.jsonl")
    stored = json.loads((root / "summary.json").read_text())["equivalence"]
    assert stored["verdict"] == NOT_EVALUATED and stored["statistic"] is None and stored["median_band"] is None



def test_report_shows_the_equivalence_under_where_the_tax_goes(tmp_path: Path) -> None:
    spec = SyntheticExperiment(ranks=2, steps=30, block_steps=3, seed=2, loss_noise=0.01, loss_offset=0.03)
    root = write_experiment(tmp_path / "exp", spec)
    out = write_experiment_report(analyse_experiment(root)).parent
    page = (out / HTML_FILE).read_text()
    headings = [page.index(h) for h in ("<h2>Bitwise gates</h2>", "<h2>Determinism tax</h2>",
                                        "<h2>Where the tax goes</h2>", "<h3>Baseline equivalence</h3>")]
    assert headings == sorted(headings)
    after = page.find("<h2>", headings[2] + 1)
    section = page[headings[2]:after if after >= 0 else len(page)]
    assert "differs beyond baseline noise" in section and "data:image/png;base64," in section
    assert f"]({EQUIVALENCE_PNG})" in (out / MARKDOWN_FILE).read_text()
    assert (out / EQUIVALENCE_PNG).read_bytes().startswith(b"\x89PNG\r\n\x1a\n")

    (root / "deterministic-0" / "steps.rank0.jsonl").unlink()
    write_experiment_report(analyse_experiment(root))
    markdown = (out / MARKDOWN_FILE).read_text()
    assert "not evaluated: incomplete records: deterministic-0 rank 0" in markdown
    assert EQUIVALENCE_PNG not in markdown
