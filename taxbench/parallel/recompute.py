"""Activation recompute (`recipe.activation_checkpointing`): one function applies it per transformer block, as
torchtitan does; the model code knows nothing about it.

- none: every block keeps what its backward needs.
- full: a block keeps only its inputs; its backward reruns its forward.
- selective: op-level selective checkpointing: a block also keeps the outputs of matmul-like ops (mm, addmm, bmm,
  grouped mm, fused attention) and of top-k routing; its backward reruns the cheap ops between them.

Both recompute modes use non-reentrant torch.utils.checkpoint with the RNG state stashed and replayed, so the
recomputed forward is the forward (dropout draws the same mask) and losses, gradients and parameters stay bitwise
equal to none's. Early stopping is off: the recompute runs each block's forward to its end, so forward hooks inside
the block (tracing, fault injection) see every module they entered also leave.

The module tree is not changed: a wrapped block gets an instance-level `forward` that checkpoints its class's forward,
so parameter and module names (blocks.1.ffn), state_dict keys and fingerprints are those of the unwrapped model. The
wrapper is a functools.partial bound to its block, so copy.deepcopy (pipeline stages are deep copies of the model)
binds each copy's forward to that copy. Applying is pure bookkeeping and works on a meta-device model; apply it after
building the model and before parallelizing or splitting it into pipeline stages.

A forward with side effects that must happen once per forward (accumulating a statistic, say) asks `recomputing()`,
(taxbench.workloads.replay, beside the models that ask), which is true while a backward reruns a block's
forward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from taxbench.config.schema import ActivationCheckpointing, ConfigError
from taxbench.workloads.replay import recompute_flag

ContextFn = Callable[[], Any]

def _op_overloads(names: list[str]) -> set[Any]:
    """The default overloads of the ATen ops in `names` that this torch build has."""
    return {getattr(torch.ops.aten, name).default for name in names if hasattr(torch.ops.aten, name)}


def _fused_attention_ops() -> list[str]:
    return [name for name in dir(torch.ops.aten)
            if name.startswith("_scaled_dot_product") and "attention" in name and not name.endswith("_backward")]


# Ops whose outputs selective checkpointing keeps: the expensive ones (matmuls and fused attention; aten.linear where
# a backend dispatches it unsplit) and top-k routing, which torchtitan also keeps so that recompute cannot route a
# token to another expert.
SELECTIVE_SAVE_OPS: frozenset[Any] = frozenset(_op_overloads(
    ["mm", "addmm", "bmm", "baddbmm", "linear", "_grouped_mm", "topk", *_fused_attention_ops()]
))


def selective_policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Keep the outputs of SELECTIVE_SAVE_OPS, recompute everything else."""
    return CheckpointPolicy.MUST_SAVE if func in SELECTIVE_SAVE_OPS else CheckpointPolicy.MUST_RECOMPUTE


def _selective_contexts() -> Any:
    return create_selective_checkpoint_contexts(selective_policy)


def _checkpointed_forward(block: nn.Module, context_fn: ContextFn | None, *args: Any, **kwargs: Any) -> Any:
    """The block's forward under non-reentrant checkpoint (the class's forward: FSDP2's class swap keeps it)."""
    calls = 0

    def run(*inner_args: Any, **inner_kwargs: Any) -> Any:
        nonlocal calls
        calls += 1  # checkpoint runs it once in the forward, then again for each recompute in the backward
        with recompute_flag(calls > 1):
            return type(block).forward(block, *inner_args, **inner_kwargs)

    extra = {} if context_fn is None else {"context_fn": context_fn}
    return checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True, early_stop=False, **extra, **kwargs)


def transformer_blocks(model: nn.Module) -> list[nn.Module] | None:
    """The model's transformer blocks (`model.blocks`, an nn.ModuleList or nn.ModuleDict), or None if it has none.

    Blocks a pipeline stage does not own (nn.Identity placeholders) are left out: they keep nothing to recompute.
    """
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.Module):
        return None
    children = blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks.children()
    return [block for block in children if not isinstance(block, nn.Identity)]


def recompute_mode(mode: ActivationCheckpointing | str) -> ActivationCheckpointing:
    try:
        return ActivationCheckpointing(mode)
    except ValueError:
        raise ConfigError(f"recipe.activation_checkpointing={mode!r} is unknown; choose one of "
                          f"{[m.value for m in ActivationCheckpointing]}") from None


def activation_checkpointing_problem(model: nn.Module, mode: ActivationCheckpointing | str) -> str | None:
    """Why `mode` cannot apply to `model` (one line naming the key and the fix), or None; no tensor is touched."""
    mode = recompute_mode(mode)
    if mode is ActivationCheckpointing.none or transformer_blocks(model) is not None:
        return None
    return (f"recipe.activation_checkpointing={mode.value} recomputes per transformer block, but the model "
            f"({type(model).__name__}) has no `blocks` attribute (an nn.ModuleList or nn.ModuleDict of its blocks); "
            "expose its blocks as `blocks` or set recipe.activation_checkpointing=none")


def _is_wrapped(block: nn.Module) -> bool:
    forward = block.__dict__.get("forward")
    return isinstance(forward, functools.partial) and forward.func is _checkpointed_forward


def apply_activation_checkpointing(model: nn.Module, mode: ActivationCheckpointing | str) -> None:
    """Make each of `model.blocks` recompute its activations in the backward as `mode` says (none undoes a wrap).

    Raises ConfigError for an unknown mode or, with a recompute mode, a model without `blocks`.
    """
    problem = activation_checkpointing_problem(model, mode)
    if problem is not None:
        raise ConfigError(problem)
    mode = recompute_mode(mode)
    context_fn = _selective_contexts if mode is ActivationCheckpointing.selective else None
    for block in transformer_blocks(model) or []:
        if _is_wrapped(block):
            del block.forward
        if mode is not ActivationCheckpointing.none:
            block.forward = functools.partial(_checkpointed_forward, block, context_fn)
