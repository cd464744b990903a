"""plan=true: meta-device build, parameter count, per-GPU memory and layout validity, without any GPU."""

from __future__ import annotations

import pytest
from conftest import compose_typed, run_taxbench

from taxbench.plan import make_plan

_cfg = compose_typed  # plan configs name more GPUs than local ranks, which validate() refuses by design


def test_moe_1t_is_a_trillion_parameters_and_fits_2432_gpus() -> None:
    plan = make_plan(_cfg("+recipe=moe_1t", "cluster.gpus=2432"))
    assert plan.valid, plan.problems
    assert abs(plan.total_params - 1e12) / 1e12 < 0.05
    assert plan.params_by_kind["experts"] > 0.9 * plan.total_params
    assert plan.active_params < 0.1 * plan.total_params  # top-8 of 256 experts
    assert plan.layout["dp"] == 152 and plan.layout["experts_per_rank"] == 32 and plan.layout["layers_per_stage"] == 4
    assert plan.memory is not None and plan.memory_recompute is not None
    for part in ("weights", "grads", "optimizer", "activations"):
        assert getattr(plan.memory, part) > 0
    # Full recomputation keeps fewer activations; FSDP shards parameters so weights are a small share.
    assert plan.memory_recompute.activations_recompute < plan.memory.activations
    assert plan.memory.weights < 4 * 2**30


def test_fsdp_and_expert_parallel_shrink_what_a_rank_holds() -> None:
    sharded = make_plan(_cfg("+recipe=moe_1t", "cluster.gpus=2432"))
    replicated = make_plan(_cfg("+recipe=moe_1t", "cluster.gpus=2432", "recipe.parallel.data_parallel=ddp"))
    assert replicated.memory is not None and sharded.memory is not None
    assert replicated.memory.params > 10 * sharded.memory.params
    # ddp: a stage holds 4 of 64 layers with 32 of 256 experts each, plus whole attention and embeddings
    assert replicated.total_params / 16 / 8 < replicated.memory.params < 1.1e10


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["cluster.gpus=2400"], "not divisible by recipe.parallel.ep=8"),
        (["cluster.gpus=2048", "recipe.parallel.tp=3"], "not divisible by tp*pp"),
        (["recipe.parallel.tp=3", "cluster.gpus=2448"], "n_heads=64 is not divisible by recipe.parallel.tp=3"),
        (["recipe.parallel.pp=3", "cluster.gpus=2304"], "n_layers=64 is not divisible by recipe.parallel.pp=3"),
        (["recipe.parallel.ep=48", "cluster.gpus=768", "recipe.global_batch_size=48"], "n_experts=256"),
    ],
)
def test_invalid_layouts_are_named(overrides: list[str], message: str) -> None:
    plan = make_plan(_cfg("+recipe=moe_1t", *overrides))
    assert not plan.valid
    assert any(message in problem for problem in plan.problems), plan.problems
    assert plan.memory is None


def test_plan_command_prints_and_exits_without_launching(tmp_path) -> None:
    ok = run_taxbench("+recipe=moe_1t", "cluster.gpus=2432", "plan=true", f"experiment.out_dir={tmp_path}",
                      cwd=tmp_path, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "985,328,009,216" in ok.stdout and "layout: valid" in ok.stdout and "optimizer" in ok.stdout
    assert not [path for path in tmp_path.rglob("*") if path.is_file()]  # nothing launched (Hydra's empty run dir)
    bad = run_taxbench("+recipe=moe_1t", "cluster.gpus=2400", "plan=true", cwd=tmp_path, timeout=120)
    assert bad.returncode == 2
    assert "layout: INVALID" in bad.stdout and "pick ep dividing 150" in bad.stdout
    assert "does not fit cluster.gpus=2400" in bad.stderr
