"""Optimizer calls folded into training steps, as the probe sees them through torch's global optimizer hooks.

- Nested calls (a container optimizer that calls its inner ones, torchtitan's OptimizersContainer) count once: the
  outermost call.
- The calls between two backward passes are one step (DeepSpeed ZeRO-2 steps its inner optimizer once per parameter
  group, ZeRO-3 once per sub-group); a repeat call of the same optimizer on the same parameters without a backward in
  between starts a new step.
- The losses of every backward since the previous step belong to the next one (gradient accumulation: one step
  with all its micro-batch losses).
- A step that a stack skipped (no optimizer call: a loss scaler's overflow; its adapter reports it) is a step too,
  marked skipped, with the losses of its backward passes. Reports of the same skip before the next backward, and a
  skip inside an optimizer call (whose step is recorded anyway), fold into it.
A step closes when the next backward or step begins, or when the process ends. Its time runs from the previous step's
end (its last outermost call returning) to its own, less the probe's own work in between.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from taxbench import fingerprint
from taxbench.rundir.step_record import DEVICE_S, FINGERPRINT_S, GRAD_NORM, LOSS, TIME_S

Digest = Any  # an int (host) or a 0-d int64 tensor on a device (taxbench.fingerprint.Digest)


@dataclass
class _Open:
    keys: set[tuple[int, tuple]] = field(default_factory=set)
    losses: list[tuple[Digest, torch.dtype]] = field(default_factory=list)
    grads: list[Digest] = field(default_factory=list)
    params: list[Digest] = field(default_factory=list)
    optim: list[Digest] = field(default_factory=list)
    calls: int = 0
    skipped: bool = False
    own_count: int | None = None
    end: float = 0.0
    end_overhead: float = 0.0
    end_event: Any = None  # a CUDA event recorded as the last call returned (None on CPU)


@dataclass
class ClosedStep:
    number: int  # 1, 2, ... in this process
    calls: int  # outermost optimizer calls folded into it
    skipped: bool  # the stack skipped the optimizer step (its adapter said so)
    own_count: int | None  # the optimizer's own step count after it
    time_s: float  # host clock, the probe's own work taken out
    overhead_s: float  # the probe's own work in this step's interval
    losses: list[tuple[Digest, torch.dtype]]
    grads: list[Digest]
    params: list[Digest]
    optim: list[Digest]
    start_event: Any
    end_event: Any

    @property
    def on_device(self) -> bool:
        return self.end_event is not None

    def values(self) -> dict[str, Any]:
        """The record's timing and fingerprint fields (device values come to the host here)."""
        device_s = None
        if self.start_event is not None and self.end_event is not None:
            device_s = self.start_event.elapsed_time(self.end_event) / 1e3
        losses = [(_host_int(bits), dtype) for bits, dtype in self.losses]
        digested = bool(self.params)
        return {
            TIME_S: device_s if device_s is not None else self.time_s,
            DEVICE_S: device_s,
            FINGERPRINT_S: self.overhead_s,
            LOSS: sum(_bits_value(b, d) for b, d in losses) / len(losses) if losses else None,
            "loss_bits": "".join(fingerprint.bits_hex(b, d) for b, d in losses),  # "" where no backward was seen
            "grads": fingerprint.to_hex(_combined(self.grads)) if digested else None,
            GRAD_NORM: None,  # the command's own clipping norm is not observed
            "grad_norm_bits": "",
            "params": fingerprint.to_hex(_combined(self.params)) if digested else None,
            "optim": fingerprint.to_hex(_combined(self.optim)) if digested else None,
        }


def _host_int(value: Digest) -> int:
    return int(value.item()) if isinstance(value, torch.Tensor) else int(value)


def _combined(values: list[Digest]) -> int:
    if not values:
        return 0
    return _host_int(values[0] if len(values) == 1 else fingerprint.combined(values))


_INT_OF_WIDTH = {16: torch.int16, 32: torch.int32, 64: torch.int64}


def _bits_value(bits: int, dtype: torch.dtype) -> float:
    width = torch.finfo(dtype).bits
    signed = bits - (1 << width) if bits >= 1 << (width - 1) else bits
    return float(torch.tensor([signed], dtype=_INT_OF_WIDTH[width]).view(dtype).item())


class StepFolder:
    def __init__(self, started: float = 0.0) -> None:
        self.next_step = 1
        self._open: _Open | None = None
        self._losses: list[tuple[Digest, torch.dtype]] = []
        self._depth = 0
        self._overhead = 0.0  # the probe's own work so far (seconds)
        self._prev_end, self._prev_overhead, self._prev_event = started, 0.0, None

    @property
    def under_way(self) -> int:
        """The step the program is on: the open one until an optimizer call of it returned, then the next."""
        return self.next_step + (1 if self._open is not None and self._open.calls else 0)

    def add_overhead(self, seconds: float) -> None:
        self._overhead += seconds

    def add_loss(self, bits: Digest, dtype: torch.dtype) -> None:
        self._losses.append((bits, dtype))

    def on_backward(self, now: float) -> ClosedStep | None:
        return self.close(now)

    def on_pre_step(self, optimizer: object, key: tuple, now: float) -> tuple[bool, ClosedStep | None]:
        """(whether this is an outermost call, the step it closed)."""
        self._depth += 1
        if self._depth > 1:
            return False, None
        closed = None
        call = (id(optimizer), key)
        if self._open is not None and call in self._open.keys:  # the same call again with no backward between
            closed = self.close(now)
        if self._open is None:
            self._open = _Open(losses=self._losses)
            self._losses = []
        self._open.keys.add(call)
        return True, closed

    def on_post_step(self, optimizer: object, now: float, event: Any) -> bool:
        """Whether this ends an outermost call (the step's end so far)."""
        self._depth = max(self._depth - 1, 0)
        if self._depth > 0 or self._open is None:
            return False
        self._open.calls += 1
        self._open.end, self._open.end_overhead, self._open.end_event = now, self._overhead, event
        return True

    def on_skipped(self, now: float, event: Any) -> bool:
        """A stack skipped this step: whether it is a new skipped step (then its digests follow, as after a call)."""
        if self._depth > 0 or (self._open is not None and (self._open.skipped or self._open.calls > 0)):
            if self._open is not None and self._depth == 0:
                self._open.skipped = True  # some calls ran, then the stack skipped the rest: the step is skipped
            return False
        if self._open is None:
            self._open = _Open(losses=self._losses)
            self._losses = []
        self._open.skipped = True
        self._open.end, self._open.end_overhead, self._open.end_event = now, self._overhead, event
        return True

    def add_grads(self, digest: Digest) -> None:
        if self._open is not None:
            self._open.grads.append(digest)

    def add_state(self, params: Digest, optim: Digest) -> None:
        if self._open is not None:
            self._open.params.append(params)
            self._open.optim.append(optim)

    def add_own_count(self, count: int | None) -> None:
        if self._open is not None and count is not None:
            self._open.own_count = count

    def close(self, now: float) -> ClosedStep | None:
        """The open step, closed (None when no optimizer call is open)."""
        step = self._open
        if step is None or (step.calls == 0 and not step.skipped):
            return None
        overhead = step.end_overhead - self._prev_overhead
        closed = ClosedStep(self.next_step, step.calls, step.skipped, step.own_count,
                            step.end - self._prev_end - overhead,
                            overhead, step.losses, step.grads, step.params, step.optim, self._prev_event,
                            step.end_event)
        self._prev_end, self._prev_overhead, self._prev_event = step.end, step.end_overhead, step.end_event
        self.next_step += 1
        self._open = None
        return closed


class NotAligned(RuntimeError):
    """A resumed process whose first step cannot be placed in the run it continues."""


def resumed_after(first: ClosedStep, saved: list[tuple[int, int | None, bool]]) -> int:
    """The run's step after which a resumed process starts, from its first step and the records that the saving
    process left in the same stream, as (step, the optimizer's own count after it, skipped).

    The checkpoint holds the optimizer's count, which a step a loss scaler skipped leaves where it was: without a skip
    the count is the step, and otherwise the saving process's records say after which step the optimizer held it.
    When several steps left that count (a skip right after the step it saved at), which one saved is unknown, and
    NotAligned says so, as it does when the optimizer keeps no count of its own."""
    if first.own_count is None:
        raise NotAligned("taxbench probe: the optimizer keeps no step count of its own, so a resumed run cannot be "
                         "aligned with the uninterrupted one")
    loaded = first.own_count - (0 if first.skipped else 1)
    if not any(skipped for _, _, skipped in saved):
        return loaded
    at = [step for step, count, _ in saved if count == loaded]
    if len(at) != 1:
        raise NotAligned(f"taxbench probe: the resumed optimizer's step count is {loaded}, which the saving run held "
                         f"after {'steps ' + str(at) if at else 'no step'} (a loss scaler skipped steps there), so "
                         "the step it resumed from is not known; save at a step no skip follows")
    return at[0]
