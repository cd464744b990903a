"""Injected divergence for harness self-tests: faults that act inside a step, at a known place.

- perturb_collective: flips the lowest bit of the first gradient all-reduce result of the step on one rank (the
  collective's inputs agree across runs, its output does not); on a rank without DDP whose pipeline stage receives
  activations, the first activation it receives (the sender's copy is intact: a fault on the stage boundary).
- nondeterministic_op: flips the lowest bit of the first output of the first matching ATen op (`fault.op`, an
  fnmatch pattern such as "aten.mm.default") run inside module `fault.module` during the forward pass, like a kernel
  with a nondeterministic reduction order would.
- flip_param_bit: flips the lowest bit of the rank's first parameter (its local shard, when sharded) after the step's
  optimizer step, where no computation of the step produced it (`flip_param_bit`, called by the trainer).
Each flips bit `fault.bit` (default 0, the lowest) of the first element it hits: a one-ulp change may be rounded away
downstream (a token dropped by an MoE's capacity, a small term in a large sum); a higher bit, e.g. 22 in float32,
survives. A fault that acts reports where through its `fired(kind, step, where)` callback (the run's
faults.rank<R>.jsonl), so a fault that never matched is visible as one that never fired.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from taxbench.tracing.collectives import probe_for

if TYPE_CHECKING:
    from taxbench.config.schema import FaultConfig
    from taxbench.parallel.pipeline import Boundary

Fired = Callable[[str, int, str], None]  # (kind, step, where)

STEP_FAULT_KINDS = ("perturb_collective", "nondeterministic_op")
_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def flip_bit(tensor: torch.Tensor, bit: int = 0) -> None:
    """Flip bit `bit` (0: the lowest) of the tensor's first element in place, whatever its layout."""
    if tensor.numel() == 0 or tensor.dtype is torch.bool:
        return
    first = tensor.detach().as_strided((1,), (1,))
    width = 8 * first.element_size()
    if bit >= width:
        raise ValueError(f"experiment.fault.bit={bit} is beyond the {width}-bit {tensor.dtype} the fault hit; choose a "
                         f"bit below {width}")
    first.view(_INT_OF_WIDTH[first.element_size()]).bitwise_xor_(1 << bit if bit < width - 1 else -(1 << bit))


class _PerturbFirstOp(TorchDispatchMode):
    def __init__(self, op_pattern: str, inside: Callable[[], bool], bit: int) -> None:
        super().__init__()
        self.op_pattern, self.inside, self.bit = op_pattern, inside, bit
        self.fired_op: str | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        result = func(*args, **(kwargs or {}))
        if self.fired_op is None and self.inside() and fnmatch.fnmatchcase(str(func), self.op_pattern):
            outputs = [t for t in tree_leaves(result) if isinstance(t, torch.Tensor)]
            if outputs:
                flip_bit(outputs[0], self.bit)
                self.fired_op = str(func)
        return result


class StepFault:
    """A fault that acts inside one step on one rank; the trainer enters `around(step)` for every step."""

    def __init__(self, fault: FaultConfig, rank: int, model: nn.Module, raw_model: Any,
                 boundaries: Sequence[Boundary], fired: Fired) -> None:
        """`model` is the wrapped model (DDP carries the collective), `raw_model` the plain module tree (or this
        rank's pipeline parts), `boundaries` this rank's pipeline stage edges (empty without pipelining)."""
        self.fault, self.rank, self.fired = fault, rank, fired
        self._armed = False
        self._perturbed: str | None = None
        self._depth = 0
        if fault.kind == "perturb_collective":
            probe = probe_for(model)
            receiving = [b for b in boundaries if b.receives]
            if probe is not None:
                probe.perturbers.append(self._perturb_collective)
            elif receiving:  # pipeline parallelism: the activation a stage receives from the previous one
                receiving[0].module.register_forward_pre_hook(self._perturb_receive(receiving[0].stage))
            elif rank == fault.rank:
                raise ValueError(
                    "experiment.fault.kind=perturb_collective needs a collective on the fault rank: data-parallel "
                    "ranks (DDP) or a pipeline stage that receives activations; use cluster.cpu_ranks=2 or another "
                    "fault kind"
                )
        elif fault.kind == "nondeterministic_op":
            if rank != fault.rank:
                return  # the module may live on another pipeline stage than this rank's
            modules = dict(raw_model.named_modules())
            if not fault.module or fault.module not in modules:
                known = ", ".join(sorted(name for name in modules if name)[:12])
                raise ValueError(
                    f"experiment.fault.module={fault.module!r} is not a module of the model; choose one of: "
                    f"{known}, ..."
                )
            if not fault.op:
                raise ValueError("experiment.fault.kind=nondeterministic_op needs experiment.fault.op, e.g. "
                                 "'aten.mm.default'")
            target = modules[fault.module]
            target.register_forward_pre_hook(self._enter)
            target.register_forward_hook(self._leave)
        else:
            raise ValueError(f"experiment.fault.kind={fault.kind!r} does not act inside a step")

    def _enter(self, module: nn.Module, args: Any) -> None:
        self._depth += 1

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        self._depth -= 1

    def _perturb_collective(self, bucket: int, result: torch.Tensor) -> None:
        if self._armed:
            self._armed = False
            flip_bit(result, self.fault.bit)
            self._perturbed = f"gradient all-reduce bucket {bucket}"

    def _perturb_receive(self, stage: int) -> Callable[[nn.Module, Any], None]:
        def hook(module: nn.Module, args: Any) -> None:
            if self._armed and args and isinstance(args[0], torch.Tensor):
                self._armed = False
                flip_bit(args[0], self.fault.bit)
                self._perturbed = f"pipeline activation received by stage {stage}"
        return hook

    @contextmanager
    def around(self, step: int) -> Iterator[None]:
        if step != self.fault.step or self.rank != self.fault.rank:
            yield
            return
        if self.fault.kind == "perturb_collective":
            self._armed, self._perturbed = True, None
            try:
                yield
            finally:
                self._armed = False
            if self._perturbed is not None:
                self.fired(str(self.fault.kind), step, self._perturbed)
            return
        assert self.fault.op is not None
        with _PerturbFirstOp(self.fault.op, lambda: self._depth > 0, self.fault.bit) as mode:
            yield
        if mode.fired_op is not None:
            self.fired(str(self.fault.kind), step, f"{mode.fired_op} in {self.fault.module}")


def flip_param_bit(fault: FaultConfig | None, rank: int, step: int,
                   named_parameters: Iterator[tuple[str, torch.Tensor]], fired: Fired) -> None:
    """The flip_param_bit fault, when it is this rank's and this step's: flip the lowest bit of the first parameter
    the rank holds elements of (its local shard when sharded; ZeRO-3 leaves the module's own parameters empty, so a
    stack's engine passes its partitions). Fired only when a bit was flipped."""
    if fault is None or fault.kind in STEP_FAULT_KINDS or fault.step != step or fault.rank != rank:
        return
    for name, param in named_parameters:
        to_local = getattr(param, "to_local", None)  # a sharded parameter: flip this rank's shard
        local = to_local() if callable(to_local) else param
        if local.numel() and local.dtype is not torch.bool:
            with torch.no_grad():
                flip_bit(local, fault.bit)
            fired(str(fault.kind), step, name)
            return


def step_fault(fault: FaultConfig | None, rank: int, model: nn.Module, raw_model: Any,
               boundaries: Sequence[Boundary], fired: Fired) -> StepFault | None:
    if fault is None or fault.kind not in STEP_FAULT_KINDS:
        return None
    return StepFault(fault, rank, model, raw_model, boundaries, fired)
