"""Initial values of taxbench's workloads: which rule each parameter follows, and a generator whose every value is a
function of (recipe seed, parameter name in the unsplit model, element index in the unsplit parameter) only.

That makes initial weights layout invariant: a rank that holds a slice of a parameter (a pipeline stage, an expert
slice, an FSDP2 or tensor-parallel shard) fills exactly the values the unsplit model holds there
(taxbench.parallel.materialize works out where its slice lies), so every layout starts from bitwise the same global
weights. The generator is counter based: the element's global linear index, mixed with a key hashed from the seed
and the name, goes through splitmix64 (int64 arithmetic with wraparound, identical on every device and thread
count); a normal weight is the Irwin-Hall sum of four 16-bit lanes of that hash, centred and scaled to the rule's
standard deviation (bounded at +/-3.46 std, like a truncated normal). Integer sums and one float multiply: no
transcendental function whose last bit could depend on vectorisation or on how many elements a rank holds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import xxhash
from torch import nn

from taxbench.workloads.moe import GroupedExperts

NORMAL_STD = 0.02


@dataclass(frozen=True)
class InitRule:
    kind: str  # "normal", "zeros" or "ones"
    std: float = 0.0


@dataclass(frozen=True)
class GlobalView:
    """Where a local tensor of a parameter lies in the unsplit parameter: the unsplit shape and, per dimension, the
    global indices of the local rows/columns (in local order)."""

    shape: tuple[int, ...]
    indices: tuple[torch.Tensor, ...]

    @classmethod
    def whole(cls, tensor: torch.Tensor) -> GlobalView:
        return cls(tuple(tensor.shape), tuple(torch.arange(n) for n in tensor.shape))


def initial_values(model: nn.Module) -> dict[str, InitRule]:
    """Parameter name -> its rule, for taxbench's dense and MoE GPTs (GPT-2 style: weights N(0, 0.02^2), biases
    zero, layer norms one)."""
    rules: dict[str, InitRule] = {}
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        if isinstance(module, nn.Linear | nn.Embedding | GroupedExperts):
            for name, _ in module.named_parameters(recurse=False):
                rules[prefix + name] = InitRule("zeros") if name == "bias" else InitRule("normal", NORMAL_STD)
        elif isinstance(module, nn.LayerNorm):
            for name, _ in module.named_parameters(recurse=False):
                rules[prefix + name] = InitRule("ones" if name == "weight" else "zeros")
    return rules


# Elements generated at once: the int64 temporaries cost ~32 bytes per element, so 4M elements hold ~128 MiB.
CHUNK_ELEMENTS = 1 << 22
_LANE = 0xFFFF
_LANE_STD = 65536 / 12**0.5  # standard deviation of one uniform 16-bit lane
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _signed(value: int) -> int:
    """An unsigned 64-bit constant as the int64 torch stores (two's complement)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 lanes (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mixed(index: torch.Tensor, key: int) -> torch.Tensor:
    """splitmix64 of (index * golden + key): 64 well-mixed bits per element, in int64 with wraparound."""
    z = index * _signed(_GOLDEN) + _signed(key)
    z = (z ^ _shift_right(z, 30)) * _signed(_MIX1)
    z = (z ^ _shift_right(z, 27)) * _signed(_MIX2)
    return z ^ _shift_right(z, 31)


def normal_values(index: torch.Tensor, key: int, std: float, dtype: torch.dtype) -> torch.Tensor:
    """Approximately N(0, std^2) values, one per global index: the sum of four 16-bit lanes of its hash, centred."""
    z = mixed(index, key)
    lanes = (z & _LANE) + (_shift_right(z, 16) & _LANE) + (_shift_right(z, 32) & _LANE) + _shift_right(z, 48)
    centred = (2 * lanes - 4 * _LANE).to(torch.float32)  # an integer below 2**19: exact in float32
    return (centred * (std / (2 * 2 * _LANE_STD))).to(dtype)


def parameter_key(seed: int, name: str) -> int:
    return xxhash.xxh64_intdigest(f"{seed}/{name}".encode())


def fill_local(local: torch.Tensor, view: GlobalView, rule: InitRule, key: int) -> None:
    """Fill `local` (this rank's tensor of the parameter) as the rule fills the unsplit parameter."""
    if tuple(len(i) for i in view.indices) != tuple(local.shape):
        raise ValueError(f"local shape {tuple(local.shape)} does not match its global view "
                         f"{tuple(len(i) for i in view.indices)}")
    if rule.kind == "zeros":
        local.zero_()
        return
    if rule.kind == "ones":
        local.fill_(1.0)
        return
    if local.numel() == 0:
        return
    flat = local.view(len(view.indices[0]) if view.shape else 1, -1)
    for rows, index in global_index_chunks(view, local.device):
        flat[rows].copy_(normal_values(index, key, rule.std, local.dtype))


def global_index_chunks(view: GlobalView, device: torch.device) -> Iterator[tuple[slice, torch.Tensor]]:
    """The global linear index of every local element, in chunks of local rows (dimension 0) of about
    CHUNK_ELEMENTS: (the local rows, their indices as a [rows, elements per row] int64 tensor on `device`)."""
    strides = [1] * len(view.shape)
    for dim in range(len(view.shape) - 2, -1, -1):
        strides[dim] = strides[dim + 1] * view.shape[dim + 1]
    rows = view.indices[0].to(device) * strides[0] if view.shape else torch.zeros(1, dtype=torch.long, device=device)
    rest = torch.zeros((), dtype=torch.long, device=device)
    for dim in range(1, len(view.shape)):
        rest = rest.unsqueeze(-1) + view.indices[dim].to(device) * strides[dim]
    rest = rest.reshape(-1)
    step = max(1, CHUNK_ELEMENTS // max(1, rest.numel()))
    for start in range(0, len(rows), step):
        yield slice(start, start + step), rows[start:start + step, None] + rest[None, :]


ViewOf = Callable[[str, torch.Tensor], tuple[torch.Tensor, GlobalView]]


def fill_model(model: nn.Module, device: torch.device | str, seed: int, view_of: ViewOf) -> None:
    """Allocate a meta-device model (or this rank's share of it) on `device` and fill every parameter by its rule;
    `view_of(name, param)` gives the tensor to fill and where it lies in the unsplit parameter."""
    model.to_empty(device=device)
    rules = initial_values(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            rule = rules.get(name)
            if rule is None:
                raise ValueError(f"parameter {name} has no initial-value rule (taxbench.workloads.init)")
            local, view = view_of(name, param)
            fill_local(local, view, rule, parameter_key(seed, name))
    for name, buffer in model.named_buffers():
        raise ValueError(f"buffer {name} {tuple(buffer.shape)} of a meta-device model has no initial value; "
                         "taxbench's workloads hold none")


def initialize(model: nn.Module, seed: int, device: torch.device | str = "cpu") -> nn.Module:
    """A whole (unsplit, unsharded) meta-device model allocated on `device` and filled: the values every layout's
    shards reproduce."""
    fill_model(model, device, seed, lambda name, param: (param, GlobalView.whole(param)))
    return model
