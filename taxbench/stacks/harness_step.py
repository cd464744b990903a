"""The harness's own step as an OwnedStep (taxbench.stacks.step), for every stack whose engine does not own its
optimizer step: taxbench's own, torchtitan's, and Megatron-Core's without its distributed optimizer.

The stack's executor runs forward and backward (plain, or a pipeline schedule); the harness then finishes the
gradients (DDP, FSDP2, Megatron's buffers: taxbench.parallel.layout.ParallelModel), clips them and steps the
optimizer. What it holds, and fingerprints, is the rank's model parts as they are; its checkpoint is the harness's DCP
state of those parts and the optimizer (taxbench.checkpoint.state).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from taxbench.checkpoint import state as checkpoint_state
from taxbench.parallel.layout import ParallelModel
from taxbench.stacks.step import Batch, StepExecutor


class HarnessStep:
    """The executor's forward and backward, then gradient finishing, clipping and the optimizer step, as one step.

    `where` names the step for an error (rank, run and step), as the trainer knows them."""

    def __init__(self, parallel: ParallelModel, executor: StepExecutor, optimizer: torch.optim.Optimizer,
                 grad_clip: float, where: Callable[[], str]) -> None:
        self.parallel, self.executor, self.optimizer = parallel, executor, optimizer
        self.max_norm = grad_clip if grad_clip > 0 else float("inf")
        self.where = where
        self._gradients_checked = False  # see _require_every_parameter_trained

    def optimize(self, batches: list[Batch], optimizer_step: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        self.optimizer.zero_grad(set_to_none=True)
        loss_mean = self.executor.run(batches)
        self.parallel.finish_gradients()
        if not self._gradients_checked:
            self._require_every_parameter_trained()
        grad_norm = self.parallel.clip_grad_norm_(self.max_norm)
        if optimizer_step:
            self.optimizer.step()
        return loss_mean, grad_norm

    def _require_every_parameter_trained(self) -> None:
        """Fail the first step this trainer runs when a trainable parameter of this rank got no gradient: the
        gates cannot see it (a parameter that never moves is perfectly repeatable), as a zero-bubble schedule's
        split weight pass on FSDP2 showed by leaving a whole pipeline stage untrained."""
        self._gradients_checked = True
        missing = [name for name, p in self.parallel.parts.named_parameters() if p.requires_grad and p.grad is None]
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise RuntimeError(f"{self.where()}: {len(missing)} trainable parameters got no gradient ({shown}); this "
                               "layout or schedule would leave them untrained")

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.parallel.parts.named_parameters()

    def held_tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        params = list(self.parallel.parts.parameters())
        return [p.grad for p in params if p.grad is not None], params

    def optimizer_tensors(self) -> Iterator[torch.Tensor]:
        """Optimizer state in a fixed order, on its parameter's device (Adam keeps `step` on the CPU); a container of
        optimizers (torchtitan's) is read through the optimizers that hold the state."""
        states = [part.state for part in checkpoint_state.optimizer_parts(self.optimizer)]
        for param in self.parallel.parts.parameters():
            state = next((held[param] for held in states if param in held), {})
            for _, value in sorted(state.items()):
                if isinstance(value, torch.Tensor):
                    yield value if value.device == param.device else value.to(param.device, non_blocking=True)

    def save(self, directory: Path, extras: dict[str, Any], rank: int) -> list[Path]:
        return checkpoint_state.save(directory, self.parallel, self.optimizer, extras, rank)

    def load(self, directory: Path, rank: int, map_location: torch.device) -> dict[str, Any]:
        return checkpoint_state.load(directory, self.parallel, self.optimizer, rank, map_location)

    def received(self) -> dict[str, Any]:
        return {}  # no engine: what the stack's switch planned is what ran
