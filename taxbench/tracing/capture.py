"""Scoped capture for the tracing ladder (rungs 1-3) of chosen steps and ranks.

- Rung 1, semantic boundaries: gradient all-reduces (fingerprinted when the result is ready for its consumer, never
  while the buffer is in flight), pipeline stage edges (activations and gradients a stage receives and sends), the
  optimizer step (params, grads and state before; params and state after) and checkpoint loads.
- Rung 2, module outputs: forward hooks on the selected modules, named by their path in the model.
- Rung 3, ATen ops: a TorchDispatchMode fingerprints each selected op's tensor inputs (before it runs, so in-place ops
  are seen correctly) and outputs. aten.empty* and c10d internals are skipped.

Every record gets id "<name>:<occurrence>" (occurrence counted per step, kind, scope and name), so two runs align by
key, not arrival order. Digests of device tensors stay on the device (host tensors are digested in place, as ints); a
traced step ends with one host copy of its device digests and one batched write. Nothing here adds a collective.
Backward ops are scoped "<module>/backward": the module is inferred from the autograd node whose output the module
produced, and inherited by the nodes after it (approximate).

Communication the ops do not show (rung 2 sees a module's output, not the all-to-all inside it) is written into the
record as `comm` {"collectives", "group"}: a module declares the collectives it runs with a method
`collectives_within()` (see `communicating_modules`), and every module enclosing one communicates too; a traced
collective's record carries its group. The diff orders origin candidates across ranks by it.
"""

from __future__ import annotations

import fnmatch
import functools
import threading
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from taxbench import fingerprint
from taxbench.rundir.records import truncate_jsonl_after
from taxbench.tracing.collectives import probe_for
from taxbench.tracing.trace_io import TraceWriter, trace_file

if TYPE_CHECKING:
    from taxbench.config.schema import TraceConfig
    from taxbench.parallel.distributed import DistContext
    from taxbench.parallel.layout import ModelParts
    from taxbench.parallel.pipeline import Boundary


class TracedStep(Protocol):
    """What the capture reads of a training step (taxbench.train.trainer.Trainer provides it): the capture depends on
    this narrow view, not on the trainer's insides."""

    ctx: DistContext
    step: int
    model: nn.Module  # the (wrapped) model whose forward runs
    raw_model: ModelParts  # this rank's parts, unwrapped
    boundaries: list[Boundary]  # pipeline stage edges (empty without pipelining)
    optimizer: torch.optim.Optimizer

    def optimizer_tensors(self) -> Iterator[torch.Tensor]: ...

    def named_held_parameters(self) -> Iterator[tuple[str, torch.Tensor]]: ...

    def held_tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The gradients and parameters this rank's optimizer steps (a stack's engine: its ZeRO partitions)."""
        ...

BACKWARD = "/backward"
OPTIMIZER_SCOPE = "optimizer"
PARAMETERS_SCOPE = "end of step"  # rung 1: each parameter as the step leaves it
PIPELINE_SCOPE = "pipeline/stage"  # + the stage index
SKIPPED_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional", "_dtensor", "profiler"})
SKIPPED_OP_PREFIXES = ("aten.empty", "aten.new_empty", "aten._local_scalar_dense", "aten.set_.")
# In-place ops that overwrite every element of their first argument (dropout's bernoulli_ on an empty_like): what it
# held before is not an input, and is often uninitialized memory that would hide the op as an origin.
OVERWRITING_OP_PREFIXES = ("aten.bernoulli_.", "aten.uniform_.", "aten.normal_.", "aten.random_.",
                           "aten.exponential_.", "aten.geometric_.", "aten.cauchy_.", "aten.log_normal_.",
                           "aten.fill_.", "aten.zero_.")
_SCOPE_TAG = "taxbench_scope"


@dataclass(frozen=True)
class CaptureScope:
    """What to capture: the rung, and filters that narrow it (an empty filter selects everything)."""

    rung: int = 1
    steps: tuple[int, ...] = ()
    ranks: tuple[int, ...] = ()
    modules: tuple[str, ...] = ()  # fnmatch patterns on module paths; a selected module covers its submodules
    ops: tuple[str, ...] = ()  # fnmatch patterns on op names such as "aten.mm.default" or "aten.index_put_*"
    max_numel: int = 0  # larger tensors are summarized by shape and dtype only (digest null); 0 = no limit

    def __post_init__(self) -> None:
        if self.rung not in (1, 2, 3):
            raise ValueError(f"trace rung={self.rung} must be 1 (boundaries), 2 (+modules) or 3 (+ATen ops)")
        if self.max_numel < 0:
            raise ValueError(f"trace max_numel={self.max_numel} must be >= 0 (0 = no limit)")

    @classmethod
    def from_config(cls, cfg: TraceConfig) -> CaptureScope:
        return cls(cfg.rung, tuple(cfg.steps), tuple(cfg.ranks), tuple(cfg.modules), tuple(cfg.ops), cfg.max_numel)

    def wants_step(self, step: int) -> bool:
        return not self.steps or step in self.steps

    def wants_rank(self, rank: int) -> bool:
        return not self.ranks or rank in self.ranks

    def wants_module(self, scope: str) -> bool:
        """True when `scope` (a module path, possibly ending in /backward) lies inside a selected module."""
        if not self.modules:
            return True
        path = scope.removesuffix(BACKWARD)
        parts = path.split(".") if path else []
        prefixes = [".".join(parts[:i]) for i in range(1, len(parts) + 1)] or [""]
        return any(fnmatch.fnmatchcase(prefix, pattern) for prefix in prefixes for pattern in self.modules)

    def wants_op(self, name: str) -> bool:
        return not self.ops or any(fnmatch.fnmatchcase(name, pattern) for pattern in self.ops)


@functools.cache
def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_leaves(value: Any) -> list[torch.Tensor]:
    """The tensors inside an op's arguments or result (nested tuples, lists and dicts): rung 3's hot path, where
    pytree's generic flattening cost more than the ops."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [tensor for item in value for tensor in tensor_leaves(item)]
    if isinstance(value, dict):
        return [tensor for item in value.values() for tensor in tensor_leaves(item)]
    return []


def skipped_op(name: str, namespace: str) -> bool:
    """Ops whose outputs are uninitialized memory or in-flight communication buffers (false alarms)."""
    return namespace in SKIPPED_NAMESPACES or name.startswith(SKIPPED_OP_PREFIXES)


@dataclass
class _Pending:
    record: dict[str, Any]
    inputs: list[tuple[dict[str, Any], int | None]]
    outputs: list[tuple[dict[str, Any], int | None]]


Communication = dict[str, Any]  # a record's "comm": {"collectives": [names], "group": [global ranks] or None}


def communicating_modules(modules: Iterable[tuple[str, nn.Module]]) -> dict[str, Communication]:
    """The `comm` of each module path that runs collectives inside its forward.

    A module declares them with `collectives_within() -> {relative path: (collective, group's global ranks or None
    when unknown)}` ("" for the module itself): taxbench's MoE layer under expert parallelism, a stack's wrapper
    around its framework's MoE layer. Every module enclosing a declared one communicates as well."""
    sites: list[tuple[str, str, list[int] | None]] = []
    for path, module in modules:
        declare = getattr(module, "collectives_within", None)
        if callable(declare):
            sites += [(".".join(p for p in (path, relative) if p), collective, group)
                      for relative, (collective, group) in declare().items()]
    merged: dict[str, tuple[set[str], set[int] | None]] = {}
    for path, collective, group in sites:
        parts = path.split(".") if path else []
        for depth in range(len(parts) + 1):
            enclosing = ".".join(parts[:depth])
            names, ranks = merged.get(enclosing, (set(), set()))
            merged[enclosing] = (names | {collective}, None if ranks is None or group is None else ranks | set(group))
    return {path: {"collectives": sorted(names), "group": None if ranks is None else sorted(ranks)}
            for path, (names, ranks) in merged.items()}


def group_ranks(group: Any) -> list[int] | None:
    """The global ranks of a process group (None when torch.distributed cannot say)."""
    import torch.distributed as dist

    try:
        return sorted(dist.get_process_group_ranks(group))
    except (RuntimeError, ValueError, AttributeError):
        return None


class ModuleScope:
    """Which module is running, per thread: forward hooks push and pop module paths, and the autograd nodes that a
    module's outputs came from are tagged with its path, so backward ops are scoped "<module>/backward" (inherited by
    the nodes after it: approximate). Shared by the tracing ladder and the op repeat scan."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._backward_scope = ""

    def stack(self) -> list[str]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def enter(self, path: str) -> None:
        self.stack().append(path)

    def leave(self, path: str, outputs: Iterable[Any] = ()) -> None:
        stack = self.stack()
        if stack and stack[-1] == path:
            stack.pop()
        for tensor in outputs:
            if isinstance(tensor, torch.Tensor) and tensor.grad_fn is not None \
                    and _SCOPE_TAG not in tensor.grad_fn.metadata:
                tensor.grad_fn.metadata[_SCOPE_TAG] = path  # innermost module wins

    def current(self) -> str:
        node = torch._C._current_autograd_node()
        if node is not None:
            tag = node.metadata.get(_SCOPE_TAG)
            if tag is not None:
                self._backward_scope = tag
            return self._backward_scope + BACKWARD
        stack = self.stack()
        return stack[-1] if stack else ""

    def install(self, modules: Iterable[tuple[str, nn.Module]]) -> list[Any]:
        """Hooks that only track the scope (the tracer's own hooks do more); remove the handles when done."""
        handles: list[Any] = []
        for path, module in modules:
            handles.append(module.register_forward_pre_hook(lambda m, a, path=path: self.enter(path)))
            handles.append(module.register_forward_hook(
                lambda m, a, out, path=path: self.leave(path, tree_leaves(out))))
        return handles


class Tracer:
    """Captures the chosen steps of one run on one rank into `<run_dir>/trace/trace.rank<R>.jsonl`."""

    def __init__(self, scope: CaptureScope, run_dir: Path, rank: int) -> None:
        self.scope, self.run_dir, self.rank = scope, run_dir, rank
        self.active = False
        self.past_optimizer = False  # the rest of the step is the trainer's bookkeeping: not captured
        self.step = 0
        self._writer: TraceWriter | None = None
        self._pending: list[_Pending] = []
        self._digests: list[fingerprint.Digest] = []
        self._occurrences: Counter[tuple[str, str, str]] = Counter()
        self._seq = 0
        self._lock = threading.Lock()
        self._local = threading.local()  # per-thread: the quiet flag
        self.modules = ModuleScope()
        self._trainer: TracedStep | None = None
        self._after_optimizer: dict[str, tuple[dict[str, Any], int | None]] = {}  # per parameter, this step
        self._communicating: dict[str, Communication] = {}  # module path -> its record's comm
        self._gradient_group: list[int] | None = None  # the DDP all-reduce's ranks

    # -- wiring -------------------------------------------------------------------------------------------------
    def attach(self, trainer: TracedStep) -> None:
        """Called once by the trainer; the collective probe must be registered before the first step."""
        self._trainer = trainer
        self.observe(trainer.model)

    def observe(self, model: nn.Module) -> None:
        """Fingerprint the gradient all-reduce of `model` when it is a DDP model (once per model)."""
        if self.scope.wants_rank(self.rank):
            probe = probe_for(model)
            if probe is not None and self not in probe.observers:
                probe.observers.append(self)
                self._gradient_group = group_ranks(probe.group)

    @contextmanager
    def capture_step(self, step: int) -> Iterator[None]:
        """Capture `step` if it is in scope: hooks live only for the step, so untraced steps cost nothing."""
        trainer = self._trainer
        if trainer is None or not self.scope.wants_step(step) or not self.scope.wants_rank(self.rank):
            yield
            return
        self.step, self.active, self.past_optimizer = step, True, False
        self._occurrences.clear()
        self._after_optimizer = {}
        handles = self._install_hooks(trainer)
        mode = OpCapture(self) if self.scope.rung >= 3 else None
        try:
            if mode is None:
                yield
            else:
                with mode:
                    yield
            self._parameters_at_step_end(trainer)
        finally:
            for handle in handles:
                handle.remove()
            self.active = False
            self.flush()

    def _parameters_at_step_end(self, trainer: TracedStep) -> None:
        """Rung 1: each parameter at the end of the step (after the trainer's bookkeeping, where an injected weight
        flip lands), its input the same parameter as the optimizer step left it. A parameter changed between the two
        is an origin named by its name; one the optimizer step already changed is downstream of that step."""
        if not self._after_optimizer:
            return  # no optimizer step was captured: nothing to tell a later change from the step's own
        with self.quieted():
            for name, param in trainer.named_held_parameters():
                before = self._after_optimizer.get(name)
                if before is not None:
                    self.record("parameter", name, PARAMETERS_SCOPE, [before], self.summaries([param]))

    def checkpoint_loaded(self, trainer: TracedStep) -> None:
        """Rung 1: the state a checkpoint load produced, attributed to the step that follows it."""
        if not (self.scope.wants_rank(self.rank) and self.scope.wants_step(trainer.step + 1)):
            return
        self.step = trainer.step + 1
        model = [t for t in trainer.raw_model.joined().state_dict().values() if isinstance(t, torch.Tensor)]
        optim = list(trainer.optimizer_tensors())
        self.record("checkpoint", "checkpoint.load", "checkpoint", [],
                    [self.labelled("model", model), self.labelled("optimizer", optim)])
        self.flush()

    def _install_hooks(self, trainer: TracedStep) -> list[Any]:
        handles: list[Any] = []
        if self.scope.rung >= 2:  # the scope stack serves rung 3 too
            self._communicating = communicating_modules(trainer.raw_model.named_modules())
            for path, module in trainer.raw_model.named_modules():
                handles.append(module.register_forward_pre_hook(self._module_pre(path), with_kwargs=True))
                handles.append(module.register_forward_hook(self._module_post(path), with_kwargs=True))
        for boundary in trainer.boundaries:  # rung 1: pipeline stage edges
            handles.append(boundary.module.register_forward_pre_hook(self._stage_entered(boundary)))
            handles.append(boundary.module.register_forward_hook(self._stage_left(boundary)))
        handles.append(trainer.optimizer.register_step_pre_hook(self._optimizer_pre))
        handles.append(trainer.optimizer.register_step_post_hook(self._optimizer_post))
        return handles

    # -- scope --------------------------------------------------------------------------------------------------
    def current_scope(self) -> str:
        return self.modules.current()

    @property
    def quiet(self) -> bool:
        return bool(getattr(self._local, "quiet", False))

    @contextmanager
    def quieted(self) -> Iterator[None]:
        """The tracer's own digest work (and injected faults) must not be captured as ops of the model."""
        previous = self.quiet
        self._local.quiet = True
        try:
            yield
        finally:
            self._local.quiet = previous

    # -- hooks --------------------------------------------------------------------------------------------------
    def _module_pre(self, path: str) -> Any:
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            self.modules.enter(path)
            if self.scope.rung >= 2 and self.scope.wants_module(path):
                with self.quieted():  # parameters are inputs too: a module is an origin only if they agree
                    inputs = self.summaries(tree_leaves((args, kwargs)))
                    params = list(module.parameters())
                    if params:
                        inputs.append(self.labelled("params", params))
                    module._taxbench_inputs = inputs  # type: ignore[attr-defined]
        return hook

    def _module_post(self, path: str) -> Any:
        def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            outputs = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor)]
            self.modules.leave(path, outputs)
            inputs = getattr(module, "_taxbench_inputs", None)
            if inputs is not None:
                del module._taxbench_inputs  # type: ignore[attr-defined]
                with self.quieted():
                    self.record("module", path or "<model>", path, inputs, self.summaries(outputs),
                                self._communicating.get(path))
        return hook

    # Pipeline edges: "pipeline.recv" is what a stage received (no inputs: an origin unless the sender's
    # "pipeline.send" of the same micro-batch differs too, see taxbench.tracing.diff); "pipeline.send" is what it
    # sends on, with what it received as its input. Gradients cross back as recv_grad / send_grad, seen by tensor
    # hooks on the stage's output and received input.
    def _stage_entered(self, boundary: Boundary) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            received = [a for a in args if isinstance(a, torch.Tensor)][:1] if boundary.receives else []
            with self.quieted():
                summaries = self.summaries(received)
                if received:
                    self.record("pipeline", "pipeline.recv", stage_scope(boundary.stage), [], summaries)
                    if received[0].requires_grad:
                        received[0].register_hook(self._gradient_sent(boundary))
                module._taxbench_received = summaries  # type: ignore[attr-defined]
        return hook

    def _stage_left(self, boundary: Boundary) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not (boundary.sends and isinstance(output, torch.Tensor)):
                return
            with self.quieted():
                self.record("pipeline", "pipeline.send", stage_scope(boundary.stage),
                            getattr(module, "_taxbench_received", []), self.summaries([output]))
            if output.requires_grad:
                output.register_hook(self._gradient_received(boundary))
        return hook

    def _gradient_received(self, boundary: Boundary) -> Any:
        def hook(grad: torch.Tensor) -> None:
            with self.quieted():
                summaries = self.summaries([grad])
                self.record("pipeline", "pipeline.recv_grad", stage_scope(boundary.stage) + BACKWARD, [], summaries)
                boundary.module._taxbench_received_grad = summaries  # type: ignore[attr-defined]
        return hook

    def _gradient_sent(self, boundary: Boundary) -> Any:
        def hook(grad: torch.Tensor) -> None:
            with self.quieted():
                self.record("pipeline", "pipeline.send_grad", stage_scope(boundary.stage) + BACKWARD,
                            getattr(boundary.module, "_taxbench_received_grad", []), self.summaries([grad]))
        return hook

    def _optimizer_pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        trainer = self._trainer
        assert trainer is not None
        self.modules.enter(OPTIMIZER_SCOPE)
        with self.quieted():
            grads, params = trainer.held_tensors()
            self._optimizer_inputs = [self.labelled("params", params), self.labelled("grads", grads),
                                      self.labelled("state", list(trainer.optimizer_tensors()))]

    def _optimizer_post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        trainer = self._trainer
        assert trainer is not None
        self.modules.leave(OPTIMIZER_SCOPE)
        with self.quieted():
            outputs = [self.labelled("params", trainer.held_tensors()[1]),
                       self.labelled("state", list(trainer.optimizer_tensors()))]
            self.record("optimizer", "optimizer.step", OPTIMIZER_SCOPE, self._optimizer_inputs, outputs)
            self._after_optimizer = {name: self.summaries([param])[0]
                                     for name, param in trainer.named_held_parameters()}
        self.past_optimizer = True

    # called by the collective probe (possibly on a communication thread)
    def collective_input(self, buffer: torch.Tensor) -> list[tuple[dict[str, Any], int | None]] | None:
        return self.summaries([buffer]) if self.active else None

    def collective_output(self, inputs: list[tuple[dict[str, Any], int | None]], bucket: int,
                          result: torch.Tensor) -> None:
        self.record("collective", "c10d.allreduce", f"ddp.bucket{bucket}", inputs, self.summaries([result]),
                    {"collectives": ["all_reduce"], "group": self._gradient_group})

    # -- records ------------------------------------------------------------------------------------------------
    def summaries(self, values: Iterable[Any]) -> list[tuple[dict[str, Any], int | None]]:
        """(summary, index of its pending digest) for each tensor among `values`; device digests stay there."""
        return self.adopt(self.held_summaries([value for value in values if isinstance(value, torch.Tensor)]))

    def held_summaries(self, tensors: Sequence[torch.Tensor]) -> list[tuple[dict[str, Any], Any]]:
        """(summary, digest or None) for each tensor, the digests held by the caller: taken outside a capture and
        recorded in a later one (`adopt`)."""
        limit = self.scope.max_numel
        wanted = [not limit or t.numel() <= limit for t in tensors]
        digests = iter(fingerprint.digests([t for t, w in zip(tensors, wanted, strict=True) if w]))
        return [({"shape": list(t.shape), "dtype": dtype_name(t.dtype)}, next(digests) if w else None)
                for t, w in zip(tensors, wanted, strict=True)]

    def adopt(self, held: Sequence[tuple[dict[str, Any], Any]]) -> list[tuple[dict[str, Any], int | None]]:
        """Held summaries as pending ones of the current capture."""
        indices = iter(self._keep([digest for _, digest in held if digest is not None]))
        return [(summary, None if digest is None else next(indices)) for summary, digest in held]

    def labelled(self, label: str, tensors: Sequence[torch.Tensor]) -> tuple[dict[str, Any], int | None]:
        """One summary for an ordered group of tensors (e.g. all parameters)."""
        summary = {"label": label, "tensors": len(tensors), "numel": sum(t.numel() for t in tensors)}
        values = fingerprint.digests(tensors)
        return summary, (self._keep([fingerprint.combined(values)])[0] if values else None)

    def _keep(self, digests: list[fingerprint.Digest]) -> range:
        with self._lock:
            start = len(self._digests)
            self._digests.extend(digests)
            return range(start, len(self._digests))

    def record(self, kind: str, name: str, scope: str, inputs: list[tuple[dict[str, Any], int | None]],
               outputs: list[tuple[dict[str, Any], int | None]], comm: Communication | None = None) -> None:
        with self._lock:
            key = (kind, scope, name)
            occurrence = self._occurrences[key]
            self._occurrences[key] += 1
            record = {"seq": self._seq, "rank": self.rank, "step": self.step, "kind": kind, "name": name,
                      "id": f"{name}:{occurrence}", "scope": scope}
            if comm is not None:  # only records that communicate carry it (rung 3 writes many records)
                record["comm"] = comm
            self._seq += 1
            self._pending.append(_Pending(record, inputs, outputs))

    def flush(self) -> None:
        """One host copy of the pending device digests (per device), then one batched write."""
        with self._lock:
            pending, digests = self._pending, self._digests
            self._pending, self._digests = [], []
        if not pending:
            return
        values = [d if isinstance(d, int) else 0 for d in digests]  # host digests are ints already
        by_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
        for index, digest in enumerate(digests):
            if isinstance(digest, torch.Tensor):
                by_device.setdefault(digest.device, []).append((index, digest))
        for pairs in by_device.values():
            host = torch.stack([digest for _, digest in pairs]).cpu().tolist()
            for (index, _), value in zip(pairs, host, strict=True):
                values[index] = value

        def side(items: list[tuple[dict[str, Any], int | None]]) -> list[dict[str, Any]]:
            return [{**summary, "digest": None if index is None else fingerprint.to_hex(values[index])}
                    for summary, index in items]

        if self._writer is None:
            self._writer = TraceWriter(trace_file(self.run_dir, self.rank))
        self._writer.write_batch({**p.record, "in": side(p.inputs), "out": side(p.outputs)} for p in pending)

    def truncate_after(self, step: int) -> None:
        """Drop trace records past `step`, as the step records are dropped when a run resumes or restarts."""
        self.flush()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        truncate_jsonl_after(trace_file(self.run_dir, self.rank), step)

    def close(self) -> None:
        self.flush()
        if self._writer is not None:
            self._writer.close()


class OpCapture(TorchDispatchMode):
    """Rung 3: fingerprint selected ATen ops inside the tracer's module scope."""

    def __init__(self, tracer: Tracer) -> None:
        super().__init__()
        self.tracer = tracer
        self._names: dict[Any, str | None] = {}  # op -> its name if the capture selects it, else None

    def _selected(self, func: Any) -> str | None:
        if func not in self._names:
            name = str(func)
            wanted = not skipped_op(name, func.namespace) and self.tracer.scope.wants_op(name)
            self._names[func] = name if wanted else None
        return self._names[func]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        tracer = self.tracer
        name = None if tracer.quiet or tracer.past_optimizer else self._selected(func)
        if name is None:
            return func(*args, **kwargs)
        scope = tracer.current_scope()
        if not tracer.scope.wants_module(scope):
            return func(*args, **kwargs)
        inputs = tracer.summaries(tensor_leaves((args, kwargs)))  # before the op: in-place ops mutate them
        if inputs and name.startswith(OVERWRITING_OP_PREFIXES):
            inputs[0] = (inputs[0][0], None)  # recorded by shape only
        result = func(*args, **kwargs)
        tracer.record("op", name, scope, inputs, tracer.summaries(tensor_leaves(result)))
        return result


def stage_scope(stage: int) -> str:
    return f"{PIPELINE_SCOPE}{stage}"


def tracer_for_run(cfg: TraceConfig, run: str, run_dir: Path, rank: int) -> Tracer | None:
    """The capture a run gets from `experiment.trace` (None when tracing is off or the run is not selected)."""
    if not cfg.enabled or (cfg.runs and run not in cfg.runs):
        return None
    return Tracer(CaptureScope.from_config(cfg), run_dir, rank)
