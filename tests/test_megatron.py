"""Megatron-Core as a training stack. Without CUDA: the recipe is refused in one line, the switch's and the layout's
conflicts are refused, and (with megatron-core installed) the dense and MoE GPTModels are built by the stack's own code
on real gloo ranks with each arm's process groups (tp, ep, pp, interleaved pp), each rank's share checked and
checkpointed through the harness's DCP as the unsplit model. Its schedule, DDP buffers and gradient norm are CUDA only
in Megatron-Core: one step runs here with those pieces pointed at the host (_megatron_on_the_host), and the end-to-end
pair runs in the gpu tier."""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from helpers import compose_typed
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.overrides import TorchFunctionMode

from taxbench.checkpoint import state as checkpoint
from taxbench.config.schema import ConfigError, TaxbenchConfig, validate
from taxbench.launchers.worker import rank_process
from taxbench.parallel.distributed import free_port
from taxbench.parallel.layout import layout_for, meshes_for
from taxbench.parallel.plan import make_plan
from taxbench.stacks import megatron, megatron_optimizer
from taxbench.stacks.native import build_optimizer


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
    # Megatron refuses Tree: torchtitan's NCCL policy is for taxbench's own stack (and torchtitan's).
    (("mode@arms.deterministic=deterministic_tree",),
     "NCCL_ALGO=Ring but the deterministic arm's taxbench policy has Ring;allreduce:Tree"),
    (("recipe.parallel.pp=2", "recipe.parallel.pp_schedule=GPipe"), "not one of Megatron's schedules"),
    (("recipe.parallel.ep=2",), "recipe.parallel.ep=2 needs MoE layers"),
    (("+recipe.model.stack.params_dtype=fp16",), "recipe.model.stack.params_dtype='fp16': choose one of"),
    (("+recipe.model.stack.params_dtype=bf16", "recipe.precision=fp32"),
     "params_dtype=bf16 needs recipe.precision=bf16"),
    (("+recipe.model.stack.params_dtype=bf16", "recipe.precision=bf16"),
     "add recipe.model.stack.use_distributed_optimizer=true"),
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


def _build_and_save(rank: int, world: int, overrides: tuple[str, ...], out: str, tag: str, port: int) -> None:
    """This rank's GPTModel chunks built as MegatronStack.build builds them (on the host), saved through the harness's
    DCP and read back into themselves; what the rank holds, written for the test."""
    cfg = compose_typed(*overrides, f"cluster.cpu_ranks={world}")
    with rank_process([cfg], rank, world, rank, "127.0.0.1", port) as ctx:
        arm = cfg.arms["deterministic"]
        options = megatron.MegatronOptions.of(cfg.recipe)
        layout = layout_for(cfg.recipe.parallel, world, rank)
        meshes = meshes_for(layout, ctx, arm)
        groups = megatron.process_groups(meshes)
        megatron.ensure_parallel_state(cfg.recipe.parallel)
        config = megatron.transformer_config(cfg.recipe, options, deterministic=True, on_device=False)
        chunks = megatron.rank_chunks(cfg.recipe, options, config, groups, layout, torch.device("cpu"))
        par = cfg.recipe.parallel
        assert groups.tp.size() == par.tp and groups.pp.size() == par.pp and groups.ep.size() == par.ep
        assert groups.dp.size() == world // (par.tp * par.pp) and groups.cp.size() == 1
        parallel = megatron.MegatronParallel(chunks, chunks, layout, meshes, groups)
        optimizer = build_optimizer(cfg.recipe, parallel.parts.parameters())
        checkpoint.save(Path(out) / tag, parallel, optimizer, {"step": 0}, rank)
        saved = {name: p.detach().clone() for name, p in parallel.parts.named_parameters()}
        with torch.no_grad():
            for p in parallel.parts.parameters():
                p.fill_(float("nan"))
        checkpoint.load(Path(out) / tag, parallel, optimizer, rank, torch.device("cpu"))
        assert [name for name, p in parallel.parts.named_parameters() if not torch.equal(p, saved[name])] == []
        held = {name: list(p.shape) for name, p in parallel.parts.named_parameters()}
        (Path(out) / f"{tag}.{rank}.json").write_text(json.dumps({"local": held, "sliced": sorted(
            parallel.sliced_names()), "chunks": len(chunks), "expert_parallel": sorted(
            name for name, p in parallel.parts.named_parameters() if getattr(p, "allreduce", True) is False)}))


def _built(tmp_path: Path, tag: str, *overrides: str) -> list[dict]:
    mp.start_processes(_build_and_save, args=(2, overrides, str(tmp_path), tag, free_port()), nprocs=2, join=True,
                       start_method="spawn")
    return [json.loads((tmp_path / f"{tag}.{rank}.json").read_text()) for rank in range(2)]


def _saved_model(directory: Path) -> dict[str, torch.Tensor]:
    metadata = dcp.FileSystemReader(directory).read_metadata()
    model = {key: torch.full(meta.size, float("nan")) for key, meta in metadata.state_dict_metadata.items()
             if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)}
    dcp.load(model, checkpoint_id=directory, no_dist=True)
    return {key.removeprefix("model."): value for key, value in model.items()}


def _same_model(one: dict[str, torch.Tensor], two: dict[str, torch.Tensor]) -> list[str]:
    """Names whose shape or values differ (or that only one holds)."""
    return sorted(set(one) ^ set(two)) + [name for name in one if name in two and not torch.equal(one[name], two[name])]


@needs_megatron
@pytest.mark.slow
def test_a_tensor_parallel_gptmodel_checkpoints_as_the_unsplit_model(tmp_path: Path) -> None:
    whole, _ = _built(tmp_path, "tp1", *HOST, "recipe.parallel.tp=1")
    split, _ = _built(tmp_path, "tp2", *HOST, "recipe.parallel.tp=2")
    assert "decoder.layers.0.self_attention.linear_qkv.weight" in split["sliced"]
    assert "decoder.layers.0.self_attention.linear_proj.weight" in split["sliced"]
    assert "decoder.final_layernorm.weight" not in split["sliced"] and whole["sliced"] == []
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert split["local"][qkv][0] * 2 == whole["local"][qkv][0]  # each tp rank holds half of the heads
    assert _same_model(_saved_model(tmp_path / "tp1"), _saved_model(tmp_path / "tp2")) == []


def _experts(held: dict, layer: int) -> set[int]:
    prefix = f"decoder.layers.{layer}.mlp.experts.local_experts."
    return {int(name[len(prefix):].split(".")[0]) for name in held["local"] if name.startswith(prefix)}


def _layers(held: dict) -> set[int]:
    return {int(name.split(".")[2]) for name in held["local"] if name.startswith("decoder.layers.")}


def _count(held: dict) -> int:
    return sum(math.prod(shape) for shape in held["local"].values())


@needs_megatron
@pytest.mark.slow
def test_megatrons_moe_builds_at_ep2_and_pp2_and_checkpoints_as_the_same_unsplit_model(tmp_path: Path) -> None:
    """The MoE GPTModel on 2 gloo ranks: replicated (dp=2), its experts split over ep=2, its layers over pp=2 (1F1B:
    contiguous stages; interleaved: 2 virtual stages per rank). Each rank holds its share under the unsplit model's
    names, and every layout's checkpoint is bitwise the same unsplit model (weights drawn per global name)."""
    moe = ("+recipe=megatron_moe_debug", "recipe.precision=fp32",
           "+recipe.model.stack.position_embedding_type=learned_absolute")
    whole = _built(tmp_path, "dp2", *moe)
    experts = _built(tmp_path, "ep2", *moe, "recipe.parallel.ep=2")
    stages = _built(tmp_path, "pp2", *moe, "recipe.parallel.pp=2")
    looped = _built(tmp_path, "vpp2", *moe, "recipe.parallel.pp=2", "recipe.parallel.pp_schedule=Interleaved1F1B",
                    "recipe.parallel.virtual_stages=2")
    assert whole[0]["local"] == whole[1]["local"] and _experts(whole[0], 3) == {0, 1, 2, 3}
    assert whole[0]["expert_parallel"] == []  # replicated experts: reduced over data parallel like the rest
    assert [_experts(held, layer) for held in experts for layer in (0, 3)] == [{0, 1}, {0, 1}, {2, 3}, {2, 3}]
    assert all(name in held["expert_parallel"] for held in experts for name in held["local"] if "local_experts" in name)
    dense = [name for name in whole[0]["local"] if "local_experts" not in name]
    assert [sorted(name for name in held["local"] if "local_experts" not in name) for held in experts] == [
        sorted(dense)] * 2
    expert_count = sum(math.prod(s) for name, s in whole[0]["local"].items() if "local_experts" in name)
    assert [_count(held) for held in experts] == [_count(whole[0]) - expert_count // 2] * 2
    assert [_layers(held) for held in stages] == [{0, 1}, {2, 3}]
    assert [_layers(held) for held in looped] == [{0, 2}, {1, 3}] and looped[0]["chunks"] == 2
    assert "embedding.word_embeddings.weight" in stages[0]["local"] and "output_layer.weight" in stages[1]["local"]
    assert "output_layer.weight" not in stages[0]["local"] and "embedding.word_embeddings.weight" not in stages[1][
        "local"]
    for held in (stages, looped):
        assert sum(_count(rank) for rank in held) == _count(whole[0])
    reference = _saved_model(tmp_path / "dp2")
    assert reference.keys() == {name for name in whole[0]["local"]}
    for tag in ("ep2", "pp2", "vpp2"):
        assert _same_model(reference, _saved_model(tmp_path / tag)) == [], tag


class _HostDevice(TorchFunctionMode):
    """Tensors Megatron creates on "cuda" (its schedule's token count, DDP's buffers) are made on the host."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 (torch's protocol)
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and (str(device).startswith("cuda") or isinstance(device, int)):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


class _NoStream:
    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def wait_stream(self, *args: object) -> None:
        pass


def _megatron_on_the_host() -> None:
    """What Megatron-Core 0.16.1's training step needs of CUDA, pointed at the host in this test process only (the
    product trains Megatron on CUDA): the current device, streams, the RNG tracker's fork, Transformer Engine's router
    GEMM (a NameError without it) and the clipping's CUDA type assert. Its batched P2P relies on
    torch.cuda.synchronize, a no-op here, so the test turns batching off (received activations were read too early)."""
    from megatron.core.optimizer import clip_grads
    from megatron.core.tensor_parallel import random as megatron_random
    from megatron.core.transformer.moe import moe_utils

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.Stream = _NoStream
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    torch.cuda.default_stream = torch.cuda.current_stream = lambda *args: _NoStream()
    torch.cuda.synchronize = lambda *args: None
    megatron_random.get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()
    moe_utils.te_general_gemm = None
    clip_grads.clip_grad_by_total_norm_fp32 = lambda *args, **kwargs: None


def _one_step(rank: int, world: int, overrides: tuple[str, ...], out: str, tag: str, port: int) -> None:
    """One training step of MegatronStack.build's pieces on the host (Megatron's schedule, DDP, finalize_model_grads,
    the stack's step and gradient norm) over 4 fixed micro-batches; the loss and the norm, written for the test."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    _megatron_on_the_host()
    cfg = compose_typed(*overrides, f"cluster.cpu_ranks={world}")
    recipe = cfg.recipe
    with rank_process([cfg], rank, world, rank, "127.0.0.1", port) as ctx, _HostDevice():
        arm = cfg.arms["deterministic"]
        options = megatron.MegatronOptions.of(recipe)
        layout = layout_for(recipe.parallel, world, rank)
        meshes = meshes_for(layout, ctx, arm)
        groups = megatron.process_groups(meshes)
        megatron.ensure_parallel_state(recipe.parallel)
        config = megatron.transformer_config(recipe, options, deterministic=True, on_device=False)
        config.batch_p2p_comm = False
        chunks = megatron.rank_chunks(recipe, options, config, groups, layout, torch.device("cpu"))
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=False)
        ddps = [DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=index > 0, pg_collection=groups)
                for index, chunk in enumerate(chunks)]
        config.no_sync_func = [ddp.no_sync for ddp in ddps] if len(ddps) > 1 else ddps[0].no_sync
        config.finalize_model_grads_func = finalize_model_grads
        parallel = megatron.MegatronParallel(chunks, ddps, layout, meshes, groups)
        generator = torch.Generator().manual_seed(0)  # every data-parallel rank reads the same 4 micro-batches
        tokens = [torch.randint(0, recipe.model.vocab_size, (recipe.micro_batch_size, recipe.model.seq_len + 1),
                                generator=generator) for _ in range(4)]
        loss = megatron.MegatronStep(ddps, recipe, config, groups).run([(t[:, :-1], t[:, 1:]) for t in tokens])
        parallel.finish_gradients()
        norm = parallel.clip_grad_norm_(1.0)
        (Path(out) / f"{tag}.{rank}.json").write_text(json.dumps({"loss": loss.item(), "norm": norm.item()}))


@needs_megatron
@pytest.mark.slow
def test_megatrons_step_gives_one_loss_and_norm_at_dp2_ep2_pp2_and_interleaved(tmp_path: Path) -> None:
    """Megatron's schedules on the host (CUDA-only pieces pointed at the host: _megatron_on_the_host) over the same 4
    micro-batches: the data-parallel, expert-parallel, 1F1B and interleaved layouts of the MoE model start from the
    same weights, so they record the same loss and gradient norm on every rank (to float rounding)."""
    moe = ("+recipe=megatron_moe_debug", "recipe.precision=fp32",
           "+recipe.model.stack.position_embedding_type=learned_absolute")
    layouts = {"dp2": ("recipe.global_batch_size=16",), "ep2": ("recipe.global_batch_size=16", "recipe.parallel.ep=2"),
               "pp2": ("recipe.parallel.pp=2",),
               "vpp2": ("recipe.parallel.pp=2", "recipe.parallel.pp_schedule=Interleaved1F1B",
                        "recipe.parallel.virtual_stages=2")}
    records = {}
    for tag, overrides in layouts.items():
        mp.start_processes(_one_step, args=(2, (*moe, *overrides), str(tmp_path), tag, free_port()), nprocs=2,
                           join=True, start_method="spawn")
        records[tag] = [json.loads((tmp_path / f"{tag}.{rank}.json").read_text()) for rank in range(2)]
    reference = records["dp2"][0]
    assert 7.0 < reference["loss"] < 8.5 and reference["norm"] > 0  # about ln(2048) at the start
    for tag, ranks in records.items():
        for record in ranks:
            assert record["loss"] == pytest.approx(reference["loss"], rel=1e-6), tag
            assert record["norm"] == pytest.approx(reference["norm"], rel=1e-5), tag


def test_one_model_switching_policy_per_block_is_refused_for_megatron() -> None:
    with pytest.raises(ConfigError, match="deterministic_mode is fixed when its GPTModel is built"):
        validate(_config("experiment.interleave=policy"))


@pytest.mark.parametrize(("overrides", "refusal"), [
    (("recipe.parallel.ep=3",), "recipe.parallel.ep=3 must divide recipe.model.n_experts=4"),
    (("+recipe.model.stack.moe_grouped_gemm=true",), "moe_grouped_gemm=true needs recipe.model.stack.spec"),
    (("recipe.model.stack.moe_token_dispatcher_type=flex",), "moe_token_dispatcher_type='flex'"),
    (("+recipe.model.stack.moe_router_load_balancing_type=sinkhorn",), "moe_router_load_balancing_type='sinkhorn'"),
])
def test_what_megatrons_moe_cannot_do_here_is_refused_in_one_line(overrides: tuple[str, ...], refusal: str) -> None:
    cfg = compose_typed("+recipe=megatron_moe_debug", *overrides)
    with pytest.raises(ConfigError, match=refusal.replace("(", r"\(").replace("+", r"\+")) as info:
        megatron.MegatronStack().switch(cfg.recipe, cfg.arms["deterministic"])
    assert "\n" not in str(info.value)


@needs_megatron
def test_the_moe_meta_model_is_the_whole_model_whatever_the_layout() -> None:
    cfg = compose_typed("+recipe=megatron_moe_debug", "recipe.parallel.ep=2", "recipe.parallel.pp=2")
    names = {name for name, _ in megatron.meta_gpt(cfg.recipe).named_parameters()}
    assert "decoder.layers.3.mlp.experts.local_experts.3.linear_fc2.weight" in names
    assert "decoder.layers.0.mlp.router.weight" in names and "embedding.word_embeddings.weight" in names
    assert not any("bias" in name and "layernorm" not in name for name in names)  # MoE recipes: no linear biases


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
@pytest.mark.parametrize("recipe", ["megatron_gpt_debug", "megatron_moe_debug"])
def test_megatrons_pair_runs_end_to_end_and_its_deterministic_arm_repeats(taxbench_cli, tmp_path: Path,
                                                                          recipe: str) -> None:
    result = taxbench_cli(f"+recipe={recipe}", "cluster=inprocess", "cluster.device=cuda", "cluster.gpus=1",
                          f"experiment.out_dir={tmp_path}", "report.wandb=false", "experiment.name=megatron",
                          cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    manifest = json.loads(next(tmp_path.rglob("deterministic-0/manifest.json")).read_text())
    assert manifest["stack_switch"]["deterministic_mode"] is True


def test_the_recorded_loss_is_not_scaled_by_the_schedules_in_place_division() -> None:
    loss, record = megatron.mean_token_loss(torch.tensor([[1.0, 2.0], [3.0, 6.0]], requires_grad=True))
    loss /= 4  # what Megatron's schedule does to the loss it backpropagates (num_microbatches)
    assert loss.item() == 0.75 and record["loss"].item() == 3.0


@needs_megatron
@pytest.mark.parametrize("shared", [0, 1])
def test_the_plan_counts_the_parameters_of_megatrons_own_moe_model(shared: int) -> None:
    """plan=true counts taxbench's MoE GPT of the same fields (the planner imports no training stack); Megatron's own
    GPTModel (RoPE: no position table) holds exactly as many, in total and per kind."""
    cfg = compose_typed("+recipe=megatron_moe_debug", f"recipe.model.n_shared_experts={shared}", "cluster.gpus=2",
                        "recipe.parallel.ep=2")
    plan = make_plan(cfg)
    counts = {name: p.numel() for name, p in megatron.meta_gpt(cfg.recipe).named_parameters()}
    assert plan.valid and plan.layout["experts_per_rank"] == 2
    assert plan.total_params == sum(counts.values())
    assert plan.params_by_kind["experts"] == sum(n for name, n in counts.items() if "local_experts" in name)


def test_the_distributed_optimizer_off_cuda_is_refused_in_one_line() -> None:
    """Megatron's DistributedOptimizer shards its state in CUDA buffers: a rank on the host is refused before
    anything is built, as Megatron's other CUDA paths are (the switch itself accepts the option: the plan counts it)."""
    cfg = _config("+recipe.model.stack.use_distributed_optimizer=true", "+recipe.model.stack.params_dtype=bf16",
                  "recipe.precision=bf16")
    assert megatron.MegatronStack().switch(cfg.recipe, cfg.arms["deterministic"])["deterministic_mode"] is True
    with pytest.raises(ConfigError, match=r"use_distributed_optimizer=true needs a CUDA GPU .* device is cpu") as info:
        megatron_optimizer.require_cuda(torch.device("cpu"))
    assert "\n" not in str(info.value)


@needs_megatron
@pytest.mark.parametrize("gpus", [8, 16])
def test_the_plans_distributed_optimizer_shards_as_megatrons_own_code(gpus: int) -> None:
    """The plan's optimizer bytes on a rank against Megatron's DistributedOptimizer._build_model_gbuf_range, which
    cuts each (padded) gradient buffer into one contiguous range per data-parallel rank: dense parameters over dp,
    the rank's experts over edp; each element of a range holds an fp32 main parameter and AdamW's two fp32 moments
    (12 bytes, the 12/d of Megatron's 6 + 12/d)."""
    from types import SimpleNamespace

    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    cfg = compose_typed("+recipe=megatron_moe_debug", f"cluster.gpus={gpus}", "recipe.parallel.ep=2",
                        "+recipe.model.stack.use_distributed_optimizer=true", "+recipe.model.stack.params_dtype=bf16",
                        f"recipe.global_batch_size={2 * gpus}")
    plan = make_plan(cfg)
    assert plan.valid and plan.memory is not None, plan.problems
    dp, edp = plan.layout["dp"], plan.layout["edp"]
    held = {name: p.numel() for name, p in megatron.meta_gpt(cfg.recipe).named_parameters()
            if "local_experts" not in name or int(name.split("local_experts.")[1].split(".")[0]) < 4 // 2}

    def largest_range(numels: list[int], world: int) -> int:
        """The most elements Megatron's own code gives one data-parallel rank of a buffer of these parameters."""
        size = -(-sum(numels) // world) * world  # Megatron pads the buffer to a multiple of the dp size
        index, start = {}, 0
        for n in numels:
            index[torch.empty(0)] = (start, start + n, 0)
            start += n
        most = 0
        for rank in range(world):
            group = SimpleNamespace(rank=lambda r=rank: r, size=lambda: world)
            bucket = SimpleNamespace(grad_data=torch.empty(size, device="meta"), offset=0)
            buffer = SimpleNamespace(data_parallel_group=group, buckets=[bucket], param_index_map=index)
            ranges = DistributedOptimizer._build_model_gbuf_range(buffer, 0)["param_map"]
            most = max(most, sum(r["param"].size for r in ranges.values()))
        return most

    dense = [n for name, n in held.items() if "local_experts" not in name]
    experts = [n for name, n in held.items() if "local_experts" in name]
    megatrons = 12 * (largest_range(dense, dp) + largest_range(experts, edp))
    assert plan.memory.optimizer == pytest.approx(megatrons, abs=12 * (dp + edp))  # Megatron's padding
    assert plan.memory.weights == 2 * sum(held.values()) and plan.memory.grads == 4 * sum(held.values())


def _cuda_type_names() -> None:
    """Megatron's DistributedOptimizer accepts only tensors whose type() is a torch.cuda one: host tensors answer so
    in this test process."""
    original = torch.Tensor.type

    def cuda_type(self: torch.Tensor, *args: object, **kwargs: object) -> object:
        if args or kwargs:
            return original(self, *args, **kwargs)
        name = str(original(self))
        return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = cuda_type  # type: ignore[method-assign]


def _distributed_optimizer_round_trip(rank: int, world: int, overrides: tuple[str, ...], out: str, port: int) -> None:
    """MegatronStack.build's distributed-optimizer pieces on the host (its Float16Module, DDP with the distributed
    optimizer, get_megatron_optimizer over the arm's groups, the gloo groups of its checkpoint, the owned step): two
    steps, a checkpoint between them in Megatron's format, the second step again after the restore."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer

    _megatron_on_the_host()
    _cuda_type_names()
    cfg = compose_typed(*overrides, f"cluster.cpu_ranks={world}")
    recipe = cfg.recipe
    with rank_process([cfg], rank, world, rank, "127.0.0.1", port) as ctx, _HostDevice():
        options = megatron.MegatronOptions.of(recipe)
        layout = layout_for(recipe.parallel, world, rank)
        meshes = meshes_for(layout, ctx, cfg.arms["deterministic"])
        groups = megatron.process_groups(meshes, distributed_optimizer=True)
        megatron.ensure_parallel_state(recipe.parallel)
        config = megatron.transformer_config(recipe, options, deterministic=True, on_device=False)
        chunks = megatron.rank_chunks(recipe, options, config, groups, layout, torch.device("cpu"))
        wrapped = [megatron._float16(config, chunk) for chunk in chunks] if config.bf16 else chunks
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
        ddps = [DistributedDataParallel(config, ddp_config, chunk, pg_collection=groups) for chunk in wrapped]
        config.no_sync_func, config.finalize_model_grads_func = ddps[0].no_sync, finalize_model_grads
        settings = megatron_optimizer.optimizer_config(recipe, megatron.PARAMS_DTYPES[options.params_dtype])
        optimizer = get_megatron_optimizer(settings, ddps, use_gloo_process_groups=False, pg_collection=groups)
        megatron_optimizer.attach_gloo_groups(optimizer, meshes.full)
        engine = megatron_optimizer.DistributedOptimizerStep(megatron.MegatronStep(ddps, recipe, config, groups), ddps,
                                                             optimizer, layout, groups, torch.device("cpu"))
        generator = torch.Generator().manual_seed(0)  # every data-parallel rank reads the same micro-batches
        steps = [[(t[:, :-1], t[:, 1:]) for t in (torch.randint(0, recipe.model.vocab_size, (
            recipe.micro_batch_size, recipe.model.seq_len + 1), generator=generator) for _ in range(4))]
            for _ in range(2)]
        engine.optimize(steps[0])
        written = engine.save(Path(out) / "checkpoint", {"step": 1}, rank)
        loss, norm = engine.optimize(steps[1])
        held = [t.clone() for t in (*engine.parameters(), *engine.optimizer_tensors())]
        extras = engine.load(Path(out) / "checkpoint", rank, torch.device("cpu"))
        again, again_norm = engine.optimize(steps[1])
        replayed = [t.clone() for t in (*engine.parameters(), *engine.optimizer_tensors())]
        (Path(out) / f"{rank}.json").write_text(json.dumps({
            "same": len(held) == len(replayed) and all(torch.equal(a, b) for a, b in zip(held, replayed, strict=True)),
            "loss": [loss.item(), again.item()], "norm": [norm.item(), again_norm.item()], "extras": extras,
            "shards": len(engine.parameters()), "grads": len(engine.gradients()),
            "files": sorted(str(path.relative_to(out)) for path in written)}))


@needs_megatron
@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    ("+recipe.model.stack.params_dtype=bf16",),  # bf16 parameters, dense and experts over dp=2
    ("recipe.precision=fp32", "recipe.parallel.ep=2"),  # fp32 parameters, experts over edp=1, two mp_rank folders
], ids=["bf16-dp2", "fp32-ep2"])
def test_megatrons_distributed_optimizer_restores_its_own_checkpoint_bitwise(tmp_path: Path,
                                                                            overrides: tuple[str, ...]) -> None:
    """The restart gate's question for Megatron's DistributedOptimizer, on the host: a step after restoring its
    legacy checkpoint (model_optim_rng.pt, distrib_optim.pt, the Adam step beside them) gives bitwise the shards of
    main parameters and moments that the uninterrupted step gave, on every rank."""
    moe = ("+recipe=megatron_moe_debug", "+recipe.model.stack.position_embedding_type=learned_absolute",
           "recipe.global_batch_size=16", "+recipe.model.stack.use_distributed_optimizer=true", *overrides)
    mp.start_processes(_distributed_optimizer_round_trip, args=(2, moe, str(tmp_path), free_port()), nprocs=2,
                       join=True, start_method="spawn")
    ranks = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(2)]
    for held in ranks:
        assert held["same"] and held["extras"] == {"step": 1} and held["shards"] == held["grads"] > 0, held
        assert held["loss"][0] == held["loss"][1] and held["norm"][0] == held["norm"][1]
    assert ranks[0]["loss"] == ranks[1]["loss"]  # one loss for the data-parallel ranks
    folders = {file.split("/")[2] for held in ranks for file in held["files"]
               if file.startswith("checkpoint/megatron/")}
    assert folders == ({"mp_rank_00_000_000", "mp_rank_00_000_001"} if "recipe.parallel.ep=2" in overrides else
                       {"mp_rank_00_000_000"})
