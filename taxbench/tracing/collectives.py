"""The DDP gradient all-reduce as an observable boundary.

DDP accepts one communication hook. `CollectiveProbe` is that hook: it does what DDP's built-in reduction does
(scale the local bucket by 1/world_size, then sum-all-reduce it) and lets observers fingerprint the bucket before it
is sent and the result once it is ready for its consumer (the future's completion, not while the buffer is in
flight). Perturbers let a self-test corrupt one rank's result. It is only registered when a tracer or such a fault
asks for it, so ordinary runs keep DDP's built-in path.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

_ATTRIBUTE = "_taxbench_collective_probe"


class CollectiveObserver(Protocol):
    def collective_input(self, buffer: torch.Tensor) -> Any | None: ...

    def collective_output(self, inputs: Any, bucket: int, result: torch.Tensor) -> None: ...

    def quieted(self) -> Any: ...


class CollectiveProbe:
    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.observers: list[CollectiveObserver] = []
        self.perturbers: list[Callable[[int, torch.Tensor], None]] = []

    def __call__(self, state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        index = bucket.index()
        with self._quiet():
            taken = [(observer, observer.collective_input(buffer)) for observer in self.observers]
            buffer.mul_(1.0 / self.group.size())  # the built-in reducer multiplies by the reciprocal too
        future = dist.all_reduce(buffer, group=self.group, async_op=True).get_future()

        def ready(done: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            result = done.value()[0]
            with self._quiet():
                for perturb in self.perturbers:
                    perturb(index, result)
                for observer, inputs in taken:
                    if inputs is not None:
                        observer.collective_output(inputs, index, result)
            return result

        return future.then(ready)

    def _quiet(self) -> ExitStack:
        """Keep the probe's own work out of any op capture running on this thread."""
        stack = ExitStack()
        for observer in self.observers:
            stack.enter_context(observer.quieted())
        return stack


def probe_for(model: nn.Module) -> CollectiveProbe | None:
    """The probe registered on a DDP model (registering it on first use); None for a model without DDP."""
    if not isinstance(model, DistributedDataParallel):
        return None
    probe = getattr(model, _ATTRIBUTE, None)
    if probe is None:
        probe = CollectiveProbe(model.process_group)
        # DDP checks hook annotations against real classes; this module's annotations are strings
        model.register_comm_hook(None, lambda state, bucket: probe(state, bucket))
        setattr(model, _ATTRIBUTE, probe)
    return probe
