"""The tracing ladder inside a replay of the user's command (`taxbench localize` on two runs of `taxbench run`).

The probe has no trainer to ask for the model or the step, so this module finds both:
- the model: its root modules, those whose forward is called while no other module's runs (a DDP wrapper, a loss
  module), seen by torch's global module hooks. Module paths are named inside the first root found; a later root's
  paths start with "<Class#i>";
- the step: the capture of step s starts at the first sign of it (a root module entered, a backward, an optimizer
  call) and ends at the first sign of step s+1, or when the process ends.
The capture is taxbench.tracing.capture's Tracer, reading the probe's view of the step as its TracedStep. Rung 1 also
gets one "parameter" record per parameter of the model at the start of the step, its input the parameter as the
previous step's optimizer call left it (or itself, in a process that made no earlier call: a resumed one): a change
the user's code makes between steps (a planted noise) is named by the parameter it changed. In the optimizer's
records, DeepSpeed's flat partitions (no module path) are named "<optimizer class>.param<i>".
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils.hooks import RemovableHandle

from taxbench.rundir.probe_files import ProbeTrace
from taxbench.tracing.capture import CaptureScope, Tracer

BETWEEN_STEPS_SCOPE = "start of step"  # the parameters as the step starts, against the previous optimizer call's


class _Rank:
    def __init__(self, rank: int) -> None:
        self.rank = rank


class ModelRoots:
    """The root modules the program calls, as the model parts the Tracer walks."""

    def __init__(self) -> None:
        self.modules: list[nn.Module] = []

    def add(self, module: nn.Module) -> bool:
        if any(module is known for known in self.modules):
            return False
        self.modules.append(module)
        return True

    def _prefixed(self, walk: Callable[[nn.Module], Iterator[tuple[str, Any]]]) -> Iterator[tuple[str, Any]]:
        for index, root in enumerate(self.modules):
            prefix = f"<{type(root).__name__}#{index}>" if index else ""
            for path, value in walk(root):
                yield ".".join(part for part in (prefix, path) if part), value

    def named_modules(self) -> Iterator[tuple[str, nn.Module]]:
        return self._prefixed(lambda root: root.named_modules())

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return self._prefixed(lambda root: root.named_parameters())

    def joined(self) -> nn.Module:  # the Tracer reads it on a checkpoint load only, which the probe does not see
        return self.modules[0]


class _OptimizerRelay:
    """Stands for the program's optimizers in the Tracer's eyes: the probe's global optimizer hooks call the hooks
    the Tracer registers here, once per outermost optimizer call."""

    def __init__(self) -> None:
        self.pre: OrderedDict[int, Any] = OrderedDict()  # a RemovableHandle holds its dict by weak reference
        self.post: OrderedDict[int, Any] = OrderedDict()

    def _register(self, hooks: OrderedDict[int, Any], hook: Any) -> RemovableHandle:
        handle = RemovableHandle(hooks)
        hooks[handle.id] = hook
        return handle

    def register_step_pre_hook(self, hook: Any) -> RemovableHandle:
        return self._register(self.pre, hook)

    def register_step_post_hook(self, hook: Any) -> RemovableHandle:
        return self._register(self.post, hook)


def _held(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


class ProbeStep:
    """The probe's view of the step being captured (taxbench.tracing.capture.TracedStep)."""

    def __init__(self, rank: int, roots: ModelRoots) -> None:
        self.ctx = _Rank(rank)
        self.step = 0
        self.raw_model = roots
        self.model: nn.Module | None = None  # DDP models are observed one by one as they are found
        self.boundaries: list[Any] = []
        self.optimizer = _OptimizerRelay()
        self.current: torch.optim.Optimizer | None = None  # the optimizer in the call under way
        self.seen: dict[int, torch.optim.Optimizer] = {}  # the optimizers called in this step, in order

    def optimizer_tensors(self) -> Iterator[torch.Tensor]:
        if self.current is None:
            return
        for p in _held(self.current):
            held = self.current.state.get(p, {})
            yield from (held[key] for key in sorted(held) if isinstance(held[key], torch.Tensor))

    def held_tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        params = _held(self.current) if self.current is not None else []
        return [p.grad for p in params if p.grad is not None], params

    def named_held_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        names = {id(p): name for name, p in self.raw_model.named_parameters()}
        listed: set[int] = set()
        for optimizer in self.seen.values():
            for index, p in enumerate(_held(optimizer)):
                if id(p) not in listed:
                    listed.add(id(p))
                    yield names.get(id(p), f"{type(optimizer).__qualname__}.param{index}"), p


class ProbeCapture:
    """Captures the steps a replay asks for (ProbeTrace) into `<run_dir>/trace/trace.rank<R>.jsonl`."""

    def __init__(self, trace: ProbeTrace, run_dir: Path, rank_of: Callable[[], int],
                 step_under_way: Callable[[], int], finished: Callable[[], None]) -> None:
        self.trace = trace
        self.scope = CaptureScope(trace.rung, tuple(trace.steps), (), tuple(trace.modules), tuple(trace.ops),
                                  trace.max_numel)
        self.run_dir, self.rank_of, self.step_under_way, self.finished = run_dir, rank_of, step_under_way, finished
        self.roots = ModelRoots()
        self.view: ProbeStep | None = None
        self.tracer: Tracer | None = None
        self.capturing = 0  # the step captured now (0: none)
        self.done: set[int] = set()
        self._open: ExitStack | None = None
        self._between: dict[str, tuple[dict[str, Any], Any]] = {}  # parameter -> held summary after the last call
        self._depth = threading.local()
        self._handles = [register_module_forward_pre_hook(self._entered),
                         register_module_forward_hook(self._left, always_call=True)]

    # ------------------------------------------------------------------------------------------------ the model
    def _entered(self, module: nn.Module, args: Any) -> None:
        depth = getattr(self._depth, "value", 0)
        self._depth.value = depth + 1
        if depth:
            return
        if self.roots.add(module) and self.tracer is not None:
            self._observe(module)
        self.at(self.step_under_way())

    def _observe(self, root: nn.Module) -> None:
        """Fingerprint a DDP root's gradient all-reduce, unless the program registered a communication hook of its
        own (DDP takes one): then rung 1 goes without it."""
        assert self.tracer is not None
        try:
            with self.tracer.quieted():
                self.tracer.observe(root)
        except RuntimeError:
            pass

    def _left(self, module: nn.Module, args: Any, output: Any) -> None:
        self._depth.value = max(getattr(self._depth, "value", 0) - 1, 0)

    # ------------------------------------------------------------------------------------------------ the step
    def quiet(self) -> AbstractContextManager[Any]:
        """The probe's own work, kept out of an op capture."""
        return self.tracer.quieted() if self.tracer is not None else nullcontext()

    def at(self, step: int) -> None:
        """Something of `step` is happening: end the capture of an earlier step, start this one's if wanted."""
        if self.capturing and step > self.capturing:
            self._end()
            if self.trace.stop_after and self.trace.steps and self.done >= set(self.trace.steps):
                self.finished()
                return
        if not self.capturing and step not in self.done and self.scope.wants_step(step):
            self._start(step)

    def _ready(self) -> tuple[Tracer, ProbeStep]:
        """The tracer and the probe's view, made at first use (the rank is known by then)."""
        if self.tracer is None or self.view is None:
            rank = self.rank_of()
            self.view = ProbeStep(rank, self.roots)
            self.tracer = Tracer(self.scope, self.run_dir, rank)
            self.tracer.attach(self.view)  # type: ignore[arg-type]
            for root in self.roots.modules:
                self._observe(root)
        return self.tracer, self.view

    def _start(self, step: int) -> None:
        tracer, view = self._ready()
        view.step = step
        self.capturing = step
        self._open = ExitStack()
        self._open.enter_context(tracer.capture_step(step))
        with tracer.quieted():
            for name, param in self.roots.named_parameters():
                now = tracer.summaries([param])
                before = self._between.get(name)  # none where this process made no earlier call (a resumed one)
                tracer.record("parameter", name, BETWEEN_STEPS_SCOPE, now if before is None else tracer.adopt([before]),
                              now)
        self._between, view.seen = {}, {}

    def _end(self) -> None:
        assert self._open is not None
        self._open.close()
        self._open = None
        self.done.add(self.capturing)
        self.capturing = 0

    # ------------------------------------------------------------------------------------------------ optimizer calls
    def optimizer_called(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """An outermost optimizer call of step `step_under_way()` begins."""
        self.at(self.step_under_way())
        if self.capturing and self.view is not None:
            self.view.current = optimizer
            self.view.seen[id(optimizer)] = optimizer
            for hook in list(self.view.optimizer.pre.values()):
                hook(optimizer, args, kwargs)

    def optimizer_returned(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any, next_step: int) -> None:
        """An outermost optimizer call returned; `next_step` is the step that follows it."""
        if self.capturing and self.view is not None:
            for hook in list(self.view.optimizer.post.values()):
                hook(optimizer, args, kwargs)
        if self.scope.wants_step(next_step) and next_step not in self.done:
            tracer, _ = self._ready()
            with tracer.quieted():
                params = list(self.roots.named_parameters())
                held = tracer.held_summaries([p for _, p in params])
                self._between.update({name: summary for (name, _), summary in zip(params, held, strict=True)})

    def close(self) -> None:
        if self.capturing:
            self._end()
        if self.tracer is not None:
            self.tracer.close()
        for handle in self._handles:
            handle.remove()
