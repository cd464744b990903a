"""Which training stack a recipe names (taxbench.stacks.protocol has the protocol they implement)."""

from __future__ import annotations

from taxbench.config.schema import ConfigError, ModelConfig, ModelKind
from taxbench.stacks.deepspeed import DeepSpeedStack
from taxbench.stacks.megatron import MegatronStack
from taxbench.stacks.native import HarnessStack
from taxbench.stacks.protocol import TrainingStack
from taxbench.stacks.titan import TitanStack


def foreign_stack(model: ModelConfig) -> bool:
    """Whether another training stack (torchtitan, Megatron-Core, DeepSpeed) builds, checkpoints its activations and
    counts."""
    return str(model.kind) in (ModelKind.titan.value, ModelKind.megatron.value, ModelKind.deepspeed.value)


def stack_for(model: ModelConfig) -> TrainingStack:
    """The stack that trains `recipe.model` (torchtitan, Megatron-Core and DeepSpeed are imported only when a recipe
    uses them)."""
    kind = str(model.kind)
    if kind == ModelKind.titan.value:
        return TitanStack()
    if kind == ModelKind.megatron.value:
        return MegatronStack()
    if kind == ModelKind.deepspeed.value:
        return DeepSpeedStack()
    if model.stack:
        raise ConfigError(f"recipe.model.stack is read for recipe.model.kind=titan, megatron or deepspeed only, but "
                          f"recipe.model.kind={kind}; remove recipe.model.stack")
    return HarnessStack()
