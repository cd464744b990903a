"""Which training stack a recipe names (taxbench.train.stack has the protocol they implement)."""

from __future__ import annotations

from taxbench.config.schema import ConfigError, ModelConfig, ModelKind
from taxbench.train.megatron import MegatronStack
from taxbench.train.stack import HarnessStack, TrainingStack
from taxbench.train.titan import TitanStack


def foreign_stack(model: ModelConfig) -> bool:
    """Whether another training stack (torchtitan, Megatron-Core) builds, checkpoints its activations and counts."""
    return str(model.kind) in (ModelKind.titan.value, ModelKind.megatron.value)


def stack_for(model: ModelConfig) -> TrainingStack:
    """The stack that trains `recipe.model` (torchtitan and Megatron-Core are imported only when a recipe uses them)."""
    kind = str(model.kind)
    if kind == ModelKind.titan.value:
        return TitanStack()
    if kind == ModelKind.megatron.value:
        return MegatronStack()
    if model.stack:
        raise ConfigError(f"recipe.model.stack is read for recipe.model.kind=titan or megatron only, but "
                          f"recipe.model.kind={kind}; remove recipe.model.stack")
    return HarnessStack()
