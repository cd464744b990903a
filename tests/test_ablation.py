"""Per-knob ablation: which arms run on which device, that each differs from its pair arm in one knob only, that
the rounds stay carryover-balanced with knob arms beside the pair, and what an ablation experiment reports."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from itertools import pairwise
from pathlib import Path

import pytest
from helpers import compose_config, run_schedule, tiny_config

from taxbench import exit_codes
from taxbench.analysis.summary import analyse
from taxbench.config.schema import ConfigError, Device
from taxbench.design import KNOBS, MEASURED, RunRef, knob_of, knob_policies, plan_ablation, round_orders
from taxbench.rundir.records import steps_file


def pair_policies():
    cfg = compose_config("experiment.name=x")
    return cfg.arms


def test_on_cpu_only_the_knobs_that_act_there_get_arms() -> None:
    plans = {p.knob.name: p for p in plan_ablation(pair_policies(), Device.cpu)}
    assert plans["deterministic_algorithms"].with_status == MEASURED
    assert plans["deterministic_kernels"].with_status == MEASURED
    for name in ("tf32_off", "cudnn_benchmark_off", "nccl_algo"):
        assert plans[name].with_status == plans[name].without_status == "no-op on cpu"
        assert plans[name].with_run is None and plans[name].without_runs == ()
    # The deterministic mode leaves fill_uninitialized_memory off, as the baseline does.
    assert plans["fill_uninitialized_memory"].with_status == "same in both policies"


def test_on_cuda_the_cuda_knobs_get_arms_and_fill_alone_is_a_no_op() -> None:
    arms = pair_policies()
    arms["deterministic"] = dataclasses.replace(arms["deterministic"], fill_uninitialized_memory=True)
    plans = {p.knob.name: p for p in plan_ablation(arms, Device.cuda)}
    for name in ("tf32_off", "cudnn_benchmark_off", "nccl_algo"):
        assert plans[name].with_status == plans[name].without_status == MEASURED
    fill = plans["fill_uninitialized_memory"]
    assert fill.with_status == "no-op alone (acts only with deterministic=true)"
    assert fill.without_status == MEASURED  # left out of the deterministic policy, where it does act


def test_the_nccl_knob_switches_a_tree_with_its_pins() -> None:
    arms = compose_config("mode@arms.deterministic=deterministic_tree").arms
    plan = next(p for p in plan_ablation(arms, Device.cuda) if p.knob.name == "nccl_algo")
    assert plan.with_status == plan.without_status == MEASURED
    pinned = ("Ring;allreduce:Tree", "Simple", 1)
    assert (plan.with_policy.nccl_algo, plan.with_policy.nccl_proto, plan.with_policy.nccl_channels) == pinned
    assert (plan.without_policy.nccl_algo, plan.without_policy.nccl_proto, plan.without_policy.nccl_channels) == (
        None, None, None)
    cpu = next(p for p in plan_ablation(arms, Device.cpu) if p.knob.name == "nccl_algo")
    assert cpu.with_status == cpu.without_status == "no-op on cpu"  # gloo reads no NCCL variable


@pytest.mark.parametrize("device", [Device.cpu, Device.cuda])
def test_every_knob_arm_differs_from_its_pair_arm_in_that_knob_only(device: Device) -> None:
    arms = pair_policies()
    plans = plan_ablation(arms, device)
    policies = knob_policies(plans)
    assert policies  # something runs on either device
    for plan in plans:
        runs = [(plan.with_run, arms["baseline"]), *((r, arms["deterministic"]) for r in plan.without_runs)]
        for ref, source in runs:
            if ref is None:
                continue
            policy = policies[ref.arm]
            changed = {f.name for f in dataclasses.fields(policy)
                       if getattr(policy, f.name) != getattr(source, f.name)}
            differing = {f for f in plan.knob.fields
                         if getattr(arms["baseline"], f) != getattr(arms["deterministic"], f)}
            assert changed == {"name", *differing} and differing, (ref, changed)
            assert knob_of(ref.arm) == (ref.arm.split("_", 1)[0], plan.knob.name)
    assert knob_of("baseline") is None and knob_of("with_nothing") is None


def test_knob_arms_keep_the_rounds_carryover_balanced() -> None:
    pair = [RunRef("baseline", "0"), RunRef("deterministic", "0"), RunRef("deterministic", "1"),
            RunRef("baseline", "1")]
    for knobs in (1, 2):  # an odd and an even number of runs
        runs = pair + [RunRef(f"with_{k.name}", "0") for k in KNOBS[:knobs]]
        n = len(runs)
        cycle = 2 * n if n % 2 else n
        orders = round_orders(3, runs, 2 * cycle)
        assert all(sorted(map(str, order)) == sorted(map(str, runs)) for order in orders)
        positions = Counter((ref, i) for order in orders[:cycle] for i, ref in enumerate(order))
        assert set(positions.values()) == {cycle // n}  # every run in every position equally often
        follows = Counter(pair_ for order in orders[:cycle] for pair_ in pairwise(order))
        assert len(follows) == n * (n - 1) and len(set(follows.values())) == 1  # every run after every other alike


def test_the_pair_alone_keeps_its_a_b_b_a_rounds() -> None:
    pair = [RunRef("baseline", "0"), RunRef("deterministic", "0"), RunRef("deterministic", "1"),
            RunRef("baseline", "1")]
    for order in round_orders(0, pair, 8):
        arms = [ref.arm for ref in order]
        assert arms[0] == arms[3] != arms[1] == arms[2]


def test_ablation_of_a_calibration_pair_is_refused() -> None:
    with pytest.raises(ConfigError, match="experiment.ablation=true with experiment.calibration=true"):
        compose_config("experiment.name=x", "experiment.ablation=true", "experiment.calibration=true")


def test_an_ablation_experiment_reports_knobs_top_ops_and_equivalence(tmp_path: Path) -> None:
    cfg = tiny_config("experiment.ablation=true", "experiment.profile_steps=2")
    run_schedule(cfg, tmp_path)
    for name in ("with_deterministic_kernels-0", "without_deterministic_kernels-1", "deterministic-profile"):
        assert (tmp_path / name / "steps.rank0.jsonl").exists(), name
    assert not (tmp_path / "with_tf32_off-0").exists()  # a no-op on CPU gets no arm
    manifest = json.loads((tmp_path / "with_deterministic_kernels-0" / "manifest.json").read_text())
    assert manifest["knob"] == {"direction": "with", "name": "deterministic_kernels",
                                "fields": ["deterministic_kernels"]}
    assert manifest["policy"]["deterministic_kernels"] is True and manifest["policy"]["deterministic"] is False
    summary = analyse(tmp_path)
    assert summary.exit_code == exit_codes.OK and not summary.problems
    stored = json.loads((tmp_path / "summary.json").read_text())
    knobs = {k["knob"]: k for k in stored["ablation"]}
    assert knobs["deterministic_kernels"]["cost_status"] == MEASURED
    assert knobs["deterministic_kernels"]["tax"]["pairs"] > 0
    assert knobs["deterministic_kernels"]["needed"] is False  # on CPU the pair's other knob keeps it repeatable
    assert knobs["tf32_off"]["cost_status"] == "no-op on cpu" and knobs["tf32_off"]["tax"] is None
    assert set(stored["attribution"]) == {"deterministic", "with_deterministic_algorithms",
                                          "with_deterministic_kernels"}
    assert stored["attribution"]["deterministic"]["ops"]  # profiled ops, by growth
    assert stored["equivalence"]["verdict"]


def test_a_lost_knob_replica_is_incomplete_evidence_not_a_knob_that_is_not_needed(tmp_path: Path) -> None:
    cfg = tiny_config("experiment.ablation=true", "experiment.profile_steps=1", "experiment.warmup_steps=0")
    run_schedule(cfg, tmp_path)  # no warmup: the profile runs profile from their first step
    steps_file(tmp_path / "without_deterministic_kernels-1", 0).unlink()
    (tmp_path / "baseline-profile" / "ops.rank0.json").write_text("{}")
    summary = analyse(tmp_path)
    assert summary.exit_code == exit_codes.INCOMPLETE
    knob = next(k for k in summary.ablation if k.knob == "deterministic_kernels")
    assert knob.needed is None and knob.problems
    assert any("baseline-profile" in line for line in summary.problems) and not summary.attribution
