"""A digest of a model's weights that no layout can change: the same bits give the same digest whether one rank
holds the whole model or its parameters lie split over pipeline stages, expert slices, FSDP2 and tensor-parallel
shards, and replicated over data-parallel ranks.

Each element contributes mix(mix(global index * GOLDEN + key(name)) ^ bits) (splitmix64, int64 wraparound), where
the global index is its place in the unsplit parameter (taxbench.parallel.materialize's global view, the one the
layout-invariant initial values use) and bits its exact bit pattern. A parameter's body is the sum of those mod 2**64:
a sum is the same in any order and any split, so every rank sums its own shard (as four 16-bit lanes in int64, exact
for up to 2**47 elements), rank 0 adds the shards up, and the parameter's digest is mix(body ^ header(dtype, unsplit
shape)). A shard held by several ranks (data-parallel replicas) is counted once, and those ranks must agree on it;
the element count and the sum of global indices must come out as the unsplit parameter's, so a shard counted twice or
missed is a problem the digest reports instead of a value. The model digest hashes every parameter's digest by name.

Persistent buffers (those a state dict holds: torchtitan's MoE routers keep their load-balancing expert bias in one,
changed by every optimizer step) are digested the same way under their names, apart from the parameters. A buffer that
is not a DTensor is whole on every rank holding it (taxbench.parallel.materialize.buffer_views): held by several
ranks, they must agree on it, or the digest reports the problem.

Costs about twenty int64 passes over the weights: taken at the first and the last step of a run, never per step.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from taxbench.fingerprint import GOLDEN, MASK64, header, mix, mix_int, signed64
from taxbench.parallel.materialize import buffer_views, parameter_views
from taxbench.workloads.init import GlobalView, global_index_chunks

_LANE_BITS = 16
_LANES = 4
_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def parameter_key(name: str) -> int:
    return signed64(int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little"))


@dataclass(frozen=True)
class ShardSum:
    """One rank's sums over its shard of one parameter."""

    name: str  # in the unsplit model
    shard: str  # which elements: ranks holding the same shard (replicas) have the same id
    dtype: str
    shape: tuple[int, ...]  # of the unsplit parameter
    elements: int
    index_sum: int
    lanes: tuple[int, ...]  # the 16-bit lanes of the element hashes, each summed
    buffer: bool = False  # a persistent buffer, not a parameter


def _bits(local: torch.Tensor) -> torch.Tensor:
    """Each element's bit pattern as a non-negative int64."""
    width = local.element_size()
    bits = local.detach().contiguous().view(_INT_OF_WIDTH[width]).to(torch.int64)
    return bits & ((1 << 8 * width) - 1) if width < 8 else bits


def _shard_id(view: GlobalView) -> str:
    digest = hashlib.blake2b(repr(view.shape).encode(), digest_size=8)
    for indices in view.indices:
        digest.update(indices.to(torch.int64).contiguous().numpy().tobytes())
        digest.update(b"|")
    return digest.hexdigest()


def shard_sum(name: str, local: torch.Tensor, view: GlobalView, buffer: bool = False) -> ShardSum:
    key = parameter_key(name)
    bits = _bits(local).reshape(len(view.indices[0]) if view.shape else 1, -1)
    lanes = [0] * _LANES
    index_sum = 0
    if local.numel():
        for rows, index in global_index_chunks(view, local.device):
            hashed = mix(mix(index * signed64(GOLDEN) + key) ^ bits[rows])
            for lane in range(_LANES):
                lanes[lane] += int(((hashed >> (_LANE_BITS * lane)) & 0xFFFF).sum())
            index_sum += int(index.sum())
    return ShardSum(name, _shard_id(view), str(local.dtype), tuple(view.shape), local.numel(), index_sum,
                    tuple(lanes), buffer)


def shard_sums(parts: Iterable[nn.Module]) -> list[ShardSum]:
    """This rank's sums over every parameter and persistent buffer it holds (`parts`: its model parts, names as in
    the unsplit model)."""
    sums = []
    with torch.no_grad():
        for part in parts:
            sums += [shard_sum(name, local, view) for name, local, view in parameter_views(part)]
            sums += [shard_sum(name, local, view, buffer=True) for name, local, view in buffer_views(part)]
    return sums


@dataclass
class WeightsDigest:
    model: str | None  # None when a problem keeps the digest from standing for the whole model
    parameters: dict[str, str] = field(default_factory=dict)  # name -> digest (hex)
    elements: int = 0  # of the parameters and buffers
    problems: list[str] = field(default_factory=list)
    buffers: dict[str, str] = field(default_factory=dict)  # persistent buffers: name -> digest (hex)

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "elements": self.elements, "parameters": self.parameters,
                "buffers": self.buffers, "problems": self.problems}


def combine(per_rank: list[list[ShardSum]]) -> WeightsDigest:
    """The model's digest from every rank's shard sums (index = rank)."""
    shards: dict[str, dict[str, tuple[int, ShardSum]]] = {}
    problems = []
    for rank, sums in enumerate(per_rank):
        for found in sums:
            held = shards.setdefault(found.name, {})
            first = held.get(found.shard)
            if first is None:
                held[found.shard] = (rank, found)
            elif (first[1].lanes, first[1].dtype) != (found.lanes, found.dtype):
                problems.append(f"{found.name}: ranks {first[0]} and {rank} hold the same shard with different "
                                "values (replicas disagree)")
    digests: dict[bool, dict[str, str]] = {False: {}, True: {}}  # buffer? -> name -> digest
    elements = 0
    for name in sorted(shards):
        held = [s for _, s in shards[name].values()]
        shape, dtypes, kinds = held[0].shape, {s.dtype for s in held}, {s.buffer for s in held}
        numel = math.prod(shape)
        count, index_sum = sum(s.elements for s in held), sum(s.index_sum for s in held)
        if count != numel or index_sum != numel * (numel - 1) // 2 or len(dtypes) > 1 or len(kinds) > 1 or \
                any(s.shape != shape for s in held):
            problems.append(f"{name}: the shards hold {count} elements of its {numel} ({len(held)} distinct shards, "
                            f"dtypes {sorted(dtypes)}{', a parameter on some ranks' if len(kinds) > 1 else ''}): an "
                            "element is missing or counted twice")
            continue
        body = sum(sum(s.lanes[lane] << (_LANE_BITS * lane) for lane in range(_LANES)) for s in held) & MASK64
        dtype = getattr(torch, held[0].dtype.removeprefix("torch."))
        digests[held[0].buffer][name] = f"{mix_int(body ^ header(dtype, shape)):016x}"
        elements += numel
    parameters, buffers = digests[False], digests[True]
    lines = [f"{name} {value}\n" for name, value in parameters.items()]
    lines += [f"buffer {name} {value}\n" for name, value in buffers.items()]
    model = None if problems else hashlib.blake2b("".join(lines).encode(), digest_size=8).hexdigest()
    return WeightsDigest(model, parameters, elements, problems, buffers)


def gather_digest(parts: Iterable[nn.Module], rank: int, world_size: int) -> WeightsDigest | None:
    """The layout-invariant digest of the model whose parts every rank passes (a collective when world_size > 1);
    rank 0 gets it, the others None."""
    sums = shard_sums(parts)
    if world_size == 1 or not dist.is_initialized():
        return combine([sums])
    gathered: list[list[ShardSum]] | None = [[] for _ in range(world_size)] if rank == 0 else None
    dist.gather_object(sums, gathered, dst=0)
    return combine(gathered) if gathered is not None else None
