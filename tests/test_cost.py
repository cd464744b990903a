"""What an experiment pays for: gate-only runs take experiment.gate_steps (and analysis holds them to that, no more and
no less), and checkpoints are taken by time, recorded where the tax can leave out the step after each."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from helpers import Crash, compose_config, crash_after, fingerprints, run_schedule, step_records, tiny_config

from analysis.summary import analyse
from analysis.wandb_log import summary_values
from taxbench.analysis.cost import STARTUP_PARTS
from taxbench.config.schema import ConfigError
from taxbench.design import ALL_RUNS, INTERLEAVED, RESUMED
from taxbench.launchers.local import launch_inprocess
from taxbench.parallel.distributed import DistContext
from taxbench.rundir.records import steps_file
from taxbench.rundir.stop_file import STOP_FILE
from taxbench.schedule.checkpoint_clock import UNTIMED_STRETCH_BLOCKS, CheckpointClock
from taxbench.schedule.cost import STARTED_ENV

TIMED_PAIR = {ref.name for ref in INTERLEAVED["pair"]}


def test_gate_only_runs_take_gate_steps_and_analysis_holds_them_to_it(tmp_path: Path) -> None:
    cfg = tiny_config("experiment.interleave=pair", "experiment.gate_steps=9")
    run_schedule(cfg, tmp_path)
    for ref in ALL_RUNS:
        wanted = 12 if ref.name in TIMED_PAIR else 9
        assert [r["step"] for r in step_records(tmp_path / ref.name)] == list(range(1, wanted + 1)), ref.name

    summary = analyse(tmp_path)
    assert summary.exit_code == 0 and not summary.problems, summary.problems
    compared = {v.gate: v.compared_steps for v in summary.verdicts}
    assert compared == {"repeatability": 9, "restart_replay": 3, "baseline_sanity": 9}  # replay: steps 7-9
    # Where the wall clock went: every part measured, and the parts add up to it.
    split = summary.to_dict()["cost_split"]
    assert split is not None and summary.to_dict()["gate_steps"] == 9
    assert all(value >= 0 for value in split["seconds"].values())
    assert split["seconds"]["timed_steps"] > 0 and split["seconds"]["checkpoints"] > 0
    assert sum(split["seconds"].values()) == pytest.approx(split["wall_s"])
    # The startup's parts, command -> rank process -> process group -> schedule -> first timed step, add up to it.
    assert list(split["startup_s"]) == list(STARTUP_PARTS) and all(v >= 0 for v in split["startup_s"].values())
    assert sum(split["startup_s"].values()) == pytest.approx(split["seconds"]["startup"])
    values = summary_values(summary)  # and wandb's summary keys
    assert values["wall_clock/timed_steps"] == pytest.approx(split["share"]["timed_steps"])

    # Fail closed still: a gate-only run missing its last step is incomplete, not a shorter pass.
    records = steps_file(tmp_path / "deterministic-1", 0)
    records.write_text("".join(records.read_text().splitlines(keepends=True)[:-1]))
    summary = analyse(tmp_path)
    assert summary.exit_code == 4 and any("deterministic-1" in line for line in summary.problems), summary.problems


def test_a_later_in_process_launch_counts_its_startup_from_its_own_start(tmp_path: Path) -> None:
    cfg = tiny_config("experiment.steps=3", "experiment.resume_step=1", "experiment.checkpoint_every_steps=0")
    launch_inprocess(cfg, tmp_path / "first")  # this process's first launch counts from the process's start
    before = time.time()
    launch_inprocess(cfg, tmp_path / "second")
    cost = json.loads((tmp_path / "second" / "cost.json").read_text())
    assert before <= cost["started_unix"] <= cost["rank_started_unix"] <= cost["process_group_unix"]
    assert STARTED_ENV not in os.environ  # the launch's start does not outlive it


def test_checkpoints_by_time_are_recorded_and_a_continue_keeps_them(tmp_path: Path) -> None:
    # Any time at all is "long enough": every block boundary of the rounds commits (none at their end).
    cfg = tiny_config("experiment.checkpoint_every_steps=0", "experiment.checkpoint_every_s=1e-9")
    reference, crashed = tmp_path / "reference", tmp_path / "crashed"
    run_schedule(cfg, reference)
    assert json.loads((reference / STOP_FILE).read_text())["commits"] == [3, 6, 9]

    with pytest.raises(Crash):  # in the fourth round of four runs: steps 3, 6 and 9 were committed
        run_schedule(cfg, crashed, crash_after(4 * 9 + 2))
    run_schedule(cfg, crashed)
    assert json.loads((crashed / STOP_FILE).read_text())["commits"] == [3, 6, 9]
    for ref in ALL_RUNS:
        assert fingerprints(crashed / ref.name) == fingerprints(reference / ref.name), ref.name
    summary = analyse(crashed)
    assert summary.exit_code == 0 and not summary.problems, summary.problems


def test_without_checkpoints_the_resumed_run_still_restarts_at_resume_step(tmp_path: Path) -> None:
    cfg = tiny_config("experiment.checkpoint_every_steps=0", "experiment.checkpoint_every_s=0")
    run_schedule(cfg, tmp_path)
    assert json.loads((tmp_path / STOP_FILE).read_text())["commits"] == []
    summary = analyse(tmp_path)
    assert summary.exit_code == 0 and {v.gate: v.compared_steps for v in summary.verdicts}["restart_replay"] == 6


def test_untimed_runs_go_in_stretches_that_end_where_a_commit_or_their_end_falls(tmp_path: Path) -> None:
    ctx = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    by_steps = CheckpointClock(tiny_config("experiment.checkpoint_every_steps=7").experiment, ctx)
    stretch = UNTIMED_STRETCH_BLOCKS * 2
    assert by_steps.next_decision(0, 2, 1000) == 8  # the block holding step 7 ends at 8
    assert by_steps.next_decision(8, 2, 1000) == 14
    assert by_steps.next_decision(14, 2, 1000) == min(22, stretch) and by_steps.next_decision(stretch, 2, 1000) == 22
    by_time = CheckpointClock(tiny_config("experiment.checkpoint_every_steps=0").experiment, ctx)
    assert by_time.next_decision(0, 2, 1000) == stretch and by_time.next_decision(3, 2, 1000) == stretch
    assert by_time.next_decision(stretch, 2, stretch + 5) == stretch + 5  # the run's end, or resume_step
    # Run in stretches, the gate-only run's records still name each step's block, as block by block.
    run_schedule(tiny_config("experiment.block_steps=3", "experiment.steps=12", "experiment.resume_step=6",
                             "experiment.checkpoint_every_steps=0", "experiment.checkpoint_every_s=0"), tmp_path)
    records = step_records(tmp_path / RESUMED.name)
    assert [(r["step"], r["block"]) for r in records] == [(s, (s - 1) // 3) for s in range(1, 13)]


@pytest.mark.parametrize(("override", "expected"), [
    ("experiment.gate_steps=20 experiment.resume_step=20",
     "experiment.resume_step=20 must be below experiment.gate_steps=20"),
    ("experiment.gate_steps=-1", "experiment.gate_steps=-1 must be >= 0"),
    ("experiment.checkpoint_every_s=-5", "experiment.checkpoint_every_s=-5.0 must be >= 0"),
    ("experiment.gate_steps=30 experiment.fault.enabled=true experiment.fault.step=40",
     "experiment.fault.step=40 is past the gates' experiment.gate_steps=30"),
])
def test_gate_and_checkpoint_settings_that_cannot_work_are_refused(override: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected.replace("[", r"\[").replace(".", r"\.")):
        compose_config("experiment.name=x", *override.split())
