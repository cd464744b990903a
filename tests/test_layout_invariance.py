"""Layout-invariant initial weights: every layout starts from bitwise the unsplit model's weights.

Each rank builds its share through the trainer's path (taxbench.stacks.native: meta device, stage split, experts over
ep, tensor parallel, FSDP2, then materialised); the shares are gathered with DTensor's own full_tensor() (and the
expert slices placed at the experts they hold) and compared bit for bit with the whole model built by
`build_model(seed=)`. A gather that misses a parameter or a row fails too: the global tensors start as NaN.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from taxbench.config.schema import DataParallel, Device, ModelConfig, ParallelConfig, PolicyConfig, RecipeConfig
from taxbench.parallel import distributed
from taxbench.parallel.materialize import global_view
from taxbench.stacks.native import build_pipeline
from taxbench.workloads import build_model
from taxbench.workloads.init import GlobalView, fill_local, initial_values, parameter_key

MODEL = ModelConfig(kind="moe", vocab_size=64, seq_len=16, d_model=32, n_layers=4, n_heads=4, d_ff=48,
                    n_experts=4, top_k=2, moe_d_ff=24, n_shared_experts=1)
POLICY = PolicyConfig(name="deterministic", deterministic=True, deterministic_kernels=True)
SEED = 7
LAYOUTS = {
    "pp2.ep2.fsdp": ParallelConfig(pp=2, ep=2, data_parallel=DataParallel.fsdp),
    "tp2.dp2.fsdp": ParallelConfig(tp=2, data_parallel=DataParallel.fsdp),
    # DDP does not broadcast the tensor-parallel (DTensor) weights: they must start equal by construction
    "tp2.dp2.ddp": ParallelConfig(tp=2),
    "ep2.dp4.ddp": ParallelConfig(ep=2),
    "pp2.virtual2.ddp": ParallelConfig(pp=2, pp_schedule="Interleaved1F1B", virtual_stages=2),
}


def _share(rank: int, world: int, port: int, parallel: ParallelConfig, out: str) -> None:
    torch.set_num_threads(1)
    ctx = distributed.init(rank, world, rank, Device.cpu, "127.0.0.1", port)
    try:
        recipe = RecipeConfig(name="t", model=MODEL, parallel=parallel, seed=SEED, micro_batch_size=1,
                              global_batch_size=8)
        built = build_pipeline(recipe, POLICY, ctx, micro_batches=4)
        pieces = {}
        for module_name, module in built.parts.named_modules():
            for name, param in module.named_parameters(recurse=False):
                whole = param.full_tensor() if isinstance(param, DTensor) else param.detach()
                pieces[f"{module_name}.{name}"] = (getattr(module, "global_rows", None), whole.clone())
        torch.save(pieces, Path(out) / f"rank{rank}.pt")
    finally:
        distributed.shutdown()


def _gathered(parallel: ParallelConfig, tmp_path: Path, world: int = 4) -> dict[str, torch.Tensor]:
    mp.start_processes(_share, args=(world, distributed.free_port(), parallel, str(tmp_path)), nprocs=world,
                       join=True, start_method="spawn")
    reference = build_model(MODEL, deterministic_kernels=True, seed=SEED).state_dict()
    full = {name: torch.full_like(tensor, float("nan")) for name, tensor in reference.items()}
    for rank in range(world):
        for name, (rows, tensor) in torch.load(tmp_path / f"rank{rank}.pt").items():
            offset = 0 if rows is None else rows[0]
            full[name][offset:offset + tensor.shape[0]] = tensor
    return full


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_starts_from_the_unsplit_models_weights(layout: str, tmp_path: Path) -> None:
    full = _gathered(LAYOUTS[layout], tmp_path)
    reference = build_model(MODEL, deterministic_kernels=True, seed=SEED).state_dict()
    for name, expected in reference.items():
        assert not full[name].isnan().any(), f"{layout}: part of {name} is held by no rank"
        assert torch.equal(full[name].view(torch.int32), expected.view(torch.int32)), f"{layout}: {name} differs"


def test_a_shard_fills_the_values_the_whole_parameter_holds_there() -> None:
    """Any index subset, in any order, gets exactly the whole parameter's values at those indices (so chunking and
    shard boundaries cannot change a bit), and the seed and the name both change the values."""
    model = build_model(MODEL, deterministic_kernels=True, seed=SEED)
    name = "blocks.1.ffn.experts.w_up"
    whole = dict(model.named_parameters())[name].detach()
    rows, cols = torch.tensor([3, 0, 2]), torch.tensor([5, 1, 23, 7])
    local = torch.empty(3, whole.shape[1], 4)
    view = GlobalView(tuple(whole.shape), (rows, torch.arange(whole.shape[1]), cols))
    fill_local(local, view, initial_values(model)[name], parameter_key(SEED, name))
    assert torch.equal(local, whole[rows][:, :, cols])
    other_seed = torch.empty_like(whole)
    fill_local(other_seed, GlobalView.whole(whole), initial_values(model)[name], parameter_key(SEED + 1, name))
    assert not torch.equal(other_seed, whole)
    other_name = dict(model.named_parameters())["blocks.0.ffn.experts.w_up"].detach()
    assert not torch.equal(other_name, whole)
    assert abs(float(whole.std()) - 0.02) < 0.002 and abs(float(whole.mean())) < 0.002


def test_a_meta_model_is_what_preflight_and_the_plan_see() -> None:
    model = build_model(MODEL, deterministic_kernels=True)
    assert all(p.is_meta for p in model.parameters())
    view = global_view(dict(model.named_parameters())["embed.weight"])
    assert view.shape == (MODEL.vocab_size, MODEL.d_model)
