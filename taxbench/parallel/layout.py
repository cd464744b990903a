"""Parallel layout of one run: a DeviceMesh from the recipe's ParallelConfig and the world size, and the model wrapped
for it (DDP or FSDP2 fully_shard over data parallel, DTensor tensor parallel, expert parallel over all_to_all).

Rank order is (pp, edp, ep, tp) with pp outermost (stages across nodes, as torchtitan and Megatron place them) and tp
innermost: tp ranks are neighbours (NVLink on one node), and the expert-parallel group is carved out of data parallel
(dp = edp * ep, as in Megatron). Under pipeline parallelism a rank holds one part of the model per pipeline stage
(taxbench.parallel.pipeline); each part is wrapped for the stage's data/tensor/expert-parallel group the same way a
whole model is.

Communicators are created under the arm's NCCL_ALGO (see taxbench.parallel.distributed), one mesh per arm and layout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from taxbench.config.schema import ConfigError, DataParallel, ParallelConfig, PolicyConfig, RecipeConfig
from taxbench.config.shape import ParallelShape
from taxbench.parallel.distributed import DistContext
from taxbench.parallel.pipeline import StagePlaceholder, join_stages
from taxbench.runtime.determinism import arm_environment
from taxbench.workloads.dense import MLP, CausalSelfAttention


@dataclass(frozen=True)
class Layout:
    world_size: int
    dp: int
    tp: int
    pp: int
    ep: int
    data_parallel: str  # ddp | fsdp | none
    rank: int
    dp_rank: int
    tp_rank: int
    ep_rank: int
    pp_rank: int
    mesh_shape: tuple[int, ...]
    mesh_dims: tuple[str, ...]

    def manifest(self) -> dict[str, Any]:
        record = asdict(self)
        record["mesh_shape"], record["mesh_dims"] = list(self.mesh_shape), list(self.mesh_dims)
        return record


def layout_for(par: ParallelConfig, world_size: int, rank: int) -> Layout:
    """The trainer's layout for this rank (the recipe was checked by config.validate)."""
    parallel_shape = ParallelShape.of(par, world_size)
    if not parallel_shape.fits:
        raise ConfigError(
            f"world size {world_size} does not factor as pp*dp*tp with ep | dp for pp={par.pp}, tp={par.tp}, "
            f"ep={par.ep}; change cluster.cpu_ranks / cluster.gpus or recipe.parallel"
        )
    stage_world, dp = parallel_shape.stage_world, parallel_shape.dp
    dp_rank = (rank % stage_world) // par.tp
    data_parallel = par.data_parallel.value if world_size > 1 else "none"
    shape, dims = (parallel_shape.edp, par.ep, par.tp), ("edp", "ep", "tp")
    if par.pp > 1:
        shape, dims = (par.pp, *shape), ("pp", *dims)
    return Layout(
        world_size=world_size, dp=dp, tp=par.tp, pp=par.pp, ep=par.ep, data_parallel=data_parallel, rank=rank,
        dp_rank=dp_rank, tp_rank=rank % par.tp, ep_rank=dp_rank % par.ep, pp_rank=rank // stage_world,
        mesh_shape=shape, mesh_dims=dims,
    )


@dataclass(frozen=True)
class Meshes:
    full: DeviceMesh  # ([pp,] edp, ep, tp)
    dp: DeviceMesh  # edp and ep flattened: the data-parallel dimension (within a pipeline stage)

    @property
    def pp_group(self) -> dist.ProcessGroup | None:
        return self.full["pp"].get_group() if "pp" in (self.full.mesh_dim_names or ()) else None


def meshes_for(layout: Layout, ctx: DistContext, arm_policy: PolicyConfig) -> Meshes:
    """One mesh per arm and layout for the life of the process group (kept on its DistContext)."""
    key = (arm_policy.name, layout.mesh_shape)
    if key not in ctx.meshes:
        with arm_environment(arm_policy):
            mesh = init_device_mesh(ctx.device.type, layout.mesh_shape, mesh_dim_names=layout.mesh_dims)
            ctx.meshes[key] = Meshes(mesh, mesh["edp", "ep"]._flatten("dp"))
    return ctx.meshes[key]


def expert_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if callable(getattr(m, "enable_expert_parallel", None))]


def tensor_parallel_plan(model: nn.Module) -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel


    plan: dict[str, Any] = {}
    for name, module in model.named_modules():
        if isinstance(module, CausalSelfAttention):
            plan[f"{name}.qkv"], plan[f"{name}.proj"] = ColwiseParallel(), RowwiseParallel()
        elif isinstance(module, MLP):
            plan[f"{name}.up"], plan[f"{name}.down"] = ColwiseParallel(), RowwiseParallel()
    if not plan:
        raise ConfigError(
            f"recipe.parallel.tp>1 needs a model with taxbench attention/MLP blocks to shard; {type(model).__name__} "
            "has none (custom models run with tp=1)"
        )
    return plan


def dtensor_shards(tensor: DTensor) -> int:
    """Into how many distinct pieces `tensor`'s placements split it: the product of the mesh sizes of its sharded
    dims. Every split counts, Shard and FSDP2's _StridedShard alike (the dp shard of a tensor-parallel parameter:
    torch 2.13's _StridedShard is no Shard subclass, and its is_shard() is False); the ranks of a Replicate dim hold
    copies. A Partial gradient is not finished (no rank holds its value): refuse it rather than count it wrongly."""
    shards = 1
    for dim, placement in enumerate(tensor.placements):
        if placement.is_partial():
            raise ValueError(f"a gradient placed as {tensor.placements} has a pending (Partial) reduction over mesh "
                             f"dim {dim}; its norm is not defined until it is reduced")
        if not placement.is_replicate():
            shards *= tensor.device_mesh.size(dim)
    return shards


# torch's checkpoint wrapper (torchtitan's activation checkpointing wraps each block in one) holds its block under this
# name; torch's state-dict functions drop it from checkpoint keys, and so do the names faults, traces and records use.
WRAPPED_BLOCK = "._checkpoint_wrapped_module"


def unwrapped_name(name: str) -> str:
    """`name` as in the model without checkpoint wrappers (layers.1._checkpoint_wrapped_module.ffn -> layers.1.ffn)."""
    return name.replace(WRAPPED_BLOCK, "")


class ModelParts:
    """This rank's parts of the model (one, or one per pipeline stage it holds), seen as one model: parameters,
    modules (by their names in the unsplit model) and state, in part order."""

    def __init__(self, parts: list[nn.Module]) -> None:
        self.parts = parts

    def parameters(self) -> Iterator[nn.Parameter]:
        for part in self.parts:
            yield from part.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        for part in self.parts:
            for name, param in part.named_parameters():
                yield unwrapped_name(name), param

    def named_modules(self) -> Iterator[tuple[str, nn.Module]]:
        """The modules by their names in the unsplit model: a checkpoint wrapper (torchtitan's activation
        checkpointing) is not one of them, the block it wraps is, under the block's own name."""
        for part in self.parts:
            for name, module in part.named_modules():
                if not isinstance(module, (StagePlaceholder, ActivationWrapper)):
                    yield unwrapped_name(name), module

    def joined(self) -> nn.Module:
        """All parts as one module with the unsplit model's names (what a checkpoint's state dict is read from)."""
        return join_stages(self.parts)


class ParallelModel:
    """The model parts of this rank as the trainer drives them: the wrapped modules, gradient-sync control, gradient
    finishing and clipping. One part without pipeline parallelism, one per pipeline stage of this rank with it."""

    def __init__(self, parts: list[nn.Module], modules: list[nn.Module], layout: Layout, meshes: Meshes | None,
                 group: dist.ProcessGroup | None, expert_params: list[nn.Parameter],
                 reduce_experts: bool = True, tensor_parallel_params: list[nn.Parameter] | None = None) -> None:
        self.parts, self.modules, self.layout, self.group = ModelParts(parts), modules, layout, group
        self.mesh = meshes.full if meshes is not None else None
        self.dp_group = meshes.dp.get_group() if meshes is not None and meshes.dp.size() > 1 else None
        self.pp_group = meshes.pp_group if meshes is not None else None
        # Expert parameters; finish_gradients averages their gradients unless FSDP2 already reduces them.
        self.expert_params = expert_params if reduce_experts else []
        # Tensor-parallel (DTensor) parameters that DDP leaves alone; finish_gradients averages them over dp.
        self.tensor_parallel_params = tensor_parallel_params or []
        self._expert_ids = {id(p) for p in expert_params}
        self._generic_clip = (layout.ep > 1 or layout.pp > 1
                              or any(isinstance(p, DTensor) for part in parts for p in part.parameters()))

    def sliced_names(self) -> set[str]:
        """Parameters (names in the unsplit model) that each rank holds a different slice of under the same name,
        beyond what a DTensor shows: the experts, each rank holding 1/ep of them. The checkpoint saves each as one
        global tensor (`global_view`)."""
        if self.layout.ep == 1:
            return set()
        return {name for name, p in self.parts.named_parameters() if id(p) in self._expert_ids}

    def global_view(self, name: str, local: torch.Tensor) -> DTensor:
        """This rank's slice of the sliced parameter `name` (the parameter, or optimizer state shaped like it) as a
        DTensor over the whole of it: experts split over the ep ranks in ep-rank order (enable_expert_parallel), each
        slice split again over its edp ranks when FSDP2 shards it (a DTensor on the edp mesh). The local data is
        shared, not copied."""
        from torch.distributed.tensor.placement_types import _StridedShard

        del name  # every sliced parameter here is an expert tensor, split the same way
        assert self.mesh is not None and self.layout.ep > 1
        ep = self.layout.ep
        if isinstance(local, DTensor):
            if tuple(local.placements) != (Shard(0),):
                raise ValueError(f"expert tensor sharded as {local.placements} over edp; checkpoints expect Shard(0)")
            # ep splits the experts first, then edp splits each ep slice: edp's shard is strided over the ep slices.
            mesh, placements = self.mesh["edp", "ep"], (_StridedShard(0, split_factor=ep), Shard(0))
        else:
            mesh, placements = self.mesh["ep"], (Shard(0),)
        shape = (local.shape[0] * ep, *local.shape[1:])
        data = local.to_local() if isinstance(local, DTensor) else local
        return DTensor.from_local(data, mesh, placements, run_check=False, shape=torch.Size(shape),
                                  stride=torch.empty(shape, device="meta").stride())

    @property
    def module(self) -> nn.Module:
        """The (first) wrapped module: the whole model without pipeline parallelism."""
        return self.modules[0]

    @contextmanager
    def gradient_sync(self, enabled: bool) -> Iterator[None]:
        """Skip the data-parallel gradient reduction on all but the last micro-batch of a step."""
        if isinstance(self.module, nn.parallel.DistributedDataParallel) and not enabled:
            with self.module.no_sync():
                yield
            return
        set_sync = getattr(self.module, "set_requires_gradient_sync", None)  # FSDP2
        if callable(set_sync):
            set_sync(enabled)
        with nullcontext():
            yield

    def finish_gradients(self) -> None:
        """Gradients DDP leaves alone (experts; tensor-parallel DTensors, which DDP cannot bucket) become the mean over
        all data-parallel ranks."""
        for param in self.tensor_parallel_params:
            if param.grad is None:
                continue
            local = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
            if self.dp_group is not None:
                dist.all_reduce(local, group=self.dp_group)
            local.div_(self.layout.dp)
        if not self.expert_params or self.mesh is None:
            return
        edp_group = self.mesh["edp"].get_group() if self.mesh["edp"].size() > 1 else None
        for param in self.expert_params:
            if param.grad is None:
                continue
            if edp_group is not None:
                dist.all_reduce(param.grad, group=edp_group)
            param.grad.div_(self.layout.dp)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the norm of the whole model's gradient (all shards), identical on every rank; returns the norm."""
        params = [p for p in self.parts.parameters() if p.grad is not None]
        if not self._generic_clip:
            return torch.nn.utils.clip_grad_norm_(params, max_norm)
        # Sum of squares of the local shards, each divided by how many ranks of its pipeline stage hold that same
        # shard, summed over the world: every element of every parameter counts exactly once.
        world = self.layout.world_size // self.layout.pp
        device = params[0].grad.device if params else torch.device("cpu")
        total = torch.zeros((), dtype=torch.float32, device=device)
        for param in params:
            grad = param.grad
            shards = 1
            local = grad
            if isinstance(grad, DTensor):
                shards = dtensor_shards(grad)
                local = grad.to_local()
            # Expert parallelism: each expert lives on 1/ep of the ranks (beyond what a DTensor mesh shows).
            holders = world // shards // (self.layout.ep if id(param) in self._expert_ids else 1)
            total = total + local.detach().float().pow(2).sum() / holders
        if self.layout.world_size > 1:
            dist.all_reduce(total, group=self.group)
        norm = total.sqrt()
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for param in params:
            grad = param.grad
            (grad.to_local() if isinstance(grad, DTensor) else grad).mul_(scale.to(grad.dtype))
        return norm


def parallelize(parts: list[nn.Module], recipe: RecipeConfig, ctx: DistContext, arm_policy: PolicyConfig,
                materialize: Callable[[nn.Module], None]) -> ParallelModel:
    """Shard each part for the recipe's layout (experts, tensor parallel, FSDP2: all possible on the meta device),
    then `materialize` it (this rank's share on ctx.device), then wrap it in DDP where the layout asks for it (DDP
    needs real tensors)."""
    layout = layout_for(recipe.parallel, ctx.world_size, ctx.rank)
    if ctx.world_size == 1:
        for part in parts:
            materialize(part)
        return ParallelModel(parts, parts, layout, None, None, [])
    group = ctx.group_for(arm_policy)
    fsdp = recipe.parallel.data_parallel is DataParallel.fsdp
    if layout.tp == 1 and layout.ep == 1 and layout.pp == 1:
        (model,) = parts
        if fsdp:
            from torch.distributed.fsdp import fully_shard

            mesh = DeviceMesh.from_group(group, ctx.device.type)
            _fully_shard_blocks(model, mesh, fully_shard)
            materialize(model)
            return ParallelModel(parts, parts, layout, None, group, [])
        materialize(model)
        ddp = nn.parallel.DistributedDataParallel(model, process_group=group)
        return ParallelModel(parts, [ddp], layout, None, group, [])

    meshes = meshes_for(layout, ctx, arm_policy)
    wrapped, expert_params, tp_params = [], [], []
    for part in parts:
        module, experts, manual = _parallelize_part(part, layout, meshes, fsdp, materialize)
        wrapped.append(module)
        expert_params += experts
        tp_params += manual
    return ParallelModel(parts, wrapped, layout, meshes, group, expert_params, reduce_experts=not fsdp,
                         tensor_parallel_params=tp_params)


def _parallelize_part(model: nn.Module, layout: Layout, meshes: Meshes, fsdp: bool,
                      materialize: Callable[[nn.Module], None],
                      ) -> tuple[nn.Module, list[nn.Parameter], list[nn.Parameter]]:
    """EP, then TP, then FSDP2 or DDP over the stage's data-parallel ranks; the module to run, its expert params and
    the tensor-parallel params whose gradients ParallelModel.finish_gradients averages over dp (DDP's, see below).

    FSDP2 with EP shards each layer's experts over the expert-data-parallel ranks (the ranks holding the same experts)
    and the rest over all data-parallel ranks, as torchtitan does; expert gradients are divided by dp, so that they
    are the mean over every data-parallel rank like the others.

    DDP with TP: DDP's reducer works on plain tensors (its constructor broadcasts every parameter with one
    aten.cat, which fails on a mix of DTensor and plain tensors), and torch's own DDP+TP workaround (a sliced
    device_mesh) swaps the parameter objects on every forward, behind the optimizer's and activation recompute's
    back. So DDP ignores the DTensor parameters, as it ignores the experts, and their gradients are averaged over the
    data-parallel group once per step after the last micro-batch."""
    mesh = meshes.full
    experts = expert_modules(model) if layout.ep > 1 else []
    if layout.ep > 1:
        if not experts:
            raise ConfigError(f"recipe.parallel.ep={layout.ep} needs an MoE model (recipe.model.kind=moe)")
        for module in experts:
            module.enable_expert_parallel(mesh["ep"].get_group())
    if layout.tp > 1:
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(model, mesh["tp"], tensor_parallel_plan(model))
    dp_mesh = meshes.dp
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for module in experts:
            fully_shard(module.experts, mesh=mesh["edp"])
            module.experts.set_gradient_divide_factor(float(layout.dp))
        _fully_shard_blocks(model, dp_mesh, fully_shard)
        materialize(model)
        return model, [p for module in experts for p in module.experts.parameters()], []
    materialize(model)
    expert_params = [p for module in experts for p in module.experts.parameters()]
    if dp_mesh.size() == 1 and not expert_params:
        return model, [], []
    tp_params = [p for p in model.parameters() if isinstance(p, DTensor)]
    if expert_params or tp_params:
        ignored = {id(p) for p in expert_params + tp_params}
        names = [name for name, p in model.named_parameters() if id(p) in ignored]
        nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)
    ddp = nn.parallel.DistributedDataParallel(model, process_group=dp_mesh.get_group())
    return ddp, expert_params, tp_params


def _fully_shard_blocks(model: nn.Module, mesh: DeviceMesh, fully_shard: Any) -> None:
    for block in getattr(model, "blocks", []):
        if any(True for _ in block.parameters()):  # a pipeline stage's placeholders for blocks it does not own
            fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
