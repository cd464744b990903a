"""Op repeat scan: replay every ATen op of a step on identical inputs and compare the outputs byte for byte.

Under `OpRepeatScan` (a TorchDispatchMode) each op runs `repeats` times on clones of its inputs, each time from the
same RNG state (CPU and CUDA generators, and an explicit `generator=` argument), then once more on the real inputs:
that real call's outputs are what the step continues with, and the RNG streams advance exactly as without the scan.
An op whose replays' outputs (results and mutated arguments, digested by taxbench.fingerprint) differ from its real
call is nondeterministic under the flags that were active. Under strict deterministic mode an op that torch reports
as having no deterministic implementation is listed, and then run as use_deterministic_algorithms(warn_only=True)
would run it, so the step goes on.

Clones copy each input's whole storage once per storage, then rebuild every input as the same view (offset, sizes,
strides) of its copy: in-place ops, out= arguments and inputs that alias each other replay as they ran.

Blind spots: only what reaches the dispatcher is seen. Work inside one fused custom kernel (a Triton kernel launched
directly, a C++/CUDA extension called without a registered op) is one op or nothing; ops on tensor subclasses without
storage (DTensor, FSDP2 parameters) are run but not replayed (counted as `not_replayed`, their decomposed local ops
are replayed); collectives are skipped (replaying them would deadlock ranks and change what they received).
"""

from __future__ import annotations

import functools
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from taxbench import fingerprint
from taxbench.tracing.capture import ModuleScope, dtype_name, skipped_op, tensor_leaves

# What torch says under use_deterministic_algorithms(True, warn_only=True) for an op with no deterministic kernel.
NO_DETERMINISTIC_IMPLEMENTATION = "does not have a deterministic implementation"
# Beyond the tracing ladder's skips (aten.empty*, c10d): resize_ grows a tensor into uninitialized memory.
_SCAN_SKIPPED_PREFIXES = ("aten.resize_",)
# Results that are not the op's numbers: attention kernels' RNG state for their backward, and outputs they leave
# uninitialized unless asked for (flash/cudnn/efficient SDPA schemas).
_NOT_RESULTS = frozenset({"philox_seed", "philox_offset", "rng_state", "unused", "debug_attn_mask"})
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)

Signature = tuple[Any, ...]


@functools.cache
def scanned(func: Any) -> bool:
    """Whether the scan replays this op (not uninitialized memory, storage identity or communication)."""
    name = str(func)
    return not (skipped_op(name, func.namespace) or name.startswith(_SCAN_SKIPPED_PREFIXES))


@dataclass
class NondeterministicOp:
    """An op (at one module scope, with one set of input shapes) whose replays did not all reproduce its output."""

    op: str
    scope: str
    shapes: list[list[int]]
    dtypes: list[str]
    repeats: int  # replays per call
    calls: int = 0  # calls of this op at this scope and shapes
    calls_differed: int = 0  # calls with at least one differing replay
    most_differed: int = 0  # the most replays of one call that differed from its real output


@dataclass
class WarnOnlyOp:
    """An op that torch reports as having no deterministic implementation (the warn_only path)."""

    op: str
    scope: str
    message: str
    calls: int = 0


@dataclass
class PolicyScan:
    policy: str
    deterministic: bool
    repeats: int
    ops_seen: int = 0
    ops_replayed: int = 0
    nondeterministic: list[NondeterministicOp] = field(default_factory=list)
    no_deterministic_implementation: list[WarnOnlyOp] = field(default_factory=list)
    not_replayed: dict[str, int] = field(default_factory=dict)  # op -> calls whose inputs could not be cloned

    @property
    def clean(self) -> bool:
        """Positive evidence only: ops were replayed, none differed, none lacked a deterministic implementation."""
        return self.ops_replayed > 0 and not self.nondeterministic and not self.no_deterministic_implementation

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _replayable(tensor: torch.Tensor) -> bool:
    """Plain strided tensors with real storage: what a storage copy can reproduce exactly."""
    return (type(tensor) in _PLAIN_TYPES and tensor.layout is torch.strided and tensor.device.type != "meta"
            and not tensor.is_conj() and not tensor.is_neg())


def clone_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments with every tensor rebuilt as the same view of a copy of its storage (one copy per storage, so
    aliasing between arguments is kept)."""
    copies: dict[tuple[torch.device, int], torch.UntypedStorage] = {}

    def clone(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        storage = value.untyped_storage()
        key = (value.device, storage.data_ptr())
        if key not in copies:
            copies[key] = storage.clone()
        twin = torch.empty((0,), dtype=value.dtype, device=value.device)
        return twin.set_(copies[key], value.storage_offset(), value.size(), value.stride())

    return tree_map(clone, args), tree_map(clone, kwargs)


class RngFork:
    """The generator states an op may draw from, to run it several times from the same point."""

    def __init__(self, kwargs: dict[str, Any]) -> None:
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() \
            else None
        generator = kwargs.get("generator")
        self.generator = generator if isinstance(generator, torch.Generator) else None
        self.generator_state = self.generator.get_state() if self.generator is not None else None

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        if self.generator is not None and self.generator_state is not None:
            self.generator.set_state(self.generator_state)


def _written(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The arguments the op's schema says it writes (in-place self, out=, mutated lists)."""
    written = []
    for position, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        if argument.name in kwargs:
            written.append(kwargs[argument.name])
        elif position < len(args) and not argument.kwarg_only:
            written.append(args[position])
    return written


def _compared_results(func: Any, result: Any) -> Any:
    """The op's results less its RNG bookkeeping and placeholders (by schema name): fused attention returns its
    philox seed and offset, which without dropout are uninitialized memory (seen on CUDA: every replay differed)."""
    returns = func._schema.returns
    if not isinstance(result, (list, tuple)) or len(returns) != len(result):
        return result
    return [value for value, declared in zip(result, returns, strict=True) if declared.name not in _NOT_RESULTS]


def signature(func: Any, result: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Signature:
    """What an op produced, byte for byte: digests of its result tensors and of the arguments it wrote, and its
    non-tensor results as values."""
    result = _compared_results(func, result)
    tensors = tensor_leaves([result, _written(func, args, kwargs)])
    values = [int(d) if isinstance(d, torch.Tensor) else d for d in fingerprint.digests(tensors)]
    scalars = [r for r in (result if isinstance(result, (list, tuple)) else [result])
               if isinstance(r, (bool, int, float))]
    return tuple(values) + tuple(scalars)


class OpRepeatScan(TorchDispatchMode):
    """Replays every op `repeats` times (see the module docstring); results accumulate in `result`."""

    def __init__(self, policy: str, deterministic: bool, repeats: int, scope: ModuleScope,
                 on_op: Callable[[], None] = lambda: None) -> None:
        super().__init__()
        if repeats < 1:
            raise ValueError(f"repeats={repeats} must be >= 1")
        self.repeats, self.scope, self.on_op = repeats, scope, on_op
        self.result = PolicyScan(policy, deterministic, repeats)
        self._findings: dict[tuple[str, str, str], NondeterministicOp] = {}
        self._calls: Counter[tuple[str, str, str]] = Counter()
        self._warn_only: dict[tuple[str, str], WarnOnlyOp] = {}
        self._not_replayed: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not scanned(func):
            return func(*args, **kwargs)
        self.result.ops_seen += 1
        self.on_op()
        name, scope = str(func), self.scope.current()
        tensors = tensor_leaves((args, kwargs))
        rng = RngFork(kwargs)
        if not all(_replayable(t) for t in tensors):
            self._not_replayed[name] += 1
            return self._call(func, args, kwargs, rng, name, scope, real=True)
        replays = []
        for _ in range(self.repeats):
            clone_args, clone_kwargs = clone_inputs(args, kwargs)
            rng.restore()
            result = self._call(func, clone_args, clone_kwargs, rng, name, scope)
            replays.append(signature(func, result, clone_args, clone_kwargs))
            del clone_args, clone_kwargs, result
        rng.restore()
        result = self._call(func, args, kwargs, rng, name, scope, real=True)
        real = signature(func, result, args, kwargs)
        self.result.ops_replayed += 1
        self._count(name, scope, tensors, sum(replay != real for replay in replays))
        return result

    def _call(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], rng: RngFork, name: str,
              scope: str, real: bool = False) -> Any:
        """Run the op; under strict deterministic mode an op without a deterministic implementation raises before
        it runs: note it, and run it as warn_only would (C++ warnings only reach Python when the outermost op
        returns, so the warn_only path itself cannot be caught per op)."""
        try:
            return func(*args, **kwargs)
        except RuntimeError as exc:
            if NO_DETERMINISTIC_IMPLEMENTATION not in str(exc):
                raise
            entry = self._warn_only.setdefault((name, scope), WarnOnlyOp(name, scope, str(exc).splitlines()[0]))
            entry.calls += real  # the step's calls, not the replays
        rng.restore()
        enabled, warn_only = torch.are_deterministic_algorithms_enabled(), \
            torch.is_deterministic_algorithms_warn_only_enabled()
        torch.use_deterministic_algorithms(True, warn_only=True)
        try:
            return func(*args, **kwargs)
        finally:
            torch.use_deterministic_algorithms(enabled, warn_only=warn_only)

    def __enter__(self) -> OpRepeatScan:
        # The warn_only runs above warn when the outermost op returns, inside the scanned block: they are recorded.
        self._quiet = warnings.catch_warnings()
        self._quiet.__enter__()
        warnings.filterwarnings("ignore", message=f".*{NO_DETERMINISTIC_IMPLEMENTATION}")
        return super().__enter__()  # type: ignore[return-value]

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._quiet.__exit__(*exc)

    def _count(self, name: str, scope: str, tensors: list[torch.Tensor], differed: int) -> None:
        shapes = [list(t.shape) for t in tensors]
        key = (name, scope, repr(shapes))
        self._calls[key] += 1
        if not differed:
            return
        finding = self._findings.get(key)
        if finding is None:
            finding = self._findings[key] = NondeterministicOp(
                name, scope, shapes, [dtype_name(t.dtype) for t in tensors], self.repeats)
        finding.calls_differed += 1
        finding.most_differed = max(finding.most_differed, differed)

    def finish(self) -> PolicyScan:
        """The scan's result (findings in the order they were first seen)."""
        for key, finding in self._findings.items():
            finding.calls = self._calls[key]
        self.result.nondeterministic = list(self._findings.values())
        self.result.no_deterministic_implementation = list(self._warn_only.values())
        self.result.not_replayed = dict(self._not_replayed)
        return self.result
