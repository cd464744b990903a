"""plan=true: meta-device build, parameter count, per-GPU memory and layout validity, without any GPU."""

from __future__ import annotations

import os

import pytest
from helpers import compose_config, compose_typed, run_taxbench

from taxbench.config.schema import ActivationCheckpointing, ConfigError
from taxbench.design import ExperimentSteps, experiment_steps
from taxbench.parallel.gpu_hours import render_total
from taxbench.parallel.plan import GIB, GPU_MEMORY, cost_of, make_plan, render_plan

_cfg = compose_typed  # plan configs name more GPUs than local ranks, which validate() refuses by design


def test_moe_1t_is_a_trillion_parameters_and_fits_2432_gpus() -> None:
    plan = make_plan(_cfg("+recipe=moe_1t", "cluster.gpus=2432"))
    assert plan.valid, plan.problems
    assert abs(plan.total_params - 1e12) / 1e12 < 0.05
    assert plan.params_by_kind["experts"] > 0.9 * plan.total_params
    assert plan.active_params < 0.1 * plan.total_params  # top-8 of 256 experts
    assert plan.layout["dp"] == 152 and plan.layout["experts_per_rank"] == 32 and plan.layout["layers_per_stage"] == 4
    assert plan.memory is not None
    for part in ("weights", "grads", "optimizer", "activations"):
        assert getattr(plan.memory, part) > 0
    # FSDP shards parameters so weights are a small share.
    assert plan.memory.weights < 4 * 2**30


def test_moe_1t_recomputes_what_it_needs_to_fit_an_80gb_gpu() -> None:
    """The headline reads recipe.activation_checkpointing (moe_1t sets full); the alternatives show what it buys."""
    plan = make_plan(_cfg("+recipe=moe_1t", "cluster.gpus=2432"))
    none, selective, full = (plan.memory_by_mode[mode] for mode in ("none", "selective", "full"))
    assert plan.activation_checkpointing is ActivationCheckpointing.full and plan.memory is full
    assert full.activations < selective.activations < none.activations
    # Without recompute stage 0 (16 micro-batches in flight) is the heaviest; with full recompute the last stage's
    # logits outweigh the layer inputs.
    assert (none.stage, full.stage) == (0, 15)
    assert full.total < GPU_MEMORY["80 GB H100"] < selective.total < GPU_MEMORY["141 GB H200"] < none.total
    text = render_plan(plan)
    assert f"recipe.activation_checkpointing=full: {full.total / GIB:.1f} GiB on stage 15, fits an 80 GB H100" in text
    assert "full * (stage 15)" in text and "none (stage 0)" in text and "selective (stage 0)" in text


@pytest.mark.parametrize(("interleave", "models"), [("policy", 1), ("pair", 2), ("all", 4)])
def test_the_plan_prints_what_the_recipes_interleave_mode_holds(interleave: str, models: int) -> None:
    """moe_1t times one model (experiment.interleave=policy); the plan prints the memory of the mode in use."""
    overrides = ("+recipe=moe_1t", "cluster.gpus=2432") + (() if interleave == "policy" else
                                                           (f"experiment.interleave={interleave}",))
    plan = make_plan(_cfg(*overrides))
    assert plan.interleave == interleave and plan.memory is not None
    state = plan.memory.weights + plan.memory.grads + plan.memory.optimizer
    held = plan.memory.held(models)
    assert held == pytest.approx(models * state + plan.memory.activations)
    text = render_plan(plan)
    plural = "s" if models > 1 else ""
    assert f"experiment.interleave={interleave} holds {models} model{plural} at once, {held / GIB:.1f} GiB" in text
    if interleave == "policy":
        assert held == plan.memory.total  # one model: what the per-stage table shows


@pytest.mark.parametrize("mode", list(ActivationCheckpointing))
def test_the_headline_follows_the_recipes_recompute_setting(mode: ActivationCheckpointing) -> None:
    plan = make_plan(_cfg("+recipe=moe_1t", "cluster.gpus=2432", f"recipe.activation_checkpointing={mode.value}"))
    assert plan.memory is plan.memory_by_mode[mode] and plan.memory.recompute is mode
    assert f"recipe.activation_checkpointing={mode.value}: {plan.memory.total / GIB:.1f} GiB" in render_plan(plan)
    assert f"{mode.value} * (stage {plan.memory.stage})" in render_plan(plan)
    if mode is ActivationCheckpointing.none:
        assert "fits neither an 80 GB H100 nor a 141 GB H200" in render_plan(plan)


def test_dense_recompute_estimates_are_ordered() -> None:
    plan = make_plan(_cfg("+recipe=dense_tiny", "cluster.gpus=1"))
    assert plan.valid, plan.problems
    memory = plan.memory_by_mode
    assert memory["full"].activations < memory["selective"].activations < memory["none"].activations
    assert plan.memory is memory["none"]  # dense_tiny keeps the default


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
        (["recipe.parallel.pp=3", "cluster.gpus=2304"], "n_layers=64 is not divisible by pp * virtual_stages"),
        (["recipe.parallel.ep=48", "cluster.gpus=768", "recipe.global_batch_size=48"], "n_experts=256"),
    ],
)
def test_invalid_layouts_are_named(overrides: list[str], message: str) -> None:
    plan = make_plan(_cfg("+recipe=moe_1t", *overrides))
    assert not plan.valid
    assert any(message in problem for problem in plan.problems), plan.problems
    assert plan.memory is None and not plan.memory_by_mode


@pytest.mark.slow  # over 10 s: a real multi-process or CLI run (the fast tier stays under 8 min)
def test_plan_command_prints_and_exits_without_launching(tmp_path) -> None:
    ok = run_taxbench("+recipe=moe_1t", "cluster.gpus=2432", "plan=true", f"experiment.out_dir={tmp_path}",
                      cwd=tmp_path, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "985,328,009,216" in ok.stdout and "layout: valid" in ok.stdout and "optimizer" in ok.stdout
    assert "recipe.activation_checkpointing=full" in ok.stdout
    assert not [path for path in tmp_path.rglob("*") if path.is_file()]  # nothing launched (Hydra's empty run dir)
    bad = run_taxbench("+recipe=moe_1t", "cluster.gpus=2400", "plan=true", cwd=tmp_path, timeout=120)
    assert bad.returncode == 2
    assert "layout: INVALID" in bad.stdout and "pick ep dividing 150" in bad.stdout
    assert "does not fit cluster.gpus=2400" in bad.stderr
    assert "without cluster.gpus" not in ok.stderr + bad.stderr


def test_a_plan_without_cluster_gpus_says_it_plans_for_the_default(tmp_path) -> None:
    result = run_taxbench("+recipe=moe_1t", "plan=true", cwd=tmp_path, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines()[0] == ("taxbench: warning: plan=true without cluster.gpus: planning for the "
                                             "default 8 GPUs; set cluster.gpus=N for your cluster")
    assert "recipe moe_1t on 8 GPUs" in result.stdout


@pytest.mark.skipif((os.cpu_count() or 1) >= 16, reason="this machine has a core per rank of a moe_1t replica")
def test_moe_1t_on_cpu_is_called_a_gpu_cluster_recipe_with_the_plan_and_the_dry_run(tmp_path) -> None:
    """cluster.gpus means nothing on CPU: the error must not send the user there, but to the plan or a Slurm job."""
    result = run_taxbench("+recipe=moe_1t", f"experiment.out_dir={tmp_path / 'runs'}", cwd=tmp_path, timeout=120)
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.splitlines()) == 1
    assert result.stderr.startswith("taxbench: error: recipe moe_1t is a GPU-cluster recipe: one model replica spans "
                                    "tp*pp = 16 ranks")
    assert "`+recipe=moe_1t cluster.gpus=N plan=true`" in result.stderr
    assert "`cluster=slurm cluster.gpus=N cluster.dry_run=true`" in result.stderr
    assert not (tmp_path / "runs").exists()


def test_a_layout_that_does_not_fit_cpu_ranks_names_cluster_cpu_ranks() -> None:
    with pytest.raises(ConfigError, match=r"world size 3 is not divisible by tp\*pp = 2\*1 = 2; change "
                                          r"cluster.cpu_ranks or"):
        compose_config("recipe.parallel.tp=2", "recipe.model.n_heads=4", "cluster.cpu_ranks=3")


def test_torchtitans_own_model_is_not_planned_but_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match="recipe titan_llama3_debug is torchtitan's own model") as info:
        make_plan(compose_typed("+recipe=titan_llama3_debug"))
    assert "\n" not in str(info.value)


def test_the_seeds_recipe_as_nvidia_runs_it_plans_within_an_h100_and_says_what_it_assumes() -> None:
    """megatron_moe_1t: bf16 parameters, fp32 gradient buffers, Megatron's distributed optimizer (6 + 12/d bytes per
    parameter); the pair's two models fit an H200 and the plan names the one-model schedule for an H100."""
    plan = make_plan(_cfg("+recipe=megatron_moe_1t", "cluster.gpus=2432"))
    assert plan.valid and plan.memory is not None and plan.state is not None and plan.state.sharded
    assert plan.memory.total < GPU_MEMORY["80 GB H100"] < 80 * GIB
    assert plan.memory.weights == 2 * plan.memory.params and plan.memory.grads == 4 * plan.memory.params
    # sharded over dp=152 (dense) and edp=19 (experts): between 12/152 and 12/19 bytes per parameter held
    assert 12 / 152 * plan.memory.params < plan.memory.optimizer < 12 / 19 * plan.memory.params
    text = render_plan(plan)
    assert "fits neither" not in text
    assert "6 + 12/d bytes per parameter" in text and "assumes:" in text
    assert "holds 2 models at once" in text and "fits a 141 GB H200, not an 80 GB H100" in text
    assert "on an 80 GB H100 the experiment fits one model at a time" in text
    assert "whole runs alternated A B B A" in text and "taxbench run" in text
    assert "GPU-hours" in text and "cluster.planned_mfu" in text


def test_without_the_distributed_optimizer_every_rank_holds_megatrons_18_bytes_per_parameter() -> None:
    sharded = make_plan(_cfg("+recipe=megatron_moe_1t", "cluster.gpus=2432"))
    whole = make_plan(_cfg("+recipe=megatron_moe_1t", "cluster.gpus=2432",
                           "recipe.model.stack.use_distributed_optimizer=false",
                           "recipe.model.stack.params_dtype=fp32"))
    assert whole.memory is not None and sharded.memory is not None and whole.state is not None
    assert not whole.state.sharded and whole.state.per_param(152) == 16  # fp32 params, fp32 grads: 16
    state = whole.memory.weights + whole.memory.grads + whole.memory.optimizer
    assert state == pytest.approx(16 * whole.memory.params)
    assert "fits neither" in render_plan(whole)  # the seed's plan before: 153.9 GiB
    assert sharded.state is not None and sharded.state.per_param(8) == pytest.approx(6 + 12 / 8)


def test_the_plan_costs_the_whole_experiment_at_the_assumed_mfu() -> None:
    """Runs and steps from the experiment design; wall clock = steps x model FLOPs / (gpus x peak x MFU)."""
    base = ("+recipe=megatron_moe_1t", "cluster.gpus=2432", "experiment.steps=100", "experiment.gate_steps=40",
            "experiment.warmup_steps=10")
    plan = make_plan(_cfg(*base))
    hours = plan.hours
    assert hours is not None
    steps = hours.steps
    assert (steps.timed_runs, steps.gate_runs, steps.total, steps.in_tax) == (2, 3, 2 * 100 + 3 * 40, 2 * 90)
    assert hours.timed_share == pytest.approx(200 / 320)
    m = plan.cfg.recipe.model if plan.cfg else None
    assert m is not None
    tokens = 3648 * 4096
    per_token = 6 * (plan.active_params - m.vocab_size * m.d_model) + 12 * m.n_layers * m.seq_len * m.d_model
    assert hours.flops_per_step == pytest.approx(per_token * tokens)
    assert hours.wall_s == pytest.approx(320 * per_token * tokens / (2432 * 989e12 * 0.35))
    assert hours.gpu_hours == pytest.approx(hours.wall_s * 2432 / 3600)
    text = render_plan(plan)
    assert f"{hours.gpu_hours:,.0f} GPU-hours" in text and "timed: 200 of 320 steps (62% of the GPU-hours)" in text
    assert "MFU 35% (cluster.planned_mfu, an assumption" in text
    halved = make_plan(_cfg(*base, "cluster.planned_mfu=0.175")).hours
    assert halved is not None and halved.gpu_hours == pytest.approx(2 * hours.gpu_hours)
    every = make_plan(_cfg(*base, "experiment.interleave=all")).hours
    assert every is not None and (every.steps.timed_runs, every.steps.gate_runs) == (4, 1)
    capped = make_plan(_cfg(*base, "experiment.target_half_width=0.005", "experiment.max_steps=300"))
    assert "may add rounds up to 300 steps per timed run" in render_plan(capped)


def test_an_mfu_outside_zero_to_one_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match=r"cluster.planned_mfu=1.5 must be in \(0, 1\]"):
        compose_config("cluster.planned_mfu=1.5")


def test_stacks_and_layouts_launches_are_costed_in_one_line() -> None:
    """`taxbench stacks` and `taxbench layouts` print their runs, steps, timed share and, on GPUs, GPU-hours."""
    cfg = _cfg("+recipe=moe_tiny", "cluster.device=cuda", "cluster.gpus=2")
    steps = experiment_steps(cfg)
    hours = cost_of(cfg)
    assert hours is not None and hours.steps == steps
    line = render_total("plan: 2 cells", [steps, steps], [hours, hours], on_gpu=True)
    assert line.startswith(f"plan: 2 cells: {2 * steps.runs} runs, {2 * steps.total:,} steps in all, "
                           f"{2 * steps.timed:,} timed")
    assert f"{2 * hours.gpu_hours:.3g} GPU-hours of steps at an assumed MFU of 35% (cluster.planned_mfu)" in line
    repeats = ExperimentSteps(0, 8, 2, 8, 0, 0, 0)
    layout = cost_of(cfg, repeats)
    assert layout is not None and layout.steps.total == 16 and layout.timed_share == 0
    assert layout.wall_s == pytest.approx(16 * hours.step_s)
    titan = _cfg("+recipe=titan_llama3_debug", "cluster.device=cuda", "cluster.gpus=1")
    assert cost_of(titan) is None and cost_of(titan, params=1_000_000) is not None  # counted on its own size
    assert render_total("plan: 1 cells", [steps], [None], on_gpu=False).endswith("GPU-hours do not apply on CPU")
