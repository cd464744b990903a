"""How one training step executes on this rank: forward/backward over the micro-batches, or a pipeline schedule.

The trainer picks the executor once and never asks which again: both leave the step's gradients on this rank's model
parts and return the step's mean loss over its micro-batches, identical on every rank. Everything else (gradient
finishing, clipping, fingerprints, checkpoints, tracing) iterates over the parts (taxbench.parallel.layout.ModelParts).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F

from taxbench.config.schema import RecipeConfig
from taxbench.parallel.layout import ParallelModel
from taxbench.parallel.pipeline import StageSplit, build_schedule, schedule_name

Batch = tuple[torch.Tensor, torch.Tensor]  # (inputs, targets) of one micro-batch


class StepExecutor(Protocol):
    def run(self, batches: list[Batch]) -> torch.Tensor:
        """Forward and backward over `batches`; the mean loss (a 0-d tensor, the same on every rank)."""
        ...


class OwnedStep(Protocol):
    """The step the trainer drives, whoever owns it: the whole timed step, the tensors this rank holds (fingerprinted),
    and the checkpoint. An engine that owns the optimizer step and the checkpoint gives its own (DeepSpeed's engine,
    Megatron's distributed optimizer); every other stack's is the harness's (taxbench.stacks.harness_step), chosen
    once per built model (taxbench.stacks.protocol.RankModel.owned_step)."""

    def optimize(self, batches: list[Batch], optimizer_step: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward, backward, reduction, clipping and, unless told not to, the optimizer step; the mean loss and the
        gradient norm."""
        ...

    def held_tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The last step's gradients and the parameters, as this rank holds them (e.g. its ZeRO partition), read
        together: the trainer reads them inside the timed step."""
        ...

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The parameters by name, as faults and the tracing capture name them (an engine's: `numbered_partitions`)."""
        ...

    def optimizer_tensors(self) -> Iterator[torch.Tensor]:
        ...

    def save(self, directory: Path, extras: dict[str, Any], rank: int) -> list[Path]:
        """Write the stack's checkpoint and this rank's `extras` (a collective); the files this rank lists."""
        ...

    def load(self, directory: Path, rank: int, map_location: torch.device) -> dict[str, Any]:
        """Restore the stack's checkpoint in place (a collective); this rank's extras."""
        ...

    def received(self) -> dict[str, Any]:
        """What the engine received, read back from it after the build: the manifest's stack_switch holds this
        over what the stack's `switch` planned (nothing without an engine)."""
        ...


def numbered_partitions(partitions: list[torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """An engine's partitions by name, "partition <i>" (it copies them into the module's parameters after its step)."""
    return ((f"partition {i}", t) for i, t in enumerate(partitions))


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def autocast_for(device: torch.device, dtype: torch.dtype | None) -> AbstractContextManager[object]:
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else nullcontext()


class PlainStep:
    """Every micro-batch through the whole model: gradient accumulation, data-parallel sync on the last one."""

    def __init__(self, parallel: ParallelModel, device: torch.device, autocast_dtype: torch.dtype | None) -> None:
        self.parallel, self.device, self.autocast_dtype = parallel, device, autocast_dtype
        (self.model,) = parallel.parts.parts

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with autocast_for(self.device, self.autocast_dtype):
            logits = self.parallel.module(inputs)
        loss = cross_entropy(logits, targets)
        aux = getattr(self.model, "aux_loss", None)
        extra = aux() if callable(aux) else None
        return loss if extra is None else loss + extra

    def run(self, batches: list[Batch]) -> torch.Tensor:
        loss_sum = torch.zeros((), device=self.device)
        for i, (inputs, targets) in enumerate(batches):
            with self.parallel.gradient_sync(i == len(batches) - 1):
                loss = self.loss(inputs, targets)
                (loss / len(batches)).backward()
            loss_sum += loss.detach()
        return loss_sum / len(batches)


class PipelineStep:
    """This rank's stages under a torch.distributed.pipelining schedule (1F1B, GPipe, interleaved, zero bubble).

    The micro-batches go in fixed order: the first stage gets the step's inputs, the last its targets, and the schedule
    splits both into the same micro-batches the plain step would use. The loss exists on the last stage only; MoE aux
    losses reach their routers through the backward of each layer (taxbench.workloads.moe), and their values are summed
    per stage. The recorded loss (cross entropy + aux, as in the plain step) is summed over the pipeline ranks with one
    all_reduce, so every rank records the same bits.
    """

    def __init__(self, parallel: ParallelModel, split: StageSplit, recipe: RecipeConfig, micro_batches: int,
                 device: torch.device, autocast_dtype: torch.dtype | None) -> None:
        from torch.distributed.pipelining import PipelineStage

        assert parallel.pp_group is not None
        self.split, self.micro_batches, self.device, self.autocast_dtype = split, micro_batches, device, autocast_dtype
        self.group = parallel.pp_group
        # Static stage shapes: torch's runtime shape inference would run an extra forward through the real modules
        # (on uninitialized inputs) in the first step of every trainer, which faults, tracing and MoE aux losses see.
        stages = [PipelineStage(module, index, split.num_stages, device, group=self.group,
                                input_args=_stage_input(recipe, index), output_args=_stage_output(recipe, split, index,
                                                                                                  autocast_dtype))
                  for module, index in zip(parallel.modules, split.stages, strict=True)]
        self.schedule_name = schedule_name(recipe)
        self.schedule = build_schedule(stages, micro_batches, cross_entropy, self.schedule_name)
        self.moe_layers = [m for part in parallel.parts.parts for m in part.modules()
                           if hasattr(m, "aux_loss_in_backward")]
        for layer in self.moe_layers:
            layer.aux_loss_in_backward = True

    def run(self, batches: list[Batch]) -> torch.Tensor:
        inputs = torch.cat([x for x, _ in batches])
        targets = torch.cat([y for _, y in batches])
        for layer in self.moe_layers:
            layer.aux_loss_sum = None
        losses: list[torch.Tensor] = []
        with autocast_for(self.device, self.autocast_dtype):
            if self.split.has_first and self.split.has_last:
                self.schedule.step(inputs, target=targets, losses=losses, return_outputs=False)
            elif self.split.has_first:
                self.schedule.step(inputs, return_outputs=False)
            elif self.split.has_last:
                self.schedule.step(target=targets, losses=losses, return_outputs=False)
            else:
                self.schedule.step(return_outputs=False)
        total = torch.zeros((), device=self.device)
        for loss in losses:  # fixed micro-batch order
            total = total + loss.detach().float()
        for layer in self.moe_layers:  # fixed layer order
            if layer.aux_loss_sum is not None:
                total = total + layer.aux_loss_sum.float()
        dist.all_reduce(total, group=self.group)
        return total / self.micro_batches


def _stage_input(recipe: RecipeConfig, stage: int) -> torch.Tensor:
    """A micro-batch entering `stage` (metadata only): tokens into the first, hidden states into the others (fp32:
    the residual stream stays in the embeddings' dtype under autocast; they require grad, so that their gradient goes
    back to the previous stage)."""
    batch, seq = recipe.micro_batch_size, recipe.model.seq_len
    if stage == 0:
        return torch.empty(batch, seq, dtype=torch.long, device="meta")
    return torch.empty(batch, seq, recipe.model.d_model, dtype=torch.float32, device="meta", requires_grad=True)


def _stage_output(recipe: RecipeConfig, split: StageSplit, stage: int,
                  autocast_dtype: torch.dtype | None) -> torch.Tensor:
    """What `stage` returns (metadata only): logits from the last (in the autocast dtype), else hidden states."""
    if stage != split.num_stages - 1:
        return _stage_input(recipe, stage + 1)
    batch, seq, vocab = recipe.micro_batch_size, recipe.model.seq_len, recipe.model.vocab_size
    return torch.empty(batch, seq, vocab, dtype=autocast_dtype or torch.float32, device="meta")
