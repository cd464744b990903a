"""A rank's Megatron-Core model chunks seen as one model under the unsplit model's names, and their initial values
drawn by those names.

Megatron names a chunk's parameters locally: a pipeline stage's layers count from 0 (`decoder.layers.0` of stage 1 is
the model's layer `layer_number - 1`), and an expert-parallel rank's experts count from 0 (`local_experts.0` of ep
rank 1 is global expert `local_expert_indices[0]`). `unsplit_view` registers the same Parameter objects in a module
tree with the global names (the checkpoint's state dict, fingerprints and optimizer-state keys read those), so a
checkpoint written at ep=2 or pp=2 holds the keys and values of the one written at ep=1, pp=1.

`initialize` fills every parameter from taxbench's counter-based generator (taxbench.workloads.init) keyed by its
global name, at its global element indices: Megatron's host initialisation draws from one torch generator in build
order, so every ep rank's experts would start equal (each rank draws its local experts first) and a pipeline stage's
layers would depend on how many layers the earlier stages drew. Drawn by global name, every layout starts from the
same global weights. Rules: matrices and embeddings N(0, 0.02^2) (Megatron's init_method_std; its scaled init of the
output projections is not reproduced), layer-norm weights one, biases zero.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
from torch import nn

from taxbench.workloads.init import GlobalView, InitRule, fill_local, parameter_key

NORMAL_STD = 0.02
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"^(mlp\.experts\.local_experts)\.(\d+)\.(.*)$")


def _layer_names(chunk: nn.Module) -> dict[int, tuple[int, list[int]]]:
    """Local layer index -> (global layer index, the global ids of its local experts; empty without MoE)."""
    decoder = getattr(chunk, "decoder", None)
    layers = getattr(decoder, "layers", None) or []
    names: dict[int, tuple[int, list[int]]] = {}
    for index, layer in enumerate(layers):
        experts = list(getattr(getattr(layer, "mlp", None), "local_expert_indices", []))
        names[index] = (int(layer.layer_number) - 1, experts)
    return names


def global_name(local: str, layers: dict[int, tuple[int, list[int]]]) -> str:
    """The unsplit model's name of a chunk's parameter or buffer `local`."""
    match = _LAYER.match(local)
    if match is None:
        return local
    index, rest = int(match.group(1)), match.group(2)
    number, experts = layers[index]
    expert = _EXPERT.match(rest)
    if expert is not None:
        rest = f"{expert.group(1)}.{experts[int(expert.group(2))]}.{expert.group(3)}"
    return f"decoder.layers.{number}.{rest}"


def named_tensors(chunks: list[nn.Module]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter and persistent buffer of the chunks under its global name, in chunk order."""
    seen: set[str] = set()
    for chunk in chunks:
        layers = _layer_names(chunk)
        for local, tensor in chunk.state_dict(keep_vars=True).items():
            if not isinstance(tensor, torch.Tensor):
                continue  # Transformer Engine's _extra_state
            name = global_name(local, layers)
            if name in seen:
                raise ValueError(f"two of this rank's Megatron chunks hold {name}")
            seen.add(name)
            yield name, tensor


def unsplit_view(chunks: list[nn.Module]) -> nn.Module:
    """One module holding the chunks' parameters and persistent buffers (shared, not copied) under global names."""
    root = nn.Module()
    for name, tensor in named_tensors(chunks):
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if part not in module._modules:
                module.add_module(part, nn.Module())
            module = module._modules[part]
        if isinstance(tensor, nn.Parameter):
            module.register_parameter(leaf, tensor)
        else:
            module.register_buffer(leaf, tensor)
    return root


def initial_rule(name: str, tensor: torch.Tensor) -> InitRule:
    if name.endswith("bias"):
        return InitRule("zeros")
    if tensor.dim() == 1:  # layer norms (Megatron's are LayerNorm: weight and bias)
        return InitRule("ones")
    return InitRule("normal", NORMAL_STD)


def tensor_parallel_view(param: torch.Tensor, tp: int, tp_rank: int) -> GlobalView:
    """Where this tensor-parallel rank's slice lies in the unsplit parameter (Megatron splits contiguously along
    `partition_dim`, as its host initialisation does)."""
    if not getattr(param, "tensor_model_parallel", False) or tp == 1:
        return GlobalView.whole(param)
    dim = int(param.partition_dim)
    shape = list(param.shape)
    shape[dim] *= tp
    indices = tuple(torch.arange(n) + (tp_rank * n if d == dim else 0) for d, n in enumerate(param.shape))
    return GlobalView(tuple(shape), indices)


def initialize(chunks: list[nn.Module], seed: int, tp: int, tp_rank: int) -> None:
    """Fill every parameter of the chunks by its global name (see the module docstring); buffers keep their values."""
    with torch.no_grad():
        for name, tensor in named_tensors(chunks):
            if not isinstance(tensor, nn.Parameter):
                continue
            host = torch.empty(tensor.shape, dtype=tensor.dtype)
            fill_local(host, tensor_parallel_view(tensor, tp, tp_rank), initial_rule(name, tensor),
                       parameter_key(seed, name))
            tensor.copy_(host)
