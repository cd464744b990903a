"""One training run of one arm on one rank: seeded init, timed steps, fingerprints, checkpoint/resume.

Timing covers zero_grad, forward, backward, gradient reduction, clipping and the optimizer step; data loading is
timed separately and fingerprinting runs after the timer stops, so the harness stays out of the numbers it reports.
On CUDA, step times come from CUDA events and digests stay on the device until the block ends (one sync per block).
"""

from __future__ import annotations

import gc
import random
import resource
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from taxbench import fingerprint
from taxbench.checkpoint import state as checkpoint_state
from taxbench.checkpoint.store import CheckpointError
from taxbench.config import policy
from taxbench.config.schema import FaultConfig, PolicyConfig, TaxbenchConfig
from taxbench.design import run_name
from taxbench.parallel.distributed import DistContext
from taxbench.parallel.layout import layout_for
from taxbench.rundir.records import FaultLog, step_record, steps_file
from taxbench.rundir.step_stream import StepWriter
from taxbench.tracing.capture import tracer_for_run
from taxbench.tracing.faults import STEP_FAULT_KINDS, flip_lowest_bit, step_fault
from taxbench.train.build import build_optimizer, build_pipeline
from taxbench.train.data import build_source
from taxbench.train.planted import PlantedDelay


@dataclass
class RngSnapshot:
    python: Any
    numpy: Any
    torch_cpu: torch.Tensor
    torch_cuda: list[torch.Tensor] | None

    @classmethod
    def capture(cls) -> RngSnapshot:
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        return cls(random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda)

    @classmethod
    def seeded(cls, seed: int) -> RngSnapshot:
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)  # also seeds every CUDA device
        return cls.capture()

    def restore(self) -> None:
        random.setstate(self.python)
        np.random.set_state(self.numpy)
        torch.set_rng_state(self.torch_cpu)
        if self.torch_cuda is not None:
            torch.cuda.set_rng_state_all(self.torch_cuda)

    def state_dict(self) -> dict[str, Any]:
        return {"python": self.python, "numpy": self.numpy, "torch_cpu": self.torch_cpu, "torch_cuda": self.torch_cuda}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> RngSnapshot:
        # torch.load(map_location=<cuda>) moves every tensor to the GPU; RNG states must be CPU ByteTensors.
        cuda = state["torch_cuda"]
        return cls(state["python"], state["numpy"], state["torch_cpu"].cpu(),
                   None if cuda is None else [s.cpu() for s in cuda])


class StepTimer:
    """perf_counter on CPU; CUDA events (read at block end) on GPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def start(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def stop(self, started: Any) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return (started, event)
        return time.perf_counter() - started

    def seconds(self, measured: Any) -> float:
        if self.cuda:
            start, end = measured
            return float(start.elapsed_time(end)) / 1000.0
        return float(measured)


@contextmanager
def collected_between_blocks(manual: bool) -> Iterator[None]:
    """Python's garbage collector run before a timed block and paused inside it (a collection inside a timed step
    costs milliseconds at random; Megatron's --manual-gc does the same). Only the young generations are collected:
    a full collection walks every object of the process (over 100 ms here), and the long-lived ones are the models."""
    if not manual or not gc.isenabled():
        yield
        return
    gc.collect(1)
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def peak_memory(device: torch.device) -> dict[str, int]:
    """This process's peak memory so far (every run it holds counts): CUDA allocated and reserved, or host RSS."""
    if device.type == "cuda":
        return {"mem_peak_bytes": torch.cuda.max_memory_allocated(device),
                "mem_reserved_bytes": torch.cuda.max_memory_reserved(device)}
    return {"mem_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Trainer:
    def __init__(
        self,
        cfg: TaxbenchConfig,
        arm: str,
        replica: str,
        arm_policy: PolicyConfig,
        ctx: DistContext,
        run_dir: Path,
        fault: FaultConfig | None = None,
    ) -> None:
        recipe = cfg.recipe
        self.arm, self.replica, self.policy, self.ctx = arm, replica, arm_policy, ctx
        self.run_dir = run_dir
        self.fault = fault if fault is not None and fault.enabled else None
        self.step = 0
        self.grad_clip = recipe.optimizer.grad_clip
        layout = layout_for(recipe.parallel, ctx.world_size, ctx.rank)
        dp_size, dp_rank = layout.dp, layout.dp_rank
        self.grad_accum = recipe.global_batch_size // (recipe.micro_batch_size * dp_size)
        self.tokens_per_step = self.grad_accum * recipe.micro_batch_size * recipe.model.seq_len

        rng = RngSnapshot.seeded(recipe.seed)  # a custom model draws its initial values from torch's RNG
        built = build_pipeline(recipe, arm_policy, ctx, self.grad_accum)
        self.parallel, self.split, self.boundaries = built.parallel, built.split, built.boundaries
        self.pipeline, self.executor = built.pipeline, built.executor
        self.raw_model = self.parallel.parts
        self.model: torch.nn.Module = self.parallel.module
        self.optimizer = build_optimizer(recipe, self.raw_model.parameters())
        self.data = build_source(
            recipe.data, recipe.model.vocab_size, recipe.model.seq_len, recipe.micro_batch_size, dp_rank, dp_size
        )
        self.rng = RngSnapshot(rng.python, rng.numpy, rng.torch_cpu, rng.torch_cuda)
        self.timer = StepTimer(ctx.device)
        self.manual_gc = cfg.experiment.manual_gc
        self._gradients_checked = False  # see _require_every_parameter_trained
        self.block_times: list[float] = []  # this rank's step times of the last block run (for the stopping rule)
        planted = cfg.experiment.planted_tax if arm == "deterministic" else 0.0
        self.planted = PlantedDelay(planted, ctx.device) if planted > 0 else None
        self.writer = StepWriter(steps_file(run_dir, ctx.rank))
        # (record, step time, fingerprint time, planted-delay mark, digests) per step not yet written
        self._pending: list[tuple[dict[str, Any], Any, Any, Any, torch.Tensor]] = []
        # Where an injected fault fired (faults.rank<R>.jsonl, on every rank of a run with a fault: an empty file says
        # that it never fired there). Faults acting inside a step and the tracing-ladder capture are None in ordinary
        # runs (no per-step cost).
        self.fault_log = FaultLog(run_dir, ctx.rank) if self.fault is not None else None
        self._step_fault = step_fault(self.fault, ctx.rank, self.model, self.raw_model, self.boundaries,
                                      self._fault_fired)
        self.tracer = tracer_for_run(cfg.experiment.trace, run_name(arm, replica), run_dir, ctx.rank)
        if self.tracer is not None:
            self.tracer.attach(self)

    def pipeline_manifest(self) -> dict[str, Any]:
        """The pipeline as the manifest records it: schedule, stages and which blocks each holds (empty without)."""
        split, pipeline = self.split, self.pipeline
        if split is None or pipeline is None:
            return {}
        return {
            "pp_schedule": pipeline.schedule_name,
            "num_stages": split.num_stages,
            "stage_blocks": {str(stage): [held.start, held.stop - 1] for stage, held in split.blocks.items()},
            "stages_per_pp_rank": {str(r): list(split.stages_of(r)) for r in range(split.pp)},
        }

    @contextmanager
    def activated(self) -> Iterator[None]:
        """This run's RNG streams and policy, so that runs can be interleaved in one process."""
        self.rng.restore()
        with policy.active(self.policy):
            try:
                yield
            finally:
                self.rng = RngSnapshot.capture()

    def run_block(self, steps: int, block: int, on_step: Callable[[], None] | None = None) -> None:
        self.block_times = []
        with self.activated(), collected_between_blocks(self.manual_gc):
            # Start the block together: untimed work before it (the arm switch, the other arm's records) on one rank
            # would otherwise leak into another rank's timed first step through the gradient all-reduce.
            if dist.is_initialized() and self.ctx.world_size > 1:
                dist.barrier()
            _sync(self.ctx.device)
            window_start = time.perf_counter()
            for _ in range(steps):
                with self._step_scope():
                    self._train_step(block)
                if on_step is not None:
                    on_step()
            _sync(self.ctx.device)
            window = time.perf_counter() - window_start
            self._flush(window / steps)
            self.writer.sync()

    def _step_scope(self) -> AbstractContextManager[None]:
        if self._step_fault is None and self.tracer is None:
            return nullcontext()
        scope = ExitStack()
        if self._step_fault is not None:  # entered first, so that the capture sees the faulty op's output
            scope.enter_context(self._step_fault.around(self.step + 1))
        if self.tracer is not None:
            scope.enter_context(self.tracer.capture_step(self.step + 1))
        return scope

    def _train_step(self, block: int) -> None:
        self.step += 1
        data_start = time.perf_counter()
        batches = [self.data.next_batch() for _ in range(self.grad_accum)]
        device = self.ctx.device
        batches = [(x.to(device, non_blocking=True), y.to(device, non_blocking=True)) for x, y in batches]
        data_s = time.perf_counter() - data_start

        started = self.timer.start()
        self.optimizer.zero_grad(set_to_none=True)
        loss_mean = self.executor.run(batches)
        self.parallel.finish_gradients()
        params = [p for p in self.raw_model.parameters() if p.grad is not None]
        if not self._gradients_checked:
            self._require_every_parameter_trained()
        max_norm = self.grad_clip if self.grad_clip > 0 else float("inf")
        grad_norm = self.parallel.clip_grad_norm_(max_norm)
        self.optimizer.step()
        planted_s, planted_mark = (0.0, None) if self.planted is None else self.planted.apply(started)
        measured = self.timer.stop(started)

        self._inject_fault()
        fingerprint_started = self.timer.start()  # the gates' own cost, outside the timed step, shown beside it
        digests = torch.stack(
            [
                fingerprint.float_bits(loss_mean.float()),
                self._digest(p.grad for p in params),
                fingerprint.float_bits(grad_norm.float()),
                self._digest(self.raw_model.parameters()),
                self._digest(self.optimizer_tensors()),
            ]
        )
        fingerprint_measured = self.timer.stop(fingerprint_started)
        record = {
            "arm": self.arm,
            "replica": self.replica,
            "rank": self.ctx.rank,
            "step": self.step,
            "block": block,
            "data_s": data_s,
            "tokens": self.tokens_per_step,
            "planted_s": planted_s,
            **peak_memory(self.ctx.device),
        }
        if self.split is not None:  # which pipeline stages this rank's fingerprints cover
            record["stages"] = list(self.split.stages)
        self._pending.append((record, measured, fingerprint_measured, planted_mark, digests))
        if self.ctx.device.type == "cpu":
            self._flush(None)

    def _require_every_parameter_trained(self) -> None:
        """Fail the first step this trainer runs when a trainable parameter of this rank got no gradient: the
        gates cannot see it (a parameter that never moves is perfectly repeatable), as a zero-bubble schedule's
        split weight pass on FSDP2 showed by leaving a whole pipeline stage untrained."""
        self._gradients_checked = True
        missing = [name for name, p in self.raw_model.named_parameters() if p.requires_grad and p.grad is None]
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise RuntimeError(
                f"rank {self.ctx.rank}, {run_name(self.arm, self.replica)} step {self.step}: {len(missing)} trainable "
                f"parameters got no gradient ({shown}); this layout or schedule would leave them untrained"
            )

    def _digest(self, tensors: Any) -> torch.Tensor:
        digest = fingerprint.tensors_digest(tensors)
        return digest if digest is not None else torch.zeros((), dtype=torch.int64, device=self.ctx.device)

    def optimizer_tensors(self) -> Iterator[torch.Tensor]:
        """Optimizer state in a fixed order, on its parameter's device (Adam keeps `step` on the CPU)."""
        for param in self.raw_model.parameters():
            for _, value in sorted(self.optimizer.state.get(param, {}).items()):
                if isinstance(value, torch.Tensor):
                    yield value if value.device == param.device else value.to(param.device, non_blocking=True)

    def _inject_fault(self) -> None:
        fault = self.fault
        if fault is None or fault.kind in STEP_FAULT_KINDS or fault.step != self.step or fault.rank != self.ctx.rank:
            return
        name, first = next(self.raw_model.named_parameters())
        to_local = getattr(first, "to_local", None)  # a sharded parameter: flip this rank's shard
        with torch.no_grad():
            flip_lowest_bit(to_local() if callable(to_local) else first)
        self._fault_fired(str(fault.kind), self.step, name)

    def _fault_fired(self, kind: str, step: int, where: str) -> None:
        if self.fault_log is not None:
            self.fault_log.fired(kind, step, where)

    def _flush(self, window_per_step: float | None) -> None:
        """Turn pending steps into records: one host copy of all digests, then one line per step."""
        if not self._pending:
            return
        digests = torch.stack([d for *_, d in self._pending]).cpu().tolist()
        for (record, measured, fingerprint_measured, planted_mark, _), values in zip(self._pending, digests,
                                                                                      strict=True):
            seconds = self.timer.seconds(measured)
            self.block_times.append(seconds)
            if self.planted is not None and self.timer.cuda:
                self.planted.observe(measured[0], planted_mark)
            loss_bits, grads, norm_bits, params, optim = values
            record.update(
                time_s=seconds,  # the analysed step time: CUDA events on GPU, perf_counter on CPU
                device_s=seconds if self.timer.cuda else None,
                # GPU: the block's synchronized wall-clock window per step (data loading and the harness's own work
                # included), a cross-check on the event times. On CPU time_s is already wall-clock.
                window_s=window_per_step,
                fingerprint_s=self.timer.seconds(fingerprint_measured),
                loss=_bits_to_float(loss_bits),
                loss_bits=fingerprint.bits_hex(loss_bits, torch.float32),
                grad_norm=_bits_to_float(norm_bits),
                grad_norm_bits=fingerprint.bits_hex(norm_bits, torch.float32),
                grads=fingerprint.to_hex(grads),
                params=fingerprint.to_hex(params),
                optim=fingerprint.to_hex(optim),
            )
            self.writer.write(record)  # flushed per line; fsync once per block (run_block), not per step
        self._pending.clear()

    def save_checkpoint(self, directory: Path) -> list[Path]:
        """Write this rank's part of the checkpoint into `directory` (a collective); the files it wrote."""
        self._flush(None)
        self.writer.sync()
        extras = {"step": self.step, "data": self.data.state_dict(), "rng": self.rng.state_dict()}
        return checkpoint_state.save(directory, self.parallel, self.optimizer, extras, self.ctx.rank)

    def load_checkpoint(self, directory: Path) -> None:
        """Restore the state saved in `directory`, then check it reproduces the step record written at that step."""
        try:
            extras = checkpoint_state.load(directory, self.parallel, self.optimizer, self.ctx.rank, self.ctx.device)
            self.data.load_state_dict(extras["data"])
            self.rng = RngSnapshot.from_state_dict(extras["rng"])
            self.step = int(extras["step"])
        except torch.OutOfMemoryError:
            raise
        except (OSError, RuntimeError, KeyError, TypeError, ValueError, EOFError, CheckpointException) as exc:
            raise CheckpointError(f"{directory}: unreadable checkpoint ({_first_line(exc)})") from exc
        self._check_restored(directory)
        self.drop_records_after(self.step)
        if self.tracer is not None:
            self.tracer.checkpoint_loaded(self)

    def _check_restored(self, path: Path) -> None:
        """A restore that does not reproduce the recorded parameters and optimizer state is an error, never a
        divergence for the gates to find later. Runs without a record of that step (a replay elsewhere) pass."""
        record = step_record(self.writer.path, self.step)
        if record is None:
            return
        restored = {
            "params": fingerprint.to_hex(int(self._digest(self.raw_model.parameters()).item())),
            "optim": fingerprint.to_hex(int(self._digest(self.optimizer_tensors()).item())),
        }
        differing = [f"{metric} {value} vs recorded {record.get(metric)}" for metric, value in restored.items()
                     if record.get(metric) != value]
        if differing:
            raise CheckpointError(
                f"{path}: restored state does not reproduce the record of step {self.step} in {self.writer.path} "
                f"({'; '.join(differing)})"
            )

    def drop_records_after(self, step: int) -> None:
        """Forget step, fault and trace records past `step`: a resumed or restarted run writes them again."""
        self.writer.truncate_after(step)
        if self.fault_log is not None:
            self.fault_log.truncate_after(step)
        if self.tracer is not None:
            self.tracer.truncate_after(step)

    def close(self) -> None:
        self._flush(None)
        self.writer.close()
        if self.fault_log is not None:
            self.fault_log.close()
        if self.tracer is not None:
            self.tracer.close()


def _first_line(exc: BaseException) -> str:
    if isinstance(exc, CheckpointException) and exc.failures:  # DCP: the first failing rank's own error
        exc = next(iter(exc.failures.values()))[0]
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _bits_to_float(bits: int) -> float:
    return float(np.array([bits & 0xFFFFFFFF], dtype=np.uint32).view(np.float32)[0])
