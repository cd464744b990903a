"""The probe inside a process of the user's command: policy, step marks, fingerprints and records.

Activated the moment the command's `import torch` finishes (taxbench/probe/boot/sitecustomize.py), before user code
runs a torch op:
- applies the arm's torch flags (taxbench's policy; none for the baseline and a stack-native arm);
- marks steps with torch's global optimizer hooks, folding nested calls (torchtitan's OptimizersContainer) and
  per-group calls (DeepSpeed ZeRO) into one step (taxbench.probe.steps), and records a step that a stack skipped
  (a loss scaler's overflow) as skipped, where the stack's adapter sees it (taxbench.probe.adapters);
- reads each loss where a backward call shows it (`torch.autograd.backward`, which `Tensor.backward` calls);
- digests what this rank's optimizer holds with taxbench's digest (on the device where the tensors are): gradients
  before the step, parameters and optimizer state after it;
- writes the same step records as the trainer (steps.rank<R>.jsonl), only from processes that step an optimizer;
- in a replay of `taxbench localize`, captures the asked steps for the tracing ladder (taxbench.probe.capture).
Its own work is measured and taken out of the step times it records.
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
import time
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from taxbench import fingerprint
from taxbench.config.schema import Device, PolicyConfig
from taxbench.probe.adapters import Adapters
from taxbench.probe.steps import ClosedStep, StepFolder, resumed_after
from taxbench.rundir.probe_files import LiveFlags, ProbeSettings, RankFacts, mark_loaded, read_probe_settings
from taxbench.rundir.records import jsonl_records, steps_file
from taxbench.rundir.step_record import (
    ARM,
    BLOCK,
    CALLS,
    FLAGS,
    OPTIMIZER_STEP,
    RANK,
    REPLICA,
    SKIPPED,
    STEP,
    TOKENS,
)
from taxbench.rundir.step_stream import StepWriter
from taxbench.runtime.determinism import applied_state, apply_flags

if TYPE_CHECKING:
    from taxbench.probe.capture import ProbeCapture

_probe: Probe | None = None


def activate(settings_path: str) -> None:
    """Start the probe in this process (once)."""
    global _probe
    if _probe is not None:
        return
    settings = read_probe_settings(Path(settings_path))
    _probe = Probe(settings)
    _probe.install()


def live_flags() -> LiveFlags:
    return LiveFlags(
        deterministic=torch.are_deterministic_algorithms_enabled(),
        cudnn_deterministic=bool(torch.backends.cudnn.deterministic),
        cudnn_benchmark=bool(torch.backends.cudnn.benchmark),
        tf32=bool(torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32),
        fill_uninitialized_memory=bool(torch.utils.deterministic.fill_uninitialized_memory),  # type: ignore[attr-defined]
    )


def _parameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def own_step_count(optimizer: torch.optim.Optimizer) -> int | None:
    """The optimizer's own step count (Adam's state['step']), None where it keeps none."""
    counts = []
    for held in optimizer.state.values():
        value = held.get("step") if isinstance(held, dict) else None
        if value is not None:
            counts.append(int(value.item() if isinstance(value, torch.Tensor) else value))
    return max(counts) if counts else None


class Probe:
    def __init__(self, settings: ProbeSettings) -> None:
        self.settings = settings
        self.run_dir = Path(settings.run_dir)
        self.folder = StepFolder(time.perf_counter())
        self.writer: StepWriter | None = None
        self.facts: RankFacts | None = None
        self.optimizer_classes: list[str] = []
        self.offset = 0  # a resumed process: its steps continue the optimizer's own count
        self.cuda = torch.cuda.is_available()
        self.pending: list[tuple[dict[str, Any], ClosedStep]] = []
        self.optimizer_calls = 0  # optimizer step calls so far, at any depth (an adapter's sign of a skipped step)
        self.adapters = Adapters(self)
        self.capture: ProbeCapture | None = None

    # ------------------------------------------------------------------------------------------------ installing
    def install(self) -> None:
        mark_loaded(self.run_dir)
        if self.settings.policy is not None:
            apply_flags(PolicyConfig(**self.settings.policy))
        pre = torch.compiler.disable(self._pre_step)  # a compiled opt.step must not trace the probe
        post = torch.compiler.disable(self._post_step)
        register_optimizer_step_pre_hook(pre)
        register_optimizer_step_post_hook(post)
        if self.settings.trace is not None:
            from taxbench.probe.capture import ProbeCapture

            self.capture = ProbeCapture(self.settings.trace, self.run_dir, lambda: self._rank()[0],
                                        lambda: self._absolute(self.folder.under_way), self._finish_replay)
        original = torch.autograd.backward

        def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
            self._backward(tensors)
            return original(tensors, *args, **kwargs)

        torch.autograd.backward = backward  # Tensor.backward calls torch.autograd.backward
        self.adapters.install_new()
        atexit.register(self.close)

    def _held(self, optimizer: torch.optim.Optimizer, params: list[torch.Tensor]
              ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """(gradients, parameters, optimizer state) of `params` as `optimizer` holds them, in its own order, each
        cut to the parts that are the model's (taxbench.probe.adapters: no padding)."""
        grads, values, state = [], [], []
        for p in params:
            if p.grad is not None:
                grads += self.adapters.real(p, p.grad)
            values += self.adapters.real(p, p)
            held = optimizer.state.get(p, {})
            for key in sorted(held):
                if isinstance(held[key], torch.Tensor):
                    state += self.adapters.real(p, held[key])
        return grads, values, state

    # ------------------------------------------------------------------------------------------------ hooks
    def _quiet(self) -> AbstractContextManager[Any]:
        """The probe's own work, kept out of a replay's op capture."""
        return self.capture.quiet() if self.capture is not None else nullcontext()

    def _backward(self, tensors: Any) -> None:
        began = time.perf_counter()
        self.adapters.install_new()  # before the step this backward leads to: a stack imported since is known
        if self.capture is not None:
            self.capture.at(self._absolute(self.folder.under_way))
        with self._quiet():
            closed = self.folder.on_backward(began)
            if closed is not None:
                self._record(closed)
            loss = tensors if isinstance(tensors, torch.Tensor) else None
            if loss is None and isinstance(tensors, list | tuple) and tensors and isinstance(tensors[0], torch.Tensor):
                loss = tensors[0]
            if loss is not None and loss.numel() == 1 and loss.is_floating_point():
                self.folder.add_loss(fingerprint.float_bits(loss.detach().reshape(())), loss.dtype)
        self.folder.add_overhead(time.perf_counter() - began)

    def _pre_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        began = time.perf_counter()
        params = _parameters(optimizer)
        key = tuple((id(p), p.data_ptr()) for p in params)
        outermost, closed = self.folder.on_pre_step(optimizer, key, began)
        with self._quiet():
            if closed is not None:
                self._record(closed)
            if outermost and self._digesting(self.folder.next_step):
                grads, _, _ = self._held(optimizer, params)
                self.folder.add_grads(fingerprint.collection_digest(grads) if grads else 0)
        if outermost and self.capture is not None:
            self.capture.optimizer_called(optimizer, args, kwargs)
        self.folder.add_overhead(time.perf_counter() - began)

    def _post_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        ended = time.perf_counter()
        self.optimizer_calls += 1
        params = _parameters(optimizer)
        event = self._event(params)
        if not self.folder.on_post_step(optimizer, ended, event):
            return
        if self.capture is not None:
            self.capture.optimizer_returned(optimizer, args, kwargs, self._absolute(self.folder.under_way))
        self._step_ended(optimizer, params, ended, grads=False)

    def skipped(self, optimizer: torch.optim.Optimizer, params: list[torch.Tensor] | None = None) -> None:
        """A stack's adapter saw this step skipped (no optimizer call): recorded as a step, marked skipped, with the
        gradients, parameters and state as the skip left them."""
        ended = time.perf_counter()
        params = _parameters(optimizer) if params is None else params
        if self.folder.on_skipped(ended, self._event(params)):
            self._step_ended(optimizer, params, ended, grads=True)

    def _event(self, params: list[torch.Tensor]) -> Any:
        if not (self.cuda and any(p.is_cuda for p in params)):
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _step_ended(self, optimizer: torch.optim.Optimizer, params: list[torch.Tensor], ended: float,
                    grads: bool) -> None:
        name = type(optimizer).__qualname__
        if name not in self.optimizer_classes:
            self.optimizer_classes.append(name)
        with self._quiet():
            if self._digesting(self.folder.next_step):
                held_grads, values, state = self._held(optimizer, params)  # now: ZeRO-3 swaps its sub-group out
                if grads:
                    self.folder.add_grads(fingerprint.collection_digest(held_grads) if held_grads else 0)
                self.folder.add_state(fingerprint.collection_digest(values) or 0,
                                      fingerprint.collection_digest(state) or 0)
            self.folder.add_own_count(own_step_count(optimizer))
        self.folder.add_overhead(time.perf_counter() - ended)

    def _absolute(self, step: int) -> int:
        """A step of this process as the run numbers it (a resumed process continues the optimizer's count)."""
        if self.writer is None and self.settings.resume and self.settings.trace is not None:
            return step + self.settings.trace.resumed_from  # before the first record fixes the offset
        return step + self.offset

    def _digesting(self, step: int) -> bool:
        every = self.settings.fingerprint_every
        return every == 1 or (every > 1 and step % every == 0)

    # ------------------------------------------------------------------------------------------------ records
    def _rank(self) -> tuple[int, int, int]:
        if dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
        else:
            rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        return rank, world, int(os.environ.get("LOCAL_RANK", 0))

    def _open(self, closed: ClosedStep) -> None:
        rank, world, local_rank = self._rank()
        if self.settings.resume:
            self.offset = resumed_after(closed, _saved_steps(steps_file(self.run_dir, rank)))
        device = f"cuda:{torch.cuda.current_device()}" if self.cuda and closed.on_device else "cpu"
        self.writer = StepWriter(steps_file(self.run_dir, rank))
        if self.settings.resume:
            self.writer.truncate_after(self.offset)  # what the saving process recorded past the checkpoint goes
        self.facts = RankFacts(
            rank=rank, world_size=world, local_rank=local_rank, hostname=socket.gethostname(), pid=os.getpid(),
            device=device, software=_software(),
            policy_applied=applied_state(Device.cuda if device != "cpu" else Device.cpu),
            optimizers=self.optimizer_classes, resumed_from=self.offset if self.settings.resume else None,
        )
        self.facts.write(self.run_dir)

    def _record(self, closed: ClosedStep) -> None:
        if self.writer is None:
            self._open(closed)
        assert self.facts is not None
        step = closed.number + self.offset
        record = {
            ARM: self.settings.arm,
            REPLICA: self.settings.replica,
            RANK: self.facts.rank,
            STEP: step,
            BLOCK: self.settings.block,
            TOKENS: None,
            FLAGS: live_flags().text(),
            OPTIMIZER_STEP: closed.own_count,
            CALLS: closed.calls,
            SKIPPED: closed.skipped,
        }
        self.pending.append((record, closed))
        if not self.cuda or len(self.pending) >= 16:
            self._flush()

    def _flush(self) -> None:
        """Turn pending steps into lines: device values come to the host here, once for all pending steps."""
        if self.writer is None:
            return
        for record, closed in self.pending:
            record.update(closed.values())
            self.writer.write(record)
        self.pending.clear()

    def _finish_replay(self) -> None:
        """A replay has captured every step it asked for: the process ends here, its records written (every rank
        reaches this at the same point of the program: the first sign of the step after the last captured one)."""
        self.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    def close(self) -> None:
        if self.capture is not None:
            self.capture.close()
            self.capture = None
        closed = self.folder.close(time.perf_counter())
        if closed is not None:
            self._record(closed)
        self._flush()
        if self.writer is not None:
            self.writer.close()
            if self.facts is not None:
                facts = self.facts.__dict__ | {"steps": self.folder.next_step - 1, "optimizers": self.optimizer_classes}
                RankFacts(**facts).write(self.run_dir)


def _saved_steps(stream: Path) -> list[tuple[int, int | None, bool]]:
    """(step, optimizer count, skipped) of each record the saving process wrote."""
    if not stream.exists():
        return []
    return [(record[STEP], record.get(OPTIMIZER_STEP), bool(record.get(SKIPPED)))
            for _, record in jsonl_records(stream) if isinstance(record.get(STEP), int)]


def _software() -> dict[str, Any]:
    found: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        found["gpu"] = torch.cuda.get_device_name()
        found["cudnn"] = torch.backends.cudnn.version()
        try:
            found["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
        except (AttributeError, RuntimeError):
            found["nccl"] = None
    return found
