"""Pipeline parallelism: how a recipe's model splits into stages, and the torch.distributed.pipelining schedule that
runs them.

The split is data, computed from the recipe alone (the plan and the trainer use the same function): the model's
blocks divide evenly over pp * virtual_stages stages; the first stage also holds the token and position embeddings,
the last the final norm and the head (and computes the loss). Each stage is a copy of the whole model with the modules
it does not own removed (torchtitan's `_split_module`): blocks it does not own become identity placeholders, so every
module and parameter keeps its name (blocks.5.ffn is blocks.5.ffn on whichever stage holds it) and fault injection,
tracing and checkpoints address modules as in an unsplit model.

Stages per rank: one (1F1B, GPipe), `virtual_stages` in a loop (Interleaved1F1B, InterleavedZeroBubble: rank r holds
r, r + pp, ...), or two in a V (ZBVZeroBubble: r and 2 * pp - 1 - r).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from taxbench.config.layout_rules import PIPELINE_SCHEDULES, schedule_kind
from taxbench.config.schema import RecipeConfig


class StagePlaceholder(nn.Identity):
    """Stands in a stage's copy of the model for a block another stage owns (keeps the other blocks' names)."""


@dataclass(frozen=True)
class StageSplit:
    """Which stages (global indices) a pipeline rank holds, and which blocks each stage owns."""

    num_stages: int
    pp: int
    v_shape: bool  # ZBV: rank r holds r and 2 * pp - 1 - r; else r, r + pp, ...
    pp_rank: int
    blocks: dict[int, range]  # stage -> block indices it owns

    def stages_of(self, pp_rank: int) -> tuple[int, ...]:
        if self.v_shape:
            return (pp_rank, 2 * self.pp - 1 - pp_rank)
        return tuple(range(pp_rank, self.num_stages, self.pp))

    @property
    def stages(self) -> tuple[int, ...]:
        """This rank's stages, in schedule order."""
        return self.stages_of(self.pp_rank)

    @property
    def has_first(self) -> bool:
        return 0 in self.stages

    @property
    def has_last(self) -> bool:
        return self.num_stages - 1 in self.stages


def schedule_name(recipe: RecipeConfig) -> str:
    """The recipe's schedule spelled as torch names it (the config accepts any case)."""
    wanted = recipe.parallel.pp_schedule.lower()
    return next(name for name in PIPELINE_SCHEDULES if name.lower() == wanted)


def stage_split(recipe: RecipeConfig, pp_rank: int) -> StageSplit:
    par = recipe.parallel
    num_stages = par.pp * par.virtual_stages
    per_stage = recipe.model.n_layers // num_stages
    blocks = {s: range(s * per_stage, (s + 1) * per_stage) for s in range(num_stages)}
    return StageSplit(num_stages, par.pp, schedule_kind(par.pp_schedule) == "v", pp_rank, blocks)


def stage_holding(split: StageSplit, module: str) -> int | None:
    """The stage that owns `module` (a path in the unsplit model); None for the model root or the block list."""
    parts = module.split(".")
    if parts[0] in ("embed", "pos"):
        return 0
    if parts[0] in ("norm", "head"):
        return split.num_stages - 1
    if parts[0] == "blocks" and len(parts) > 1 and parts[1].isdigit():
        return next(stage for stage, held in split.blocks.items() if int(parts[1]) in held)
    return None


def split_model(model: nn.Module, split: StageSplit, stage: int) -> nn.Module:
    """This stage's part of `model`: a deep copy without the modules it does not own (names unchanged)."""
    part = copy.deepcopy(model)
    owned = split.blocks[stage]
    for index in range(len(part.blocks)):
        if index not in owned:
            part.blocks[index] = StagePlaceholder()
    if stage != 0:
        part.embed = None
        part.pos = None
    if stage != split.num_stages - 1:
        part.norm = None
        part.head = None
    return part


def join_stages(parts: list[nn.Module]) -> nn.Module:
    """One module over a rank's stage parts (the inverse of split_model): each top-level module and each block taken
    from the part that owns it, so that every parameter has its unsplit-model name exactly once. The modules are
    shared, not copied: a state dict read or loaded through it reads or loads the parts."""
    if len(parts) == 1:
        return parts[0]
    joined = nn.Module()
    for name, first in parts[0]._modules.items():
        held = [part._modules[name] for part in parts]
        if isinstance(first, nn.ModuleList):
            owners = [next((blocks[i] for blocks in held if not isinstance(blocks[i], StagePlaceholder)), first[i])
                      for i in range(len(first))]
            joined.add_module(name, nn.ModuleList(owners))
        else:
            joined.add_module(name, next((module for module in held if module is not None), None))
    return joined


def build_schedule(stages: list, micro_batches: int, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                   name: str):  # noqa: ANN201 (a torch pipelining schedule)
    """The torch.distributed.pipelining schedule over this rank's PipelineStages."""
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    schedule_class = get_schedule_class(name)
    if issubclass(schedule_class, PipelineScheduleSingle):
        return schedule_class(stages[0], n_microbatches=micro_batches, loss_fn=loss_fn)
    return schedule_class(stages, n_microbatches=micro_batches, loss_fn=loss_fn)


@dataclass(frozen=True)
class Boundary:
    """Where a rank's stage meets its neighbours: activations arrive at its input (unless it is the first stage) and
    leave from its output (unless it is the last); gradients cross the other way."""

    stage: int
    module: nn.Module  # the stage's part (its root: hooks see the received input and the sent output)
    receives: bool
    sends: bool


def boundaries(parts: list[nn.Module], split: StageSplit | None) -> list[Boundary]:
    if split is None:
        return []
    return [Boundary(stage, part, stage != 0, stage != split.num_stages - 1)
            for stage, part in zip(split.stages, parts, strict=True)]
