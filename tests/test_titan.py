"""Foreign training stacks: torchtitan end to end on CPU (gloo), its determinism switch against taxbench's policy, and
the clean refusal when torchtitan is not installed (Megatron-Core: tests/test_megatron.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from helpers import compose_config, compose_raw, compose_typed, localize_planted_op, one_rank

from taxbench.config.schema import ConfigError, Device
from taxbench.preflight import prepare
from taxbench.runtime import determinism


def _has_torchtitan() -> bool:
    try:
        import torchtitan.trainer  # noqa: F401
    except ImportError:
        return False
    return True


needs_titan = pytest.mark.skipif(not _has_torchtitan(), reason="needs taxbench[titan]")


def _one_line_refusal(result) -> str:
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_a_titan_recipe_without_torchtitan_is_refused_in_one_line_naming_the_extra(tmp_path: Path,
                                                                                    taxbench_cli) -> None:
    shadow = tmp_path / "shadow" / "torchtitan"  # an import of torchtitan that fails as a missing package does
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError(\"No module named 'torchtitan'\")\n")
    result = taxbench_cli("+recipe=titan_llama3_debug", f"experiment.out_dir={tmp_path}", cwd=tmp_path, timeout=120,
                          env={"PYTHONPATH": str(tmp_path / "shadow")})
    line = _one_line_refusal(result)
    assert "taxbench[titan]" in line and "torchtitan==0.3.0" in line


@needs_titan
def test_torchtitans_switch_conflicting_with_the_policy_is_refused_before_launch() -> None:
    with pytest.raises(ConfigError, match="fill_uninitialized_memory=false .* has true"):
        prepare(compose_raw("+recipe=titan_llama3_debug", "arms.deterministic.fill_uninitialized_memory=true"))
    with pytest.raises(ConfigError, match="deterministic_warn_only"):
        prepare(compose_raw("+recipe=titan_llama3_debug", "+recipe.model.stack.deterministic_warn_only=true"))


@needs_titan
@pytest.mark.parametrize(("overrides", "refusal"), [
    (("recipe.model.n_layers=4", "recipe.parallel.pp_schedule=Interleaved1F1B", "recipe.parallel.virtual_stages=2"),
     "recipe.parallel.virtual_stages=2: torchtitan's pipeline_llm is driven with one stage per rank"),
    (("recipe.model.stack.attn_backend=flex",), "attn_backend=flex needs attention masks"),
])
def test_what_torchtitans_pipeline_is_not_driven_with_is_refused_before_launch(overrides: tuple[str, ...],
                                                                              refusal: str) -> None:
    with pytest.raises(ConfigError, match=refusal) as info:
        prepare(compose_raw("+recipe=titan_llama3_pp", "cluster.cpu_ranks=2", *overrides))
    assert "\n" not in str(info.value)


@needs_titan
def test_a_recipe_names_torchtitans_own_job_config_and_the_manifest_records_what_it_gives() -> None:
    from taxbench.stacks.registry import stack_for

    cfg = prepare(compose_raw("+recipe=titan_llama3_pp", "cluster.cpu_ranks=2"))
    record = stack_for(cfg.recipe.model).switch(cfg.recipe, cfg.arms["deterministic"])
    assert record["job"][:4] == ["--module", "llama3", "--config", "llama3_debugmodel"]
    assert record["model"] == "llama3 debugmodel" and record["spmd_backend"] == "partial_dtensor"
    assert "AdamW" in record["optimizer"] and "'lr': 0.0008" in record["optimizer"]  # the job's, not the recipe's
    assert "warmup_steps=2" in record["lr_scheduler"] and record["lr_scheduler.steps"] == 10000
    assert record["set_by_taxbench"] == {"debug.seed": cfg.recipe.seed, "debug.deterministic": True}


@needs_titan
@pytest.mark.parametrize(("overrides", "refusal"), [
    (("recipe.parallel.pp=1",), "job config has --parallelism.pipeline_parallel_degree 2 but recipe.parallel.pp=1; "
     "the pair must agree: set --parallelism.pipeline_parallel_degree 1 in recipe.model.stack.job"),
    (("recipe.precision=bf16",), "--training.mixed_precision_param float32 but recipe.precision=bf16"),
    (("recipe.model.seq_len=32",), "--training.seq_len 64 but recipe.model.seq_len=32"),
    (("recipe.optimizer.grad_clip=0.5",), "--training.max_norm 1.0 but recipe.optimizer.grad_clip=0.5"),
    (("recipe.micro_batch_size=1", "recipe.global_batch_size=2"),
     "--parallelism.pipeline_parallel_microbatch_size 2 but recipe.micro_batch_size=1"),
    (("recipe.parallel.data_parallel=ddp",), "(fsdp) but recipe.parallel.data_parallel=ddp"),
    (("+recipe.model.stack.family=llama3",), "recipe.model.stack.family comes from recipe.model.stack.job"),
    (("recipe.model.stack.job=[--module,llama3,--config,nope]",), "Config function 'nope' not found"),
    (("recipe.model.stack.job=[--module,llama3,--config,llama3_debugmodel,--training.bogus,3]",),
     "Unrecognized options: --training.bogus, 3"),
    (("recipe.model.stack.job='--module llama3 --config llama3_debugmodel --training.disable_cuda_graphs "
      "--parallelism.pipeline_parallel_degree 2'",),
     "job config has activation_checkpoint:selective but recipe.activation_checkpointing=none; the pair must agree: "
     "set activation_checkpoint:none in recipe.model.stack.job, or recipe.activation_checkpointing=selective"),
])
def test_where_the_job_config_and_the_recipe_disagree_the_pair_is_refused_in_one_line(
        overrides: tuple[str, ...], refusal: str) -> None:
    with pytest.raises(ConfigError) as info:
        prepare(compose_raw("+recipe=titan_llama3_pp", "cluster.cpu_ranks=2", *overrides))
    assert refusal in str(info.value) and "\n" not in str(info.value)


@needs_titan
def test_a_ddp_recipe_pairs_with_an_unsharded_job_also_at_dp_1() -> None:
    """pp=2 on 2 ranks leaves dp=1: an unsharded job (shard degree 1, replicate degree 1) is the recipe's ddp."""
    *flags, subcommand = (str(w) for w in compose_typed("+recipe=titan_llama3_pp").recipe.model.stack["job"])
    job = [*flags, "--parallelism.data_parallel_shard_degree", "1", "--parallelism.data_parallel_replicate_degree", "1",
           subcommand]  # tyro reads the flags before the activation_checkpoint subcommand
    cfg = prepare(compose_raw("+recipe=titan_llama3_pp", "cluster.cpu_ranks=2", "recipe.parallel.data_parallel=ddp",
                              f"recipe.model.stack.job=[{','.join(job)}]"))
    assert str(cfg.recipe.parallel.data_parallel) == "ddp"


@needs_titan
@pytest.mark.slow
def test_torchtitans_activation_checkpointing_keeps_module_names_and_gradients_bitwise() -> None:
    """recipe.activation_checkpointing=full|selective wraps each block in torchtitan's FullAC / SelectiveAC: the
    modules and parameters keep their names (faults, traces and records use them) and one step's gradients are
    those without recompute, bit for bit."""
    from taxbench.stacks.titan import TitanStack

    grads = {}
    for ac in ("none", "full", "selective"):
        cfg = compose_config("+recipe=titan_llama3_debug", "cluster=inprocess", f"recipe.activation_checkpointing={ac}")
        with one_rank(cfg) as ctx:
            built = TitanStack().build(cfg.recipe, cfg.arms["deterministic"], ctx, 1)
            wrapped = [n for n, _ in built.parts.parts[0].named_modules() if "_checkpoint_wrapped_module" in n]
            assert bool(wrapped) == (ac != "none")  # torchtitan's wrappers are there ...
            names = {n for n, _ in built.parts.named_modules()}
            assert "layers.1.feed_forward.w1" in names and not [n for n in names if "_checkpoint" in n]  # ... unnamed
            tokens = torch.randint(0, 2048, (2, 65), generator=torch.Generator().manual_seed(1))
            built.executor.run([(tokens[:, :-1], tokens[:, 1:])])
            grads[ac] = {n: p.grad.to_local().clone() for n, p in built.parts.named_parameters()}
    for ac in ("full", "selective"):
        assert grads[ac].keys() == grads["none"].keys()
        assert all(torch.equal(grads[ac][name], grads["none"][name]) for name in grads["none"]), ac


@needs_titan
@pytest.mark.parametrize(("steps", "run"), [
    (("experiment.steps=60",), 60),
    (("experiment.steps=20", "experiment.target_half_width=0.01", "experiment.max_steps=40"), 40),  # a target's cap
])
def test_a_job_whose_lr_schedule_ends_before_a_run_is_refused_before_launch(steps: tuple[str, ...], run: int) -> None:
    job = ONE_RANK_JOB[2].replace("--training.steps,100", "--training.steps,30")
    with pytest.raises(ConfigError) as info:
        prepare(compose_raw("+recipe=titan_llama3_pp", ONE_RANK_JOB[0], "cluster.cpu_ranks=1", job,
                            "experiment.warmup_steps=1", "experiment.resume_step=5", *steps))
    assert str(info.value) == (f"torchtitan's job config has --training.steps 30 but a run of this experiment trains "
                               f"up to {run} steps, past the end of its LR schedule; set --training.steps {run} (or "
                               "more) in recipe.model.stack.job, or lower experiment.steps")
    prepare(compose_raw("+recipe=titan_llama3_pp", ONE_RANK_JOB[0], "cluster.cpu_ranks=1", job,
                        "experiment.steps=30", "experiment.warmup_steps=1", "experiment.resume_step=5"))


# llama3_debugmodel as torchtitan's CLI takes it, at pp=1 on one in-process rank (titan_llama3_pp's job otherwise).
ONE_RANK_JOB = ("recipe.parallel.pp=1", "cluster=inprocess",
                "recipe.model.stack.job=[--module,llama3,--config,llama3_debugmodel,--parallelism.spmd_backend,"
                "partial_dtensor,--training.seq_len,64,--training.local_batch_size,4,--training.mixed_precision_param,"
                "float32,--training.steps,100,activation_checkpoint:none]")


@needs_titan
@pytest.mark.slow
def test_torchtitans_optimizer_and_lr_schedule_are_checkpointed_and_resume_bitwise(tmp_path: Path) -> None:
    """The job's OptimizersContainer (AdamW, lr 8e-4) and warmup-stable-decay schedule train; the checkpoint holds
    their state (Adam's moments by parameter name, the schedule's step); a fresh build restored from it takes the
    next step bit for bit as the uninterrupted one."""
    from torch.distributed.checkpoint import FileSystemReader
    from torchtitan.components.optimizer import OptimizersContainer

    from taxbench.checkpoint import state as checkpoint_state
    from taxbench.stacks.titan import TitanStack

    cfg = compose_config("+recipe=titan_llama3_pp", *ONE_RANK_JOB)
    tokens = torch.randint(0, 2048, (3, 4, 65), generator=torch.Generator().manual_seed(1))

    def step(built, optimizer, i: int) -> None:
        optimizer.zero_grad()
        built.executor.run([(tokens[i, :, :-1], tokens[i, :, 1:])])
        optimizer.step()

    def trained(steps: int, restore: Path | None = None):
        stack = TitanStack()
        built = stack.build(cfg.recipe, cfg.arms["deterministic"], ctx, 1)
        optimizer = stack.optimizer(cfg.recipe, built)
        if restore is not None:
            checkpoint_state.load(restore, built.parallel, optimizer, 0, ctx.device)
        for i in range(steps):
            step(built, optimizer, i if restore is None else 2 + i)
        return built, optimizer

    with one_rank(cfg) as ctx:
        built, optimizer = trained(2)
        assert isinstance(optimizer, OptimizersContainer)
        assert [g["lr"] for g in optimizer.optimizers[0].param_groups] == [8e-4]  # warmup (2 steps) done
        checkpoint_state.save(tmp_path, built.parallel, optimizer, {"step": 2}, 0)
        step(built, optimizer, 2)
        uninterrupted = {n: p.to_local().clone() for n, p in built.parts.named_parameters()}
        resumed_built, resumed = trained(1, restore=tmp_path)
    keys = FileSystemReader(str(tmp_path)).read_metadata().state_dict_metadata
    assert {"optimizer.state.layers.1.feed_forward.w1.weight.exp_avg", "optimizer.state.layers.1.feed_forward.w1.weight"
            ".exp_avg_sq", "optimizer.state.layers.1.feed_forward.w1.weight.step"} <= set(keys)
    assert torch.load(tmp_path / "rank0.pt")["lr_scheduler"]["last_epoch"] == 2
    assert resumed.lr_scheduler.state_dict()["last_epoch"] == 3
    params = {n: p.to_local() for n, p in resumed_built.parts.named_parameters()}
    assert all(torch.equal(params[name], uninterrupted[name]) for name in uninterrupted)


@needs_titan
def test_the_meta_model_has_torchtitans_module_paths() -> None:
    from taxbench.stacks.registry import stack_for

    cfg = prepare(compose_raw("+recipe=titan_moe_debug"))
    names = {name for name, _ in stack_for(cfg.recipe.model).meta_model(cfg.recipe).named_modules()}
    assert {"layers.1.attention.wkv_a", "layers.1.moe.router.gate", "layers.1.moe.routed_experts"} <= names


def _process_state() -> dict[str, object]:
    """What a titan build could leave changed: the environment, torch's flags and generator, torchtitan's device
    globals and FlexAttention's class-wide kernel."""
    from torchtitan.distributed import parallel_dims, utils
    from torchtitan.models.common import token_dispatcher
    from torchtitan.models.common.attention import FlexAttention
    from torchtitan.tools import utils as tools_utils

    modules = (tools_utils, parallel_dims, utils, token_dispatcher)
    return {"env": dict(os.environ), "flags": determinism.applied_state(Device.cpu),
            "rng": torch.get_rng_state().tolist(),
            "devices": [(m.__name__, getattr(m, "device_type", None), getattr(m, "device_module", None))
                        for m in modules],
            "flex": (FlexAttention._compiled_flex_attn, dict(FlexAttention.inductor_configs))}


@needs_titan
def test_building_titan_twice_in_one_process_leaves_it_as_found_and_builds_the_same_model() -> None:
    from taxbench.stacks.titan import TitanStack

    cfg = compose_config("+recipe=titan_llama3_debug", "cluster=inprocess")
    weights = []
    with one_rank(cfg) as ctx:
        for _ in range(2):
            torch.manual_seed(1234)
            before = _process_state()
            built = TitanStack().build(cfg.recipe, cfg.arms["deterministic"], ctx, 1)
            after = _process_state()
            assert after == before, {key: (before[key], after[key]) for key in before if before[key] != after[key]}
            weights.append({name: p.to_local().clone() for name, p in built.parts.parts[0].named_parameters()})
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[0])


@needs_titan
def test_the_layouts_weights_digest_holds_torchtitans_moe_router_bias() -> None:
    from taxbench.parallel.logical_digest import gather_digest
    from taxbench.stacks.titan import TitanStack

    cfg = compose_config("+recipe=titan_moe_debug", "cluster=inprocess")
    with one_rank(cfg) as ctx:
        parts = TitanStack().build(cfg.recipe, cfg.arms["deterministic"], ctx, 1).parts.parts
        digest = gather_digest(parts, 0, 1)
        assert digest is not None and digest.model is not None, digest
        bias = [name for name in digest.buffers if name.endswith(".moe.expert_bias_E")]
        assert bias and not [name for name in digest.buffers if "tokens_per_expert" in name]  # not persistent
        parts[0].get_buffer(bias[0]).add_(0.25)  # what torchtitan's load-balancing hook does every step
        moved = gather_digest(parts, 0, 1)
    assert moved is not None and moved.model != digest.model and moved.parameters == digest.parameters


def _six_step_pair(taxbench_cli, tmp_path: Path, recipe: str, name: str) -> dict[str, str]:
    """The recipe's pair end to end, 6 steps with a restart at step 3: the gates' outcomes (it passed)."""
    result = taxbench_cli(f"+recipe={recipe}", "experiment.steps=6", "experiment.warmup_steps=1",
                          "experiment.resume_step=3", "experiment.checkpoint_every_steps=3", "report.wandb=false",
                          f"experiment.out_dir={tmp_path}", f"experiment.name={name}", cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / name / "summary.json").read_text())
    assert summary["outcome"] == "passed"
    return {v["gate"]: v["outcome"] for v in summary["verdicts"]}


@needs_titan
@pytest.mark.slow
def test_titan_llama3_runs_the_pair_end_to_end_and_passes_the_gates(tmp_path: Path, taxbench_cli) -> None:
    outcomes = _six_step_pair(taxbench_cli, tmp_path, "titan_llama3_debug", "titan")
    assert outcomes["repeatability"] == outcomes["restart_replay"] == "identical"
    manifest = json.loads((tmp_path / "titan" / "deterministic-0" / "manifest.json").read_text())
    assert manifest["stack_switch"]["stack"] == "torchtitan"
    assert manifest["stack_switch"]["debug.deterministic"] is True
    assert manifest["policy_applied"]["use_deterministic_algorithms"] is True


@needs_titan
@pytest.mark.slow
def test_titan_llama3_split_by_pipeline_llm_runs_end_to_end_and_passes_the_gates(tmp_path: Path, taxbench_cli) -> None:
    """torchtitan's own job config (llama3_debugmodel with its CLI overrides), its pipeline_llm splitting the model
    into 2 stages on 2 gloo ranks, torch's 1F1B schedule, torchtitan's optimizer and LR schedule: every gate
    identical, each rank holds (and fingerprints) a different stage, both record the same loss."""
    outcomes = _six_step_pair(taxbench_cli, tmp_path, "titan_llama3_pp", "titanpp")
    assert outcomes["repeatability"] == outcomes["restart_replay"] == outcomes["baseline_sanity"] == "identical"
    run = tmp_path / "titanpp" / "deterministic-0"
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["layout"]["pp"] == 2
    switch = manifest["stack_switch"]
    assert switch["job"][:4] == ["--module", "llama3", "--config", "llama3_debugmodel"]
    assert "AdamW" in switch["optimizer"] and "LRSchedulersContainer" in switch["lr_scheduler"]
    first, second = ([json.loads(line) for line in (run / f"steps.rank{rank}.jsonl").read_text().splitlines()]
                     for rank in (0, 1))
    assert [r["loss_bits"] for r in first] == [r["loss_bits"] for r in second]
    assert all(a["params"] != b["params"] for a, b in zip(first, second, strict=True))  # two different stages


@needs_titan
@pytest.mark.slow
def test_localize_names_a_fault_planted_inside_a_torchtitan_module(tmp_path: Path) -> None:
    from taxbench.commands.localize import NAMED

    result = localize_planted_op(tmp_path, "titan_llama3_debug", "layers.1.feed_forward.w1")
    assert result.verdict == NAMED
    origin = result.origin
    assert origin is not None
    assert (origin.kind, origin.scope, origin.rank, origin.step) == ("op", "layers.1.feed_forward.w1", 1, 2)


def test_taxbench_own_workloads_are_the_harness_stack_and_stack_options_need_a_foreign_stack() -> None:
    from taxbench.stacks.native import HarnessStack
    from taxbench.stacks.registry import stack_for

    cfg = prepare(compose_raw())
    stack = stack_for(cfg.recipe.model)
    assert isinstance(stack, HarnessStack)
    assert {name for name, _ in stack.meta_model(cfg.recipe).named_modules()} >= {"blocks.0", "blocks.1"}
    with pytest.raises(ConfigError,
                       match="recipe.model.stack is read for recipe.model.kind=titan, megatron or deepspeed only"):
        prepare(compose_raw("+recipe.model.stack={family: llama3}"))
