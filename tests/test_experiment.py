"""End to end through `python -m taxbench` with real gloo processes: gates, fault detection, manifests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from taxbench.analysis.records import load_run

pytestmark = pytest.mark.slow

SMALL = ["experiment.steps=24", "experiment.block_steps=6", "experiment.warmup_steps=2", "experiment.resume_step=12"]


def run(taxbench_cli, tmp_path: Path, name: str, *extra: str):
    result = taxbench_cli(*SMALL, f"experiment.out_dir={tmp_path}", f"experiment.name={name}", *extra,
                          cwd=tmp_path, timeout=600, env={"COLUMNS": "200"})
    return result, tmp_path / name


def test_two_rank_experiment_passes_the_gates_and_reports_the_tax(taxbench_cli, tmp_path: Path) -> None:
    result, root = run(taxbench_cli, tmp_path, "clean")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "95% CI [" in result.stdout and "baseline" in result.stdout and "deterministic" in result.stdout
    assert result.stdout.count("bitwise identical") == 3
    summary = json.loads((root / "summary.json").read_text())
    assert summary["deterministic_ok"] is True
    gates = {v["gate"]: v for v in summary["verdicts"]}
    assert gates["repeatability"]["agree"] and gates["repeatability"]["compared_steps"] == 24
    assert gates["restart_replay"]["agree"] and gates["restart_replay"]["compared_steps"] == 12
    tax = summary["tax"]
    assert tax["low"] <= tax["tax"] <= tax["high"] and tax["pairs"] >= 3

    for run_name in ("baseline-0", "deterministic-0", "deterministic-1", "deterministic-resumed", "baseline-1"):
        frame = load_run(root / run_name)
        assert sorted(frame["rank"].unique()) == [0, 1]
        assert list(frame.groupby("rank")["step"].apply(list)[0]) == list(range(1, 25))
    manifest = json.loads((root / "deterministic-0" / "manifest.json").read_text())
    assert manifest["policy_applied"]["use_deterministic_algorithms"] is True
    assert manifest["policy_applied"]["env"]["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert manifest["layout"]["world_size"] == 2 and manifest["layout"]["backend"] == "gloo"
    assert manifest["stack"]["torch"] and len(manifest["stack"]["ranks"]) == 2
    baseline_manifest = json.loads((root / "baseline-0" / "manifest.json").read_text())
    assert baseline_manifest["policy_applied"]["use_deterministic_algorithms"] is False
    # Both timed arms were interleaved in blocks: each has records in every block.
    blocks = load_run(root / "baseline-0")["block"].unique()
    assert sorted(blocks) == [0, 1, 2, 3]


def test_flipped_parameter_bit_is_caught_at_its_step_rank_and_metric(taxbench_cli, tmp_path: Path) -> None:
    result, root = run(taxbench_cli, tmp_path, "faulty", "experiment.fault.enabled=true", "experiment.fault.step=3",
                       "experiment.fault.rank=1", "experiment.fault.replica=1")
    assert result.returncode == 3, result.stderr[-3000:]
    summary = json.loads((root / "summary.json").read_text())
    gates = {v["gate"]: v for v in summary["verdicts"]}
    mismatch = gates["repeatability"]["first_mismatch"]
    assert (mismatch["step"], mismatch["rank"], mismatch["metric"]) == (3, 1, "params")
    assert gates["restart_replay"]["agree"]
    assert "step 3, rank 1, params" in result.stdout
    assert summary["deterministic_ok"] is False


def test_inprocess_launcher_runs_one_rank(taxbench_cli, tmp_path: Path) -> None:
    result, root = run(taxbench_cli, tmp_path, "single", "cluster=inprocess")
    assert result.returncode == 0, result.stderr[-3000:]
    assert list(load_run(root / "deterministic-0")["rank"].unique()) == [0]


def test_existing_results_are_never_overwritten(taxbench_cli, tmp_path: Path) -> None:
    (tmp_path / "taken" / "deterministic-0").mkdir(parents=True)
    result, _ = run(taxbench_cli, tmp_path, "taken")
    assert result.returncode == 2
    assert "already holds results" in result.stderr


def test_crashed_experiment_continues_without_losing_or_duplicating_records(taxbench_cli, tmp_path: Path) -> None:
    """SIGKILL the whole job in the middle of the schedule, then continue it: every run ends with each step exactly
    once per rank and all gates still agree bitwise."""
    args = ["experiment.steps=36", "experiment.block_steps=6", "experiment.warmup_steps=2", "experiment.resume_step=12",
            f"experiment.out_dir={tmp_path}", "experiment.name=crash", "report.wandb=false", "report.html=false"]
    root = tmp_path / "crash"
    victim = subprocess.Popen([sys.executable, "-m", "taxbench", *args], cwd=tmp_path, start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    repeat_records = root / "deterministic-1" / "steps.rank0.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and victim.poll() is None:
        if repeat_records.exists() and len(repeat_records.read_text().splitlines()) >= 8:
            break
        time.sleep(0.05)
    assert victim.poll() is None, "the run finished before it could be interrupted"
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()

    refused = taxbench_cli(*args, cwd=tmp_path, timeout=120)
    assert refused.returncode == 2 and "experiment.continue_existing=true" in refused.stderr
    changed = taxbench_cli(*args, "experiment.continue_existing=true", "experiment.steps=42", cwd=tmp_path, timeout=120)
    assert changed.returncode == 2 and "experiment.steps: was 36, now 42" in changed.stderr

    result = taxbench_cli(*args, "experiment.continue_existing=true", cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((root / "summary.json").read_text())
    assert summary["deterministic_ok"] and all(v["agree"] for v in summary["verdicts"])
    for run_name in ("baseline-0", "deterministic-0", "deterministic-1", "deterministic-resumed", "baseline-1"):
        frame = load_run(root / run_name)
        for rank in (0, 1):
            assert list(frame.loc[frame["rank"] == rank, "step"]) == list(range(1, 37)), (run_name, rank)
    attempts = {run: len(json.loads((root / run / "manifest.json").read_text())["attempts"])
                for run in ("deterministic-0", "deterministic-1", "deterministic-resumed")}
    assert attempts == {"deterministic-0": 1, "deterministic-1": 2, "deterministic-resumed": 1}
