"""What the probe knows of particular stacks, one module per stack, each imported only once the user's program has
imported that stack (the probe never imports a stack itself).

torch's optimizer hooks mark the steps that ran. Two things they cannot show need a stack's own knowledge:
- a step the stack skipped (a loss scaler that found an inf or NaN gradient never calls the optimizer, so no hook
  fires): the adapter sees the stack's own step boundary and reports the step as skipped;
- memory the optimizer holds that is no part of the model (DeepSpeed ZeRO-3 pads a rank's partitions with
  uninitialized memory): the adapter names the real parts of such a tensor, and the probe digests only those.

| stack (module the program imported) | adapter | what it adds |
|---|---|---|
| `torch` (always) | grad_scaler | `GradScaler.step` that stepped no optimizer: a skipped step |
| `deepspeed` | deepspeed | an engine step that counted a skipped step; ZeRO-3's partitions without their padding |
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Protocol

import torch

# (the module whose presence in sys.modules says the program uses the stack, the adapter's module)
_ADAPTERS = (("torch", "taxbench.probe.adapters.grad_scaler"), ("deepspeed", "taxbench.probe.adapters.deepspeed"))


def _imported(name: str) -> bool:
    """Whether the program has imported `name` whole: the probe starts while torch's import ends, which may be inside
    the import of a stack that imports torch (`import deepspeed`); importing from it then would break that import."""
    module = sys.modules.get(name)
    return module is not None and not getattr(getattr(module, "__spec__", None), "_initializing", False)


class StepListener(Protocol):
    """What an adapter tells the probe (taxbench.probe.runtime.Probe)."""

    optimizer_calls: int  # optimizer step calls seen so far (any depth): an adapter compares it around a step

    def skipped(self, optimizer: torch.optim.Optimizer, params: list[torch.Tensor] | None = None) -> None:
        """The stack skipped this step: `optimizer` (the torch optimizer it would have stepped) holds `params`
        (None: its param_groups' parameters) and their state, as they were left."""


class Adapters:
    """The adapters of the stacks the program has imported so far, and what they say about held tensors."""

    def __init__(self, listener: StepListener) -> None:
        self.listener = listener
        self._installed: set[str] = set()
        self._real_parts: dict[int, tuple[torch.Tensor, Callable[[torch.Tensor], list[torch.Tensor]]]] = {}

    def install_new(self) -> None:
        """Install the adapter of every stack the program has imported since the last call (cheap when none)."""
        for stack, module_name in _ADAPTERS:
            if stack not in self._installed and _imported(stack):
                self._installed.add(stack)
                importlib.import_module(module_name).install(self)

    def set_real_parts(self, held: torch.Tensor, parts: Callable[[torch.Tensor], list[torch.Tensor]]) -> None:
        """`held` (and any tensor laid out like it: its gradient, its optimizer state) is real only in `parts`."""
        self._real_parts[id(held)] = (held, parts)  # the tensor is kept, so its id is never reused

    def real(self, held: torch.Tensor, tensor: torch.Tensor) -> list[torch.Tensor]:
        """The parts of `tensor` that are the model's: `tensor` belongs to `held` (is it, its gradient or its state)."""
        found = self._real_parts.get(id(held))
        if found is None or tensor.numel() != held.numel():
            return [tensor]
        return found[1](tensor)
