"""This rank's share of a model built on the meta device, materialised with layout-invariant initial values.

A rank never holds the whole model: the model is built on the meta device, split into its pipeline stages, its
experts sliced for expert parallelism and its parameters sharded (FSDP2 / tensor parallel DTensors), all on meta;
only then does `materialize` allocate this rank's tensors on its device and fill them with the values the unsplit
model holds there (taxbench.workloads.init). Where a sharded parameter's elements lie in the unsplit one comes from
its DTensor placements (Shard and FSDP2's strided shards, composed in DTensor's own order) and, for expert
parallelism, from the expert slice the layer keeps (`global_rows`).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Shard, _StridedShard

from taxbench.workloads.init import GlobalView, fill_model


def global_view(param: torch.Tensor, global_rows: tuple[int, int] | None = None) -> GlobalView:
    """The global view of a (possibly DTensor) parameter. `global_rows` = (offset, total): the parameter is rows
    [offset, offset + n) along dim 0 of a (total, ...) tensor (an expert-parallel slice) before any DTensor sharding."""
    shape = tuple(param.shape)
    indices = [torch.arange(n) for n in shape]
    if isinstance(param, DTensor):
        coordinate = param.device_mesh.get_coordinate()
        if coordinate is None:
            raise ValueError("this rank holds no part of the parameter's mesh")
        for mesh_dim, placement in enumerate(param.placements):
            if not isinstance(placement, Shard | _StridedShard):
                continue  # Replicate / Partial: every rank holds the whole dimension
            dim, chunks = placement.dim, param.device_mesh.size(mesh_dim)
            if isinstance(placement, _StridedShard):
                size, offsets = _strided_offsets(placement, len(indices[dim]), chunks, coordinate[mesh_dim])
                local = torch.tensor(offsets if size else [], dtype=torch.long)
            else:
                size, start = placement._local_shard_size_and_offset(len(indices[dim]), chunks, coordinate[mesh_dim])
                local = torch.arange(int(start), int(start) + size)
            indices[dim] = indices[dim][local]
    if global_rows is not None:
        offset, total = global_rows
        indices[0] = indices[0] + offset
        shape = (total, *shape[1:])
    return GlobalView(shape, tuple(indices))


def _strided_offsets(placement: _StridedShard, length: int, chunks: int, coordinate: int) -> tuple[int, list[int]]:
    """All offsets of a strided shard. DTensor's private method asks for them with `offset_mode=ALL` from torch 2.12
    and with `return_first_offset=False` before (2.11: the CUDA image of the lent GPU machine)."""
    parameters = inspect.signature(placement._local_shard_size_and_offset).parameters
    if "offset_mode" in parameters:
        from torch.distributed.tensor.placement_types import _StridedShardOffsetMode

        return placement._local_shard_size_and_offset(length, chunks, coordinate, _StridedShardOffsetMode.ALL)
    return placement._local_shard_size_and_offset(length, chunks, coordinate, return_first_offset=False)


def _global_rows(model: nn.Module) -> dict[str, tuple[int, int]]:
    """Parameter name -> (offset, total) for the parameters of modules that keep a slice of their rows."""
    found = {}
    for module_name, module in model.named_modules():
        rows = getattr(module, "global_rows", None)
        if rows is not None:
            for param_name, _ in module.named_parameters(recurse=False):
                found[f"{module_name}.{param_name}" if module_name else param_name] = rows
    return found


def local_and_view(param: torch.Tensor, global_rows: tuple[int, int] | None = None,
                   ) -> tuple[torch.Tensor, GlobalView]:
    """This rank's tensor of a (possibly DTensor) parameter and where it lies in the unsplit parameter."""
    local = param.to_local() if isinstance(param, DTensor) else param
    return local, global_view(param, global_rows)


def parameter_views(model: nn.Module) -> Iterator[tuple[str, torch.Tensor, GlobalView]]:
    """Every parameter of this rank's share (a model part) by its name in the unsplit model: its local tensor and
    where that lies in the unsplit parameter."""
    rows = _global_rows(model)
    for name, param in model.named_parameters():
        local, view = local_and_view(param, rows.get(name))
        yield name, local, view


def buffer_views(model: nn.Module) -> Iterator[tuple[str, torch.Tensor, GlobalView]]:
    """Every persistent buffer of this rank's share (those its state dict holds; names as in the unsplit model): its
    local tensor and where that lies in the unsplit buffer. A DTensor buffer lies where its placements say; a plain
    one is taken as whole, replicated on every rank that holds it (FSDP2 and the pipeline split leave buffers whole,
    torchtitan's expert parallelism slices only DTensors, and taxbench's workloads hold no buffers), so ranks holding
    different values or shapes of it are found out by the digest, not merged."""
    for module_name, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if name not in module._non_persistent_buffers_set:
                yield f"{module_name}.{name}" if module_name else name, *local_and_view(buffer)


def materialize(model: nn.Module, device: torch.device, seed: int) -> None:
    """Allocate this rank's share of a meta-device model on `device` and fill every parameter by its rule."""
    rows = _global_rows(model)
    fill_model(model, device, seed, lambda name, param: local_and_view(param, rows.get(name)))
