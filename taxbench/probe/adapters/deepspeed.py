"""DeepSpeed (imported only once the program has imported deepspeed).

- **Skipped steps.** With fp16's dynamic loss scaler, an overflow makes the engine skip the optimizer step: the
  ZeRO or FP16 optimizer returns before calling the torch optimizer, so no hook fires. The engine counts each one in
  `skipped_steps` inside `_take_model_step` (its step at a gradient-accumulation boundary), so a call that raised
  the count is a skipped step. What the rank's optimizer then holds are its flat fp32 partitions (ZeRO-3:
  `fp32_partitioned_groups_flat`; ZeRO-1/2: `single_partition_of_fp32_groups`; FP16 without ZeRO:
  `fp32_groups_flat` or `fp32_groups`) and the torch optimizer's state for them; the gradients are gone by then.
- **ZeRO-3 padding.** ZeRO-3 partitions each parameter over the ranks; where its size does not divide by the world,
  the last rank's partition ends in `padding_size()` elements of uninitialized memory, and a sub-group's flat fp32
  partition is its parameters' partitions end to end, paddings included. Only each partition's first
  `partition_numel() - padding` elements are the model's: the probe digests those, of the partition, its gradient
  and its optimizer state.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

from taxbench.probe.adapters import Adapters

_FLAT_PARTITIONS = ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups", "fp32_groups_flat",
                    "fp32_groups")


def install(adapters: Adapters) -> None:
    original = DeepSpeedEngine._take_model_step
    listener = adapters.listener
    padded: set[int] = set()  # the ZeRO-3 optimizers whose partitions' real parts are registered

    @functools.wraps(original)
    def take_model_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        optimizer = self.optimizer
        if id(optimizer) not in padded and isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3):
            padded.add(id(optimizer))
            _register_real_parts(adapters, optimizer)
        skipped = self.skipped_steps
        result = original(self, *args, **kwargs)
        inner = getattr(optimizer, "optimizer", None)
        if self.skipped_steps > skipped and isinstance(inner, torch.optim.Optimizer):
            listener.skipped(inner, _flat_partitions(optimizer))
        return result

    DeepSpeedEngine._take_model_step = take_model_step


def _flat_partitions(optimizer: Any) -> list[torch.Tensor] | None:
    """The flat fp32 partitions a DeepSpeed optimizer holds on this rank (None: its torch optimizer's parameters)."""
    for name in _FLAT_PARTITIONS:
        held = getattr(optimizer, name, None)
        if held:
            return [t for item in held for t in (item if isinstance(item, list | tuple) else [item])
                    if isinstance(t, torch.Tensor)]
    return None


def _register_real_parts(adapters: Adapters, optimizer: Any) -> None:
    """Each ZeRO-3 sub-group's flat fp32 partition with padding: its real parts, per parameter partition."""
    for flat, params, paddings in zip(optimizer.fp32_partitioned_groups_flat, optimizer.fp16_groups,
                                      optimizer.groups_padding, strict=True):
        if not any(paddings):
            continue
        spans, offset = [], 0
        for param, padding in zip(params, paddings, strict=True):
            size = int(param.partition_numel())
            if size > padding:
                spans.append((offset, size - padding))
            offset += size
        if offset != flat.numel():  # not the layout described above: digest it whole rather than guess
            continue
        adapters.set_real_parts(flat, functools.partial(_parts, spans=tuple(spans)))


def _parts(tensor: torch.Tensor, spans: tuple[tuple[int, int], ...]) -> list[torch.Tensor]:
    flat = tensor.reshape(-1)
    return [flat.narrow(0, start, length) for start, length in spans]
