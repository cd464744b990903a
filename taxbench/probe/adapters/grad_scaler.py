"""torch's loss scaler (`torch.amp.GradScaler`, and its subclasses: `torch.cuda.amp.GradScaler`, FSDP's
`ShardedGradScaler`): its `step(optimizer)` skips `optimizer.step()` when the unscaled gradients hold an inf or NaN.
A call that stepped no optimizer is a skipped step; the gradients (inf included) and the state are as it left them."""

from __future__ import annotations

import functools
from typing import Any

import torch

from taxbench.probe.adapters import Adapters


def install(adapters: Adapters) -> None:
    scaler = torch.amp.grad_scaler.GradScaler
    original = scaler.step
    listener = adapters.listener

    @functools.wraps(original)
    def step(self: Any, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        calls = listener.optimizer_calls
        result = original(self, optimizer, *args, **kwargs)
        if listener.optimizer_calls == calls:
            listener.skipped(optimizer)
        return result

    scaler.step = step
