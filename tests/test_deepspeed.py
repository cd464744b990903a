"""DeepSpeed as a training stack, on CPU gloo ranks: its engine at ZeRO-2 with its MoE layer at ep=2 and at ZeRO-3,
its own optimizer step and checkpoint, and its determinism switch (the documented equivalent on CPU, where its key
raises by design, and where the installed DeepSpeed has no key). Without DeepSpeed a recipe that needs it exits 2."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch.multiprocessing as mp
from helpers import (
    compose_config,
    compose_raw,
    compose_typed,
    has_deepspeed,
    localize_planted_fault,
    localize_planted_op,
    step_records,
)

from taxbench.config.schema import ConfigError
from taxbench.launchers.worker import rank_process
from taxbench.parallel.distributed import free_port
from taxbench.stacks import deepspeed as ds
from taxbench.train.trainer import RunSpec, Trainer

needs_deepspeed = pytest.mark.skipif(not has_deepspeed(), reason="needs taxbench[deepspeed]")


@pytest.mark.slow  # a CLI process that imports the stacks: about 10 s
def test_a_deepspeed_recipe_without_deepspeed_exits_2_with_the_install_line(tmp_path: Path, taxbench_cli) -> None:
    hidden = tmp_path / "no_deepspeed" / "deepspeed"  # an environment where `import deepspeed` fails
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('No module named deepspeed')\n")
    result = taxbench_cli("+recipe=deepspeed_moe_debug", f"experiment.out_dir={tmp_path}", cwd=tmp_path, timeout=120,
                          env={"PYTHONPATH": str(hidden.parent)})
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert "DS_BUILD_OPS=0 pip install 'taxbench[deepspeed]'" in lines[0]
    assert not list(tmp_path.rglob("manifest.json"))


@needs_deepspeed
def test_the_switch_records_that_the_documented_equivalent_was_applied_where_the_key_is_unknown() -> None:
    cfg = compose_typed("+recipe=deepspeed_moe_debug")
    stack = ds.DeepSpeedStack()
    on = stack.switch(cfg.recipe, cfg.arms["deterministic"])
    off = stack.switch(cfg.recipe, cfg.arms["baseline"])
    # Detected from DeepSpeed's config code: no release up to 0.19.8 reads the key.
    assert ds.knows_deterministic_mode() is False
    assert on["deterministic_mode"].startswith("documented equivalent (this DeepSpeed's config has no "
                                               "deterministic_mode key)")
    assert "deterministic_mode" not in on["config"]
    assert off["deterministic_mode"] is None
    assert on["zero_stage"] == 2 and on["moe"] == "deepspeed.moe.layer.MoE"
    assert on["config"]["optimizer"]["params"]["torch_adam"] is True


@needs_deepspeed
@pytest.mark.parametrize(("overrides", "refusal"), [
    (("+recipe.model.stack.offload=true",), "recipe.model.stack.offload is not a DeepSpeed option"),
    (("recipe.model.stack.zero_stage=4",), "zero_stage=4: choose 1, 2 or 3"),
    (("recipe.model.stack.zero_stage=0",), "zero_stage=0: choose 1, 2 or 3 (stage 0's engine reports no gradient"),
    (("recipe.model.stack.zero_stage=3",), "DeepSpeed's own MoE layer is not supported at ZeRO stage 3"),
    (("recipe.parallel.tp=2",), "recipe.parallel.tp=2, pp=1"),
    (("recipe.parallel.data_parallel=fsdp",), "shards with ZeRO"),
    (("recipe.model.top_k=3",), "top_k 1 or 2"),
    (("recipe.precision=fp8",), "recipe.precision=fp8 is not wired"),
])
def test_what_this_adapter_does_not_drive_is_refused_in_one_line(overrides: tuple[str, ...], refusal: str) -> None:
    cfg = compose_typed("+recipe=deepspeed_moe_debug", *overrides)
    with pytest.raises(ConfigError, match=refusal.replace("(", r"\(").replace("+", r"\+")) as info:
        ds.DeepSpeedStack().switch(cfg.recipe, cfg.arms["deterministic"])
    assert "\n" not in str(info.value)


@needs_deepspeed
@pytest.mark.parametrize(("config", "refusal"), [
    ("{zero_optimization:{stage:1}}", "zero_optimization.stage=1 but recipe.model.stack.zero_stage=3"),
    ("{train_batch_size:16}", "train_batch_size=16 but recipe.global_batch_size=8"),
    ("{train_micro_batch_size_per_gpu:1}", "train_micro_batch_size_per_gpu=1 but recipe.micro_batch_size=2"),
    ("{bf16:{enabled:true}}", "bf16.enabled=true but recipe.precision=fp32"),
    ("{fp16:{enabled:true}}", "fp16.enabled=true but recipe.precision=fp32"),
    ("{gradient_clipping:0.5}", "gradient_clipping=0.5 but recipe.optimizer.grad_clip=1.0"),
    ("{optimizer:{type:Adam}}", 'optimizer.type="Adam" but taxbench\'s optimizer (recipe.optimizer)=AdamW'),
    ("{optimizer:{params:{lr:0.1}}}", "optimizer.params.lr=0.1 but recipe.optimizer.lr=0.0003"),
    ("{deterministic_mode:true}", "DeepSpeed's switch is set per arm by taxbench"),
])
def test_a_users_key_that_the_recipe_decides_otherwise_is_refused_naming_both(config: str, refusal: str) -> None:
    cfg = compose_typed("+recipe=deepspeed_dense_debug", f"+recipe.model.stack.config={config}")
    with pytest.raises(ConfigError, match=re.escape(refusal)) as info:
        ds.DeepSpeedStack().switch(cfg.recipe, cfg.arms["baseline"])
    assert "\n" not in str(info.value)
    if "deterministic_mode" not in config:
        assert "the two disagree and neither is picked" in str(info.value)


@needs_deepspeed
@pytest.mark.parametrize(("overrides", "refusal"), [
    (("+recipe=deepspeed_moe_debug", "recipe.model.stack.zero_stage=3"),
     "DeepSpeed's own MoE layer is not supported at ZeRO stage 3"),
    (("+recipe=deepspeed_dense_debug", "+recipe.model.stack.config={zero_optimization:{stage:1}}"),
     "recipe.model.stack.config has zero_optimization.stage=1 but recipe.model.stack.zero_stage=3"),
])
def test_what_deepspeed_would_fail_on_in_a_rank_exits_2_before_launch(overrides: tuple[str, ...], refusal: str,
                                                                     tmp_path: Path, taxbench_cli) -> None:
    out_dir = tmp_path / "runs"
    result = taxbench_cli(*overrides, f"experiment.out_dir={out_dir}", cwd=tmp_path, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and refusal in lines[0], result.stderr[-2000:]
    assert not out_dir.exists()


@needs_deepspeed
def test_gradient_accumulation_is_checked_against_the_world_before_launch() -> None:
    from taxbench.preflight import prepare

    accumulation = "+recipe.model.stack.config={gradient_accumulation_steps:%d}"
    with pytest.raises(ConfigError, match=re.escape("gradient_accumulation_steps=4 but recipe.global_batch_size / "
                                                    "(recipe.micro_batch_size * dp)=2 (8 / (2 * 2))")):
        prepare(compose_raw("+recipe=deepspeed_dense_debug", accumulation % 4))
    prepare(compose_raw("+recipe=deepspeed_dense_debug", accumulation % 2))  # agrees with the recipe at 2 ranks


def _ds_config(tmp_path: Path) -> Path:
    """A user's ds_config.json as DeepSpeed users write them: nested keys taxbench also sets (its stage, its
    optimizer's params, Hugging Face's "auto"), and keys it does not."""
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({
        "train_batch_size": "auto", "gradient_clipping": "auto",
        "zero_optimization": {"stage": 1, "overlap_comm": True, "reduce_bucket_size": 5e7},
        "optimizer": {"params": {"torch_adam": True}},
        "steps_per_print": 1000,
    }))
    return path


@needs_deepspeed
def test_a_ds_config_json_path_is_deep_merged_over_taxbenchs_config(tmp_path: Path) -> None:
    path = _ds_config(tmp_path)
    cfg = compose_typed("+recipe=deepspeed_dense_debug", "~recipe.model.stack.zero_stage",
                        f"+recipe.model.stack.config={path}")
    record = ds.DeepSpeedStack().switch(cfg.recipe, cfg.arms["deterministic"])
    config = record["config"]
    assert record["zero_stage"] == 1  # the recipe names no stage: the user's, not taxbench's default
    assert config["zero_optimization"] == {"stage": 1, "overlap_comm": True, "reduce_bucket_size": 5e7}
    assert config["optimizer"] == {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                                               "weight_decay": 0.1, "torch_adam": True}}
    assert config["gradient_clipping"] == 1.0 and config["steps_per_print"] == 1000  # "auto": the recipe's
    with pytest.raises(ConfigError, match=re.escape("zero_optimization.stage=1 but recipe.model.stack.zero_stage=3")):
        ds.DeepSpeedStack().switch(compose_typed("+recipe=deepspeed_dense_debug",
                                                 f"+recipe.model.stack.config={path}").recipe, cfg.arms["baseline"])


@needs_deepspeed
def test_a_config_path_that_cannot_be_read_is_refused_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "list.json").write_text("[1, 2]")
    for value, refusal in ((tmp_path / "nope.json", "cannot read"), (tmp_path / "list.json", "holds a JSON list")):
        cfg = compose_typed("+recipe=deepspeed_dense_debug", f"+recipe.model.stack.config={value}")
        with pytest.raises(ConfigError, match=refusal):
            ds.DeepSpeedStack().switch(cfg.recipe, cfg.arms["baseline"])


@needs_deepspeed
def test_the_manifest_records_the_config_the_engine_received_read_back_from_it(tmp_path: Path) -> None:
    """A real engine (one gloo rank, in this process): the user's stage override and a key only their config sets
    reach the engine, and the manifest records what the engine holds, not what taxbench planned."""
    from helpers import one_rank

    from taxbench.design import RunRef
    from taxbench.schedule.experiment import Experiment

    cfg = compose_config("+recipe=deepspeed_dense_debug", "cluster=inprocess", "recipe.model.stack.zero_stage=1",
                         f"+recipe.model.stack.config={_ds_config(tmp_path)}", "recipe.global_batch_size=4")
    with one_rank(cfg) as ctx:
        experiment = Experiment(cfg, ctx, tmp_path / "exp")
        trainer = experiment._trainer(RunRef("baseline", "0"))
        engine = trainer.owned_step.engine
        trainer.close()
    switch = json.loads((tmp_path / "exp" / "baseline-0" / "manifest.json").read_text())["stack_switch"]
    assert switch["zero_stage"] == engine.zero_optimization_stage() == 1
    assert switch["engine"]["zero_stage"] == 1 and switch["config"]["zero_optimization"]["overlap_comm"] is True
    assert switch["config"] == engine.config  # the JSON the engine received, batch sizes included
    assert (switch["engine"]["train_batch_size"], switch["engine"]["gradient_accumulation_steps"]) == (4, 2)
    assert switch["engine"]["gradient_clipping"] == 1.0 and switch["engine"]["bf16"] is False
    assert switch["arm"] == "switch off: taxbench's baseline policy (not deterministic)"


def _train_save_resume(rank: int, world: int, out: str, port: int) -> None:
    """A trainer on DeepSpeed's engine: 2 steps, DeepSpeed's checkpoint, 2 more steps, then the checkpoint loaded
    back (the trainer checks that it reproduces the record of step 2) and the 2 steps again, bit for bit."""
    cfg = compose_typed("+recipe=deepspeed_moe_debug")
    run_dir = Path(out) / "run"
    with rank_process([cfg], rank, world, rank, "127.0.0.1", port) as ctx:
        trainer = Trainer(RunSpec.of(cfg, "deterministic", "0", cfg.arms["deterministic"], run_dir), ctx)
        trainer.run_block(2, 0)
        files = trainer.save_checkpoint(Path(out) / "ckpt")
        trainer.run_block(2, 1)
        first = [r for r in step_records_of(run_dir, rank) if r["step"] > 2]
        trainer.load_checkpoint(Path(out) / "ckpt")
        trainer.run_block(2, 1)
        again = [r for r in step_records_of(run_dir, rank) if r["step"] > 2]
        trainer.close()
        keys = ("loss_bits", "grads", "grad_norm_bits", "params", "optim")
        assert [[r[k] for k in keys] for r in first] == [[r[k] for k in keys] for r in again]
        assert all(r["grads"] != "0000000000000000" for r in again)
        (Path(out) / f"files{rank}.json").write_text(json.dumps([str(f.relative_to(Path(out) / "ckpt"))
                                                                 for f in files]))


def step_records_of(run_dir: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (run_dir / f"steps.rank{rank}.jsonl").read_text().splitlines()]


@needs_deepspeed
@pytest.mark.slow
def test_restart_goes_through_deepspeeds_own_checkpoint_and_replays_bit_for_bit(tmp_path: Path) -> None:
    mp.spawn(_train_save_resume, args=(2, str(tmp_path), free_port()), nprocs=2)
    rank0 = json.loads((tmp_path / "files0.json").read_text())
    rank1 = json.loads((tmp_path / "files1.json").read_text())
    assert rank1 == ["rank1.pt"]  # RNG streams and data position, per rank
    assert "rank0.pt" in rank0 and "deepspeed/mp_rank_00_model_states.pt" in rank0
    assert any(name.startswith("deepspeed/zero_pp_rank_1_") for name in rank0)  # each rank's ZeRO partition
    assert any("expert" in name for name in rank0)  # DeepSpeed's MoE experts, saved by their own ranks


@needs_deepspeed
@pytest.mark.slow
@pytest.mark.parametrize(("recipe", "stage"), [("deepspeed_moe_debug", 2), ("deepspeed_dense_debug", 3)])
def test_a_deepspeed_recipe_runs_the_pair_end_to_end_and_passes_the_gates(recipe: str, stage: int, tmp_path: Path,
                                                                          taxbench_cli) -> None:
    result = taxbench_cli(f"+recipe={recipe}", "experiment.steps=6", "experiment.warmup_steps=1",
                          "experiment.resume_step=3", "experiment.checkpoint_every_steps=3", "report.wandb=false",
                          f"experiment.out_dir={tmp_path}", "experiment.name=ds", cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "ds" / "summary.json").read_text())
    outcomes = {v["gate"]: v["outcome"] for v in summary["verdicts"]}
    assert summary["outcome"] == "passed", outcomes
    assert outcomes["repeatability"] == "identical" and outcomes["restart_replay"] == "identical"
    manifest = json.loads((tmp_path / "ds" / "deterministic-0" / "manifest.json").read_text())
    assert manifest["stack_switch"]["stack"] == "deepspeed"
    assert manifest["stack_switch"]["zero_stage"] == manifest["stack_switch"]["engine"]["zero_stage"] == stage
    assert manifest["stack_switch"]["deterministic_mode"].startswith("documented equivalent")
    assert manifest["policy_applied"]["use_deterministic_algorithms"] is True
    assert len(step_records(tmp_path / "ds" / "deterministic-0")) == 6


def test_one_engine_switching_policy_per_block_is_refused_for_deepspeed() -> None:
    from taxbench.config.schema import validate

    with pytest.raises(ConfigError, match="DeepSpeed's deterministic_mode is fixed when its engine is built"):
        validate(compose_typed("+recipe=deepspeed_moe_debug", "experiment.interleave=policy"))


@needs_deepspeed
@pytest.mark.slow
def test_localize_names_a_fault_planted_inside_a_module_deepspeed_trains(tmp_path: Path) -> None:
    from taxbench.commands.localize import NAMED

    module = "blocks.1.ffn.moe.deepspeed_moe.gate"  # DeepSpeed's top-k gate: its logits of every token
    result = localize_planted_op(tmp_path, "deepspeed_moe_debug", module)
    assert result.verdict == NAMED
    origin = result.origin
    assert origin is not None
    assert (origin.kind, origin.scope, origin.rank, origin.step) == ("op", module, 1, 2)


@pytest.mark.slow
def test_localize_names_a_flipped_bit_in_the_partition_zero_holds(tmp_path: Path) -> None:
    # ZeRO leaves the module's own parameters to DeepSpeed's copies: the flip lands in the fp32 partition the
    # optimizer steps, and rung 1 names that partition (not the parameters the engine copies it into).
    from taxbench.commands.localize import NAMED

    result = localize_planted_fault(tmp_path, "deepspeed_moe_debug", "experiment.fault.kind=flip_param_bit")
    assert result.verdict == NAMED and result.origin is not None
    assert (result.origin.kind, result.origin.name, result.origin.rank, result.origin.step) == (
        "parameter", "partition 0", 1, 2)
