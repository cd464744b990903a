"""DeepSpeed as a training stack, on CPU gloo ranks: its engine at ZeRO-2 with its MoE layer at ep=2 and at ZeRO-3,
its own optimizer step and checkpoint, and its determinism switch (the documented equivalent on CPU, where its key
raises by design, and where the installed DeepSpeed has no key). Without DeepSpeed a recipe that needs it exits 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.multiprocessing as mp
from helpers import compose_typed, has_deepspeed, localize_planted_fault, localize_planted_op, step_records

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
    assert manifest["stack_switch"]["zero_stage"] == stage
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
