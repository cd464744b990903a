"""experiment.interleave=policy: one model whose policy switches per block times both arms, the gate runs run whole one
after another, the experiment never holds more than one model, and a crash in the rounds continues bitwise."""

from __future__ import annotations

import gc
import json
import weakref
from pathlib import Path

import pytest
import torch
from helpers import Crash, crash_after, fingerprints, one_rank, run_schedule, step_records, tiny_config

from analysis.summary import analyse
from taxbench.checkpoint.store import RunCheckpoints
from taxbench.config.schema import TaxbenchConfig
from taxbench.design import ALL_RUNS, INTERLEAVED
from taxbench.schedule import experiment as schedule
from taxbench.train.trainer import Trainer

LANES = INTERLEAVED["policy"]


def policy_config(*extra: str) -> TaxbenchConfig:
    return tiny_config("experiment.interleave=policy", *extra, name="policy")


@pytest.fixture
def models_alive(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many trainers (models) were alive each time the schedule built one."""
    alive: weakref.WeakSet[Trainer] = weakref.WeakSet()
    counts: list[int] = []

    class Counted(Trainer):
        def __init__(self, *args, **kwargs) -> None:
            gc.collect()
            super().__init__(*args, **kwargs)
            alive.add(self)
            counts.append(len(alive))

    monkeypatch.setattr(schedule, "Trainer", Counted)
    return counts


def test_one_model_times_both_arms_and_the_gate_runs_run_whole_one_at_a_time(tmp_path: Path,
                                                                              models_alive: list[int]) -> None:
    cfg = policy_config()
    root = tmp_path / "policy"
    root.mkdir()
    run_schedule(cfg, root)

    # One trainer for the rounds, then one per whole run (4) and two for the resumed run: never two alive.
    assert len(models_alive) == 1 + 4 + 2 and max(models_alive) == 1, models_alive
    baseline, deterministic = (step_records(root / ref.name) for ref in LANES)
    for lane in (baseline, deterministic):
        assert [r["step"] for r in lane] == list(range(1, 13))  # each arm takes experiment.steps steps
    # The model's steps are the two lanes' blocks taken in turn, in the A B B A order: every model step once.
    trajectory = sorted((r["trajectory_step"], r["arm"]) for r in baseline + deterministic)
    assert [step for step, _ in trajectory] == list(range(1, 25))
    arms_by_block = [trajectory[i][1] for i in range(0, 24, 3)]
    assert arms_by_block in (["baseline", "deterministic", "deterministic", "baseline"] * 2,
                             ["deterministic", "baseline", "baseline", "deterministic"] * 2)
    # Each round holds one block of each arm (the tax pairs them by block).
    assert sorted({r["block"] for r in baseline}) == sorted({r["block"] for r in deterministic}) == [0, 1, 2, 3]
    assert all(RunCheckpoints(root / ref.name, 0).finished for ref in LANES)
    manifest = json.loads((root / LANES[1].name / "manifest.json").read_text())
    assert manifest["timing"]["shared_model"] == sorted(ref.name for ref in LANES)

    summary = analyse(root)
    assert summary.exit_code == 0, summary.problems
    assert summary.tax.pairs > 0 and summary.steps == 12 and summary.to_dict()["interleave"] == "policy"
    # The pure deterministic runs are untouched by the shared model: the gates compare them as always.
    assert {v.gate: v.agree for v in summary.verdicts} == {
        "repeatability": True, "restart_replay": True, "baseline_sanity": True}


def test_a_crash_in_the_rounds_continues_from_the_shared_checkpoint_bitwise(tmp_path: Path) -> None:
    cfg = policy_config()
    reference_root, root = tmp_path / "reference", tmp_path / "crashed"
    reference_root.mkdir()
    root.mkdir()
    run_schedule(cfg, reference_root)

    with pytest.raises(Crash):  # in the third round: two rounds of 2 x 3 steps committed step 6 of each lane
        run_schedule(cfg, root, crash_after(12 + 4))
    # The shared model's checkpoints go to the first lane's folder only (one model, one checkpoint).
    assert RunCheckpoints(root / LANES[0].name, 0).complete() == [3, 6]
    assert not list((root / LANES[1].name).glob("checkpoints/step*"))
    run_schedule(cfg, root)
    for ref in (*LANES, *ALL_RUNS):
        assert fingerprints(root / ref.name) == fingerprints(reference_root / ref.name), ref.name


def test_the_shared_model_switches_its_kernels_with_the_lane(tmp_path: Path) -> None:
    cfg = policy_config("recipe.model.kind=moe", "recipe.model.n_experts=4", "recipe.model.top_k=2")
    root = tmp_path / "kernels"
    seen: list[tuple[str, bool]] = []
    with one_rank(cfg) as ctx:
        experiment = schedule.Experiment(cfg, ctx, root)
        trainer = experiment._shared_trainer(LANES)
        moe = next(m for m in trainer.raw_model.parts[0].modules() if hasattr(m, "deterministic_kernels"))
        moe.register_forward_hook(lambda module, *_: seen.append((trainer.arm, module.deterministic_kernels)))
        for ref in (*LANES, LANES[0]):
            trainer.run_block(1, 0, lane=ref.name)
        trainer.close()
    wanted = {ref.arm: cfg.arms[ref.arm].deterministic_kernels for ref in LANES}
    assert wanted["baseline"] != wanted["deterministic"]
    assert {arm for arm, _ in seen} == {"baseline", "deterministic"}
    assert all(flag == wanted[arm] for arm, flag in seen), seen
    assert torch.are_deterministic_algorithms_enabled() is False  # the lanes' flags do not leak out of a block
