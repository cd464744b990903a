"""taxbench's own stack (HarnessStack), and how it builds what one rank trains: its model parts, pipeline
boundaries and step executor, then its optimizer.

One entry, as torchtitan's `pipeline_llm`: the model is built on the meta device, activation recompute is applied,
the model is split into this rank's pipeline stages (layer ranges; each stage a copy without what other stages own),
each part is sharded for the layout (experts over ep, tensor parallel, FSDP2), and only then is this rank's share
materialised on its device with layout-invariant initial values (taxbench.parallel.materialize) and wrapped in DDP
where the layout asks for it. No rank ever holds the whole model. The trainer and `benchmarks/rank_build.py` (a rank
of a 2,432-GPU world simulated on a CPU) build through here, so what the benchmark measures is what a rank trains.

A custom model (`recipe.model.kind=custom`) is built by its factory on the host, as it comes, and moved to the device
before it is sharded: its initial values are its own and not layout invariant.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from taxbench.config import policy
from taxbench.config.schema import PolicyConfig, Precision, RecipeConfig
from taxbench.parallel.distributed import DistContext
from taxbench.parallel.layout import layout_for, parallelize
from taxbench.parallel.materialize import materialize
from taxbench.parallel.pipeline import boundaries, split_model, stage_split
from taxbench.parallel.recompute import apply_activation_checkpointing
from taxbench.runtime import determinism
from taxbench.stacks.float8 import convert_to_float8
from taxbench.stacks.protocol import RankModel
from taxbench.stacks.step import PipelineStep, PlainStep, StepExecutor
from taxbench.workloads import build_model, own_workload


def autocast_dtype(recipe: RecipeConfig) -> torch.dtype | None:
    return torch.bfloat16 if recipe.precision in (Precision.bf16, Precision.fp8) else None


def build_pipeline(recipe: RecipeConfig, arm_policy: PolicyConfig, ctx: DistContext, micro_batches: int) -> RankModel:
    """This rank's model parts, boundaries and executor for the recipe's layout (see the module docstring)."""
    layout = layout_for(recipe.parallel, ctx.world_size, ctx.rank)
    with determinism.active(arm_policy):
        model = build_model(recipe.model, arm_policy.deterministic_kernels)
    if recipe.precision is Precision.fp8:
        convert_to_float8(model)
    apply_activation_checkpointing(model, recipe.activation_checkpointing)
    split = stage_split(recipe, layout.pp_rank) if layout.pp > 1 else None
    parts = [model] if split is None else [split_model(model, split, s) for s in split.stages]
    del model
    fill: Callable[[nn.Module], None]
    if own_workload(recipe.model):
        def fill(part: nn.Module) -> None:
            materialize(part, ctx.device, recipe.seed)
    else:
        parts = [part.to(ctx.device) for part in parts]

        def fill(part: nn.Module) -> None:
            del part  # built with its values on the host and already on the device
    parallel = parallelize(parts, recipe, ctx, arm_policy, fill)
    dtype = autocast_dtype(recipe)
    pipeline = None if split is None else PipelineStep(parallel, split, recipe, micro_batches, ctx.device, dtype)
    executor: StepExecutor = pipeline or PlainStep(parallel, ctx.device, dtype)
    return RankModel(parallel, split, boundaries(parallel.parts.parts, split), executor, pipeline)


def build_optimizer(recipe: RecipeConfig, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    opt = recipe.optimizer
    return torch.optim.AdamW(params, lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps,
                             weight_decay=opt.weight_decay)


class HarnessStack:
    """taxbench's own GPT/MoE workloads (and custom `_target_` models) on its own layout, step and optimizer."""

    name = "taxbench"

    def switch(self, recipe: RecipeConfig, arm_policy: PolicyConfig) -> dict[str, Any]:
        del recipe  # taxbench's policy is the whole switch (taxbench.config.policy)
        return {"deterministic_kernels": arm_policy.deterministic_kernels}

    def build(self, recipe: RecipeConfig, arm_policy: PolicyConfig, ctx: DistContext, micro_batches: int) -> RankModel:
        return build_pipeline(recipe, arm_policy, ctx, micro_batches)

    def optimizer(self, recipe: RecipeConfig, model: RankModel) -> torch.optim.Optimizer:
        return build_optimizer(recipe, model.parts.parameters())

    def meta_model(self, recipe: RecipeConfig) -> nn.Module:
        with torch.device("meta"):
            return build_model(recipe.model, deterministic_kernels=True)

    def native_policy(self, recipe: RecipeConfig, name: str) -> PolicyConfig:
        del recipe  # taxbench's own switch is its full policy
        return replace(policy.full_policy(), name=name)
