"""Megatron-Core as a training stack. Without CUDA: the recipe is refused in one line, the switch's conflicts are
refused, and (with megatron-core installed) the GPTModel is built by the stack's own code on real gloo ranks with each
arm's process groups, its tensor-parallel weights checkpointed through the harness's DCP as the unsplit model. Its
schedule, DDP buffers and gradient norm are CUDA only in Megatron-Core: the end-to-end pair runs in the gpu tier."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from helpers import compose_typed
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from taxbench.checkpoint import state as checkpoint
from taxbench.config.schema import ConfigError, TaxbenchConfig, validate
from taxbench.launchers.worker import rank_process
from taxbench.parallel.distributed import free_port
from taxbench.parallel.layout import layout_for, meshes_for
from taxbench.train import megatron
from taxbench.train.build import build_optimizer


def _has_megatron() -> bool:
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        return False
    return True


needs_megatron = pytest.mark.skipif(not _has_megatron(), reason="needs taxbench[megatron]")
# Megatron's RoPE moves its frequencies to CUDA in forward and at build: learned positions on the host.
HOST = ("+recipe=megatron_gpt_debug", "recipe.precision=fp32",
        "+recipe.model.stack.position_embedding_type=learned_absolute")


def _config(*overrides: str) -> TaxbenchConfig:
    return compose_typed("+recipe=megatron_gpt_debug", *overrides)


def test_a_megatron_recipe_without_cuda_is_refused_in_one_line(tmp_path: Path, taxbench_cli) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    result = taxbench_cli("+recipe=megatron_gpt_debug", f"experiment.out_dir={tmp_path}", cwd=tmp_path, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert "needs a CUDA GPU" in lines[0] and "taxbench[megatron]" in lines[0]
    assert not list(tmp_path.rglob("manifest.json"))  # refused before anything ran


def test_the_deterministic_switch_records_megatrons_mode_and_environment() -> None:
    cfg = _config()
    stack = megatron.MegatronStack()
    on = stack.switch(cfg.recipe, cfg.arms["deterministic"])
    off = stack.switch(cfg.recipe, cfg.arms["baseline"])
    assert on["deterministic_mode"] is True and on["env"]["NCCL_ALGO"] == "Ring"
    assert on["env"]["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] == "0"
    assert off["deterministic_mode"] is False and off["env"] == {}


@pytest.mark.parametrize(("overrides", "refusal"), [
    (("+recipe.model.stack.cross_entropy_loss_fusion=true",), "rejects cross-entropy loss fusion"),
    (("arms.deterministic.nccl_algo=CollnetDirect",), "NCCL_ALGO=Ring but the deterministic arm's taxbench policy"),
    (("arms.deterministic.nccl_algo=null",), "NCCL_ALGO=Ring but the deterministic arm's taxbench policy has None"),
    (("recipe.parallel.pp=2",), "recipe.parallel.pp=2"),
    (("recipe.parallel.data_parallel=fsdp",), "DistributedDataParallel"),
    (("+recipe.model.stack.flash=true",), "recipe.model.stack.flash is not a Megatron-Core option"),
    (("recipe.model.stack.spec=te",), "recipe.model.stack.spec='te'"),
    (("+recipe.model.stack.sequence_parallel=true",), "sequence_parallel=true needs recipe.parallel.tp > 1"),
    (("recipe.precision=fp8",), "recipe.precision=fp8 is not wired"),
])
def test_what_megatrons_switch_or_this_adapter_cannot_do_is_refused_in_one_line(overrides: tuple[str, ...],
                                                                                 refusal: str) -> None:
    cfg = _config(*overrides)
    with pytest.raises(ConfigError, match=refusal.replace("(", r"\(").replace("+", r"\+")) as info:
        megatron.MegatronStack().switch(cfg.recipe, cfg.arms["deterministic"])
    assert "\n" not in str(info.value)


def _build_and_save(rank: int, world: int, tp: int, out: str, port: int) -> None:
    """This rank's GPTModel built as MegatronStack.build builds it (on the host), saved through the harness's DCP and
    read back into itself."""
    cfg = compose_typed(*HOST, f"recipe.parallel.tp={tp}", f"cluster.cpu_ranks={world}")
    with rank_process([cfg], rank, world, rank, "127.0.0.1", port) as ctx:
        arm = cfg.arms["deterministic"]
        options = megatron.MegatronOptions.of(cfg.recipe)
        layout = layout_for(cfg.recipe.parallel, world, rank)
        meshes = meshes_for(layout, ctx, arm)
        groups = megatron.process_groups(meshes, ctx.group_for(arm))
        megatron.ensure_parallel_state(tp)
        torch.manual_seed(cfg.recipe.seed)  # Megatron's host initialisation draws the unsplit weights, then splits
        config = megatron.transformer_config(cfg.recipe, options, deterministic=True, on_device=False)
        gpt = megatron.build_gpt(cfg.recipe, options, config, groups)
        assert groups.tp.size() == tp and groups.dp.size() == world // tp
        parallel = megatron.MegatronParallel(gpt, gpt, layout, meshes, groups)
        optimizer = build_optimizer(cfg.recipe, gpt.parameters())
        checkpoint.save(Path(out) / f"tp{tp}", parallel, optimizer, {"step": 0}, rank)
        saved = {name: p.detach().clone() for name, p in gpt.named_parameters()}
        with torch.no_grad():
            for p in gpt.parameters():
                p.fill_(float("nan"))
        checkpoint.load(Path(out) / f"tp{tp}", parallel, optimizer, rank, torch.device("cpu"))
        assert [name for name, p in gpt.named_parameters() if not torch.equal(p, saved[name])] == []
        if rank == 0:
            shapes = {name: list(p.shape) for name, p in gpt.named_parameters()}
            (Path(out) / f"tp{tp}.json").write_text(json.dumps({"local": shapes, "sliced": sorted(
                parallel.sliced_names())}))


def _saved_model(directory: Path) -> dict[str, torch.Tensor]:
    metadata = dcp.FileSystemReader(directory).read_metadata()
    model = {key: torch.full(meta.size, float("nan")) for key, meta in metadata.state_dict_metadata.items()
             if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)}
    dcp.load(model, checkpoint_id=directory, no_dist=True)
    return {key.removeprefix("model."): value for key, value in model.items()}


@needs_megatron
@pytest.mark.slow
def test_a_tensor_parallel_gptmodel_checkpoints_as_the_unsplit_model(tmp_path: Path) -> None:
    for tp in (1, 2):
        mp.start_processes(_build_and_save, args=(2, tp, str(tmp_path), free_port()), nprocs=2, join=True,
                           start_method="spawn")
    split = json.loads((tmp_path / "tp2.json").read_text())
    whole = json.loads((tmp_path / "tp1.json").read_text())
    assert "decoder.layers.0.self_attention.linear_qkv.weight" in split["sliced"]
    assert "decoder.layers.0.self_attention.linear_proj.weight" in split["sliced"]
    assert "decoder.final_layernorm.weight" not in split["sliced"] and whole["sliced"] == []
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert split["local"][qkv][0] * 2 == whole["local"][qkv][0]  # each tp rank holds half of the heads
    one, two = _saved_model(tmp_path / "tp1"), _saved_model(tmp_path / "tp2")
    assert {k: v.shape for k, v in two.items()} == {k: v.shape for k, v in one.items()}
    assert [name for name in one if not torch.equal(one[name], two[name])] == []


def test_one_model_switching_policy_per_block_is_refused_for_megatron() -> None:
    with pytest.raises(ConfigError, match="deterministic_mode is fixed when its GPTModel is built"):
        validate(_config("experiment.interleave=policy"))


@needs_megatron
def test_the_meta_model_has_the_trained_models_module_paths() -> None:
    meta = megatron.meta_gpt(_config().recipe)
    names = {name for name, _ in meta.named_parameters()}
    assert "decoder.layers.1.mlp.linear_fc1.weight" in names and "output_layer.weight" in names
    assert all(p.is_meta for p in meta.parameters())
    assert not torch.distributed.is_initialized()  # its one-rank world is gone


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run scripts/gpu_check.sh on one)")
@needs_megatron
def test_megatrons_pair_runs_end_to_end_and_its_deterministic_arm_repeats(taxbench_cli, tmp_path: Path) -> None:
    result = taxbench_cli("+recipe=megatron_gpt_debug", "cluster=inprocess", "cluster.device=cuda", "cluster.gpus=1",
                          f"experiment.out_dir={tmp_path}", "report.wandb=false", "experiment.name=megatron",
                          cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    manifest = json.loads(next(tmp_path.rglob("deterministic-0/manifest.json")).read_text())
    assert manifest["stack_switch"]["deterministic_mode"] is True


def test_the_recorded_loss_is_not_scaled_by_the_schedules_in_place_division() -> None:
    loss, record = megatron.mean_token_loss(torch.tensor([[1.0, 2.0], [3.0, 6.0]], requires_grad=True))
    loss /= 4  # what Megatron's schedule does to the loss it backpropagates (num_microbatches)
    assert loss.item() == 0.75 and record["loss"].item() == 3.0
