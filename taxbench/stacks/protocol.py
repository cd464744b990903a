"""The workload protocol: what one experiment needs from a training stack (taxbench.stacks.registry says which
stack a recipe names).

A stack (taxbench's own GPT/MoE trainer, torchtitan, Megatron-Core, DeepSpeed) gives the harness six things;
everything else (the step loop and its timer marks, fingerprints, records, checkpoints, gates, tracing, faults) stays
the harness's:
- `build`: this rank's share of the model on the stack's DeviceMesh for one arm's policy, as a RankModel: its parts
  (what is fingerprinted and checkpointed: parameters, their gradients), and the executor whose `run` is the stack's
  forward and backward; the trainer times it, with gradient finishing, clipping and the optimizer step, between its
  marks;
- `optimizer`: the optimizer over those parts (its state is fingerprinted and checkpointed; a container of optimizers,
  torchtitan's, is read through the optimizers it holds, and an LR schedule it carries as `lr_scheduler` is
  checkpointed with it: taxbench.checkpoint.state);
- `switch`: the stack's own determinism switch, applied for the arm and returned as the manifest records it; a
  switch that disagrees with taxbench's policy is refused (ConfigError, one line) rather than silently winning;
- `meta_model`: the model on the meta device, so the preflight checks fault and trace module paths before launch;
- `native_policy`: what the stack's own switch sets, as policy fields, for a stack-native arm (mode=stack_native:
  the switch alone, recorded and audited against taxbench's full policy instead of refused where it disagrees);
- the checkpoint is the harness's DCP state of the parts and optimizer, with the data-loader position and the RNG
  streams beside it (taxbench.checkpoint.state): a stack only has to give DCP-readable parts.
The trainer drives one OwnedStep (taxbench.stacks.step), chosen once per built model (`RankModel.owned_step`): the
harness's own (taxbench.stacks.harness_step: the executor, then gradient finishing, clipping, the optimizer step and
the DCP checkpoint), or, from a stack whose engine owns the optimizer step and the checkpoint (DeepSpeed, Megatron's
distributed optimizer), the engine's, which its RankModel carries.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from taxbench.config import policy
from taxbench.config.schema import ConfigError, PolicyConfig, RecipeConfig
from taxbench.parallel.distributed import DistContext
from taxbench.parallel.layout import ModelParts, ParallelModel
from taxbench.parallel.pipeline import Boundary, StageSplit
from taxbench.stacks.harness_step import HarnessStep
from taxbench.stacks.step import OwnedStep, PipelineStep, StepExecutor


@dataclass
class RankModel:
    """This rank's share of the model and how a step runs it."""

    parallel: ParallelModel  # the wrapped parts, gradient sync, clipping
    split: StageSplit | None  # the pipeline stages this rank holds (None without pipeline parallelism)
    boundaries: list[Boundary]  # pipeline stage edges (faults, tracing)
    executor: StepExecutor  # plain forward/backward over the micro-batches, or the pipeline schedule
    pipeline: PipelineStep | None
    engine: OwnedStep | None = None  # a stack whose engine owns the optimizer step and the checkpoint (DeepSpeed)

    @property
    def parts(self) -> ModelParts:
        return self.parallel.parts

    def owned_step(self, optimizer: torch.optim.Optimizer, grad_clip: float, where: Callable[[], str]) -> OwnedStep:
        """The step the trainer drives: the stack's engine, or else the harness's own over the executor and
        `optimizer` (`where` names a step in its errors)."""
        if self.engine is not None:
            return self.engine
        return HarnessStep(self.parallel, self.executor, optimizer, grad_clip, where)


class TrainingStack(Protocol):
    name: str

    def switch(self, recipe: RecipeConfig, arm_policy: PolicyConfig) -> dict[str, Any]:
        """Apply the stack's own determinism switch for this arm; what it set, for the manifest."""
        ...

    def build(self, recipe: RecipeConfig, arm_policy: PolicyConfig, ctx: DistContext, micro_batches: int) -> RankModel:
        """This rank's model parts and step executor on the stack's mesh for this arm."""
        ...

    def optimizer(self, recipe: RecipeConfig, model: RankModel) -> torch.optim.Optimizer:
        ...

    def meta_model(self, recipe: RecipeConfig) -> nn.Module:
        """The whole model on the meta device, with the module paths the trained model has."""
        ...

    def native_policy(self, recipe: RecipeConfig, name: str) -> PolicyConfig:
        """What the stack's own determinism switch sets, as policy fields: a stack-native arm runs this and nothing
        else."""
        ...


def refuse_unknown_options(stack: str, options: Any, given: dict[str, Any]) -> None:
    """Refuse a recipe.model.stack key that the stack's options dataclass does not have (one line)."""
    known = set(options.__dataclass_fields__)
    unknown = sorted(set(given) - known)
    if unknown:
        raise ConfigError(f"recipe.model.stack.{unknown[0]} is not a {stack} option; known: {sorted(known)}")


def refuse_conflicts(stack: str, arm_policy: PolicyConfig, stack_env: dict[str, str | None]) -> None:
    """Refuse a stack switch that leaves torch's flags or the environment other than taxbench's policy has them.

    Called right after the stack's switch ran inside `determinism.active(arm_policy)`: the flags it changed are read
    back and compared with the policy's; `stack_env` is what the switch puts in the environment."""
    wanted = {
        "use_deterministic_algorithms": arm_policy.deterministic,
        "deterministic_warn_only": False if arm_policy.deterministic else None,
        "cudnn.deterministic": arm_policy.deterministic,
        "fill_uninitialized_memory": arm_policy.fill_uninitialized_memory if arm_policy.deterministic else None,
    }
    found = {
        "use_deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "cudnn.deterministic": torch.backends.cudnn.deterministic,
        "fill_uninitialized_memory": bool(torch.utils.deterministic.fill_uninitialized_memory),  # type: ignore[attr-defined]
    }
    for key, value in wanted.items():
        if value is not None and found[key] != value:
            raise ConfigError(
                f"{stack}'s determinism switch sets {key}={found[key]} but the {arm_policy.name} arm's taxbench "
                f"policy has {value}; make the two agree (recipe.model.stack or arms.{arm_policy.name})")
    for name, value in stack_env.items():
        ours = policy.policy_env(arm_policy).get(name)
        if value is not None and ours is not None and value != ours:
            raise ConfigError(f"{stack}'s determinism switch sets {name}={value} but the {arm_policy.name} arm's "
                              f"taxbench policy has {ours}; make the two agree")
