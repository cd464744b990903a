"""One training run of one arm on one rank, the step loop: timed steps, their records, checkpoint/resume.

It gets a RunSpec; its model share comes from the recipe's stack (taxbench.stacks.registry.stack_for), its records
from taxbench.train.recorder.
Under experiment.interleave=policy one trainer serves every timed arm: each arm is a Lane (its policy, records and
planted delay) of the one model, and each block runs under the lane it names.

Timing covers zero_grad, forward, backward, gradient reduction, clipping and the optimizer step; data loading is
timed separately and fingerprinting runs after the timer stops, so the harness stays out of the numbers it reports.
On CUDA, step times come from CUDA events and digests stay on the device until the block ends (one sync per block).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException

from taxbench.checkpoint.rng import RngSnapshot
from taxbench.checkpoint.store import CheckpointError
from taxbench.config.schema import FaultConfig, PolicyConfig, RecipeConfig, TaxbenchConfig, TraceConfig
from taxbench.design import run_name
from taxbench.parallel.distributed import DistContext
from taxbench.parallel.layout import layout_for
from taxbench.rundir.records import FaultLog, steps_file
from taxbench.rundir.step_record import (
    ARM,
    BLOCK,
    DATA_S,
    PLANTED_S,
    RANK,
    REPLICA,
    STAGES,
    STEP,
    TOKENS,
    TRAJECTORY_STEP,
)
from taxbench.runtime import determinism
from taxbench.stacks.registry import stack_for
from taxbench.stacks.step import Batch
from taxbench.tracing.capture import tracer_for_run
from taxbench.tracing.faults import flip_param_bit, step_fault
from taxbench.train.data import build_source
from taxbench.train.planted import PlantedDelay
from taxbench.train.recorder import StepRecorder
from taxbench.train.timer import StepTimer, collected_between_blocks, peak_memory, synchronize
from taxbench.workloads import use_deterministic_kernels


@dataclass(frozen=True)
class RunSpec:
    """What one run of one arm needs: the recipe, which run it is and under which policy, where its records go, and
    the few experiment settings the step loop reads."""

    recipe: RecipeConfig
    arm: str
    replica: str
    policy: PolicyConfig
    run_dir: Path
    manual_gc: bool = True
    planted_tax: float = 0.0  # this run's planted slowdown (experiment.planted_tax on the deterministic arm)
    trace: TraceConfig | None = None  # the tracing ladder's capture (experiment.trace), if it selects this run
    fault: FaultConfig | None = None  # an injected fault that applies to this run

    @classmethod
    def of(cls, cfg: TaxbenchConfig, arm: str, replica: str, arm_policy: PolicyConfig, run_dir: Path,
           fault: FaultConfig | None = None) -> RunSpec:
        exp = cfg.experiment
        return cls(cfg.recipe, arm, replica, arm_policy, run_dir, exp.manual_gc,
                   exp.planted_tax if arm == "deterministic" else 0.0, exp.trace,
                   fault if fault is not None and fault.enabled else None)


@dataclass
class Lane:
    """One run's part of a trainer: its arm and policy, its records, its planted delay, the steps it has taken."""

    arm: str
    replica: str
    policy: PolicyConfig
    run_dir: Path
    recorder: StepRecorder
    planted: PlantedDelay | None
    step: int = 0

    @property
    def name(self) -> str:
        return run_name(self.arm, self.replica)


class Trainer:
    """One run of one arm on this rank, the step loop: its model share, data, timed steps and their records.

    With more lanes (add_lane), the one model trains every lane's blocks in turn: the model's step (`step`) counts
    them all, each lane's records count its own steps (and name the model's step as trajectory_step)."""

    def __init__(self, spec: RunSpec, ctx: DistContext) -> None:
        recipe = spec.recipe
        arm, replica, arm_policy, run_dir = spec.arm, spec.replica, spec.policy, spec.run_dir
        self.recipe, self.ctx = recipe, ctx
        self.fault = spec.fault
        self.step = 0
        layout = layout_for(recipe.parallel, ctx.world_size, ctx.rank)
        dp_size, dp_rank = layout.dp, layout.dp_rank
        self.grad_accum = recipe.global_batch_size // (recipe.micro_batch_size * dp_size)
        self.tokens_per_step = self.grad_accum * recipe.micro_batch_size * recipe.model.seq_len

        rng = RngSnapshot.seeded(recipe.seed)  # a custom model draws its initial values from torch's RNG
        stack = stack_for(recipe.model)
        built = stack.build(recipe, arm_policy, ctx, self.grad_accum)
        self.parallel, self.split, self.boundaries = built.parallel, built.split, built.boundaries
        self.pipeline = built.pipeline
        self.raw_model = self.parallel.parts
        self.model: torch.nn.Module = self.parallel.module
        self.optimizer = stack.optimizer(recipe, built)
        # The step, what it holds and its checkpoint: the stack's engine's where it owns them, else the harness's own.
        self.owned_step = built.owned_step(self.optimizer, recipe.optimizer.grad_clip, self._where)
        self.data = build_source(
            recipe.data, recipe.model.vocab_size, recipe.model.seq_len, recipe.micro_batch_size, dp_rank, dp_size
        )
        self.rng = RngSnapshot(rng.python, rng.numpy, rng.torch_cpu, rng.torch_cuda)
        self.timer = StepTimer(ctx.device)
        self.manual_gc = spec.manual_gc
        self.block_times: list[float] = []  # this rank's step times of the last block run (for the stopping rule)
        self.lanes: dict[str, Lane] = {}
        self.lane = self.add_lane(spec)
        # Where an injected fault fired (faults.rank<R>.jsonl, on every rank of a run with a fault: an empty file says
        # that it never fired there). Faults acting inside a step and the tracing-ladder capture are None in ordinary
        # runs (no per-step cost).
        self.fault_log = FaultLog(run_dir, ctx.rank) if self.fault is not None else None
        self._step_fault = step_fault(self.fault, ctx.rank, self.model, self.raw_model, self.boundaries,
                                      self._fault_fired)
        self.tracer = tracer_for_run(spec.trace, run_name(arm, replica), run_dir, ctx.rank)
        if self.tracer is not None:
            self.tracer.attach(self)

    def add_lane(self, spec: RunSpec) -> Lane:
        """A run that trains this trainer's model in blocks of its own (its policy, records and planted delay)."""
        if spec.recipe != self.recipe:
            raise ValueError(f"{run_name(spec.arm, spec.replica)}: a lane must train the same recipe as its model")
        planted = PlantedDelay(spec.planted_tax, self.ctx.device) if spec.planted_tax > 0 else None
        recorder = StepRecorder(steps_file(spec.run_dir, self.ctx.rank), self.timer, self.ctx.device, planted)
        lane = Lane(spec.arm, spec.replica, spec.policy, spec.run_dir, recorder, planted)
        self.lanes[lane.name] = lane
        return lane

    # The current lane's identity (the only one for an ordinary run).
    @property
    def arm(self) -> str:
        return self.lane.arm

    @property
    def replica(self) -> str:
        return self.lane.replica

    @property
    def policy(self) -> PolicyConfig:
        return self.lane.policy

    @property
    def run_dir(self) -> Path:
        return self.lane.run_dir

    @property
    def recorder(self) -> StepRecorder:
        return self.lane.recorder

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
        if len(self.lanes) > 1:  # the model's kernels follow the lane's policy
            for part in self.raw_model.parts:
                use_deterministic_kernels(part, self.policy.deterministic_kernels)
        with determinism.active(self.policy):
            try:
                yield
            finally:
                self.rng = RngSnapshot.capture()

    def run_block(self, steps: int, block: int, on_step: Callable[[], None] | None = None,
                  lane: str | None = None, together: bool = False, hand_over: bool = False) -> None:
        """Run `steps` steps as block `block` of the lane named `lane` (default: the current one). `together`: the
        ranks have just left a collective, with only the same work on every rank since, so the block needs no
        barrier of its own to start together. `hand_over`: another block follows at once, with only the same work
        on every rank between, so its barrier starts as this block's last timed step ends
        (DistContext.begin_next_block)."""
        if lane is not None:
            self.lane = self.lanes[lane]
        self._run_steps(steps, lambda: block, on_step, together, hand_over)

    def run_untimed(self, steps: int, block_steps: int, on_step: Callable[[], None] | None = None) -> None:
        """Run `steps` steps of an untimed run in one stretch (one activation and one barrier, not one per block):
        each step's record names the block of `block_steps` steps it falls in, as if run block by block."""
        self._run_steps(steps, lambda: self.lane.step // block_steps, on_step, together=False, hand_over=False)

    def _run_steps(self, steps: int, block_of_next_step: Callable[[], int], on_step: Callable[[], None] | None,
                   together: bool, hand_over: bool) -> None:
        self.recorder.take_times()  # forget steps written outside a block (none but after a checkpoint save)
        # Start the block together: untimed work before it (the arm switch, the other arm's records) on one rank
        # would otherwise leak into another rank's timed first step through the gradient all-reduce. The barrier was
        # started as the previous block's last timed step ended (a block handed over), or starts now.
        barrier = self.ctx.block_start(together)
        with self.activated(), collected_between_blocks(self.manual_gc):
            if self.lane.planted is not None:  # every rank plants the same delay in this block's steps
                self.lane.planted.agree(self.ctx.world_size)
            # A fault or a trace scopes each step whole, its data loading included: those steps load their own.
            first = self._load_batches() if self._step_fault is None and self.tracer is None else None
            if barrier is not None:
                barrier.wait()
            synchronize(self.ctx.device)
            window_start = time.perf_counter()
            for index in range(steps):
                with self.step_scope():
                    self._train_step(block_of_next_step(), first if index == 0 else None,
                                     hand_over and index == steps - 1)
                if on_step is not None:
                    on_step()
            synchronize(self.ctx.device)
            # the first step's batches, loaded before the barrier's wait, count in the window as the others' do
            window = time.perf_counter() - window_start + (first[1] if first is not None else 0.0)
            self.recorder.flush(window / steps)
            self.block_times = self.recorder.take_times()

    def step_scope(self) -> AbstractContextManager[None]:
        """Around the next step: its injected fault and its tracing capture, where the run has them."""
        if self._step_fault is None and self.tracer is None:
            return nullcontext()
        scope = ExitStack()
        if self._step_fault is not None:  # entered first, so that the capture sees the faulty op's output
            scope.enter_context(self._step_fault.around(self.step + 1))
        if self.tracer is not None:
            scope.enter_context(self.tracer.capture_step(self.step + 1))
        return scope

    def _load_batches(self) -> tuple[list[Batch], float]:
        """The next step's micro-batches and the seconds loading them took."""
        started = time.perf_counter()
        batches = self.next_batches()
        return batches, time.perf_counter() - started

    def _train_step(self, block: int, loaded: tuple[list[Batch], float] | None = None,
                    hand_over: bool = False) -> None:
        """One step (its batches loaded already, or loaded here), its fingerprints and its record; the last of a
        block that hands over starts the next block's barrier as soon as it is timed."""
        self.step += 1
        lane = self.lane
        lane.step += 1
        batches, data_s = loaded if loaded is not None else self._load_batches()

        started = self.timer.start()
        loss_mean, grad_norm = self.optimize(batches)
        grads, params = self.held_tensors()
        planted_s, planted_mark = (0.0, None) if lane.planted is None else lane.planted.apply(started)
        measured = self.timer.stop(started)
        if hand_over:
            self.ctx.begin_next_block()

        flip_param_bit(self.fault, self.ctx.rank, self.step, self.named_held_parameters(), self._fault_fired)
        fingerprint_started = self.timer.start()  # the gates' own cost, outside the timed step, shown beside it
        digests = self.recorder.fingerprints(loss_mean, grads, grad_norm, params, self.optimizer_tensors())
        fingerprint_measured = self.timer.stop(fingerprint_started)
        record = {
            ARM: lane.arm,
            REPLICA: lane.replica,
            RANK: self.ctx.rank,
            STEP: lane.step,
            BLOCK: block,
            DATA_S: data_s,
            TOKENS: self.tokens_per_step,
            PLANTED_S: planted_s,
            **peak_memory(self.ctx.device),
        }
        if self.split is not None:  # which pipeline stages this rank's fingerprints cover
            record[STAGES] = list(self.split.stages)
        if len(self.lanes) > 1:  # the model's own step, every lane's steps counted
            record[TRAJECTORY_STEP] = self.step
        lane.recorder.add(record, measured, fingerprint_measured, planted_mark, digests)

    def next_batches(self) -> list[Batch]:
        """The step's micro-batches, on the device."""
        device = self.ctx.device
        batches = [self.data.next_batch() for _ in range(self.grad_accum)]
        return [(x.to(device, non_blocking=True), y.to(device, non_blocking=True)) for x, y in batches]

    def optimize(self, batches: list[Batch], optimizer_step: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's work on `batches` (what is timed): forward, backward, gradient reduction, clipping and, unless
        told not to, the optimizer step; the mean loss and the gradient norm."""
        return self.owned_step.optimize(batches, optimizer_step)

    def _where(self) -> str:
        """This rank, run and step, as an error from inside the step names them."""
        return f"rank {self.ctx.rank}, {run_name(self.arm, self.replica)} step {self.step}"

    def named_held_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The parameters this rank holds and its optimizer steps, by name (a stack's engine: its partitions,
        "partition <i>", which it copies into the module's parameters after its optimizer step)."""
        return self.owned_step.named_parameters()

    def held_tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The gradients and parameters this rank holds, as fingerprinted (a stack's engine: its partitions)."""
        return self.owned_step.held_tensors()

    def optimizer_tensors(self) -> Iterator[torch.Tensor]:
        """Optimizer state in a fixed order, as this rank holds it (taxbench.stacks.step.OwnedStep)."""
        return self.owned_step.optimizer_tensors()

    def _fault_fired(self, kind: str, step: int, where: str) -> None:
        if self.fault_log is not None:
            self.fault_log.fired(kind, step, where)

    def save_checkpoint(self, directory: Path) -> list[Path]:
        """Write this rank's part of the checkpoint into `directory` (a collective); the files it wrote."""
        for lane in self.lanes.values():
            lane.recorder.flush(None)
            lane.recorder.sync()
        extras = {"step": self.step, "lane_steps": {name: lane.step for name, lane in self.lanes.items()},
                  "data": self.data.state_dict(), "rng": self.rng.state_dict()}
        return self.owned_step.save(directory, extras, self.ctx.rank)

    def load_checkpoint(self, directory: Path) -> None:
        """Restore the state saved in `directory`, then check it reproduces the step record written at that step."""
        try:
            extras = self.owned_step.load(directory, self.ctx.rank, self.ctx.device)
            self.data.load_state_dict(extras["data"])
            self.rng = RngSnapshot.from_state_dict(extras["rng"])
            self.step = int(extras["step"])
            lane_steps = extras.get("lane_steps", {})
            for name, lane in self.lanes.items():
                lane.step = int(lane_steps.get(name, self.step) if len(self.lanes) > 1 else self.step)
        except torch.OutOfMemoryError:
            raise
        except (OSError, RuntimeError, KeyError, TypeError, ValueError, EOFError, CheckpointException) as exc:
            raise CheckpointError(f"{directory}: unreadable checkpoint ({_first_line(exc)})") from exc
        for lane in self.lanes.values():
            lane.recorder.check_restored(directory, lane.step, self.step, self.held_tensors()[1],
                                         self.optimizer_tensors())
        self.drop_records_after(None)
        if self.tracer is not None:
            self.tracer.checkpoint_loaded(self)

    def drop_records_after(self, step: int | None) -> None:
        """Forget step, fault and trace records past `step` (None: past each lane's own step): a resumed or restarted
        run writes them again."""
        for lane in self.lanes.values():
            lane.recorder.truncate_after(lane.step if step is None else step)
        step = self.step if step is None else step
        if self.fault_log is not None:
            self.fault_log.truncate_after(step)
        if self.tracer is not None:
            self.tracer.truncate_after(step)

    def close(self) -> None:
        self.ctx.settle_block_barrier()  # a block handed over to none (a rank that stopped mid-round)
        for lane in self.lanes.values():
            lane.recorder.close()
        if self.fault_log is not None:
            self.fault_log.close()
        if self.tracer is not None:
            self.tracer.close()


def _first_line(exc: BaseException) -> str:
    if isinstance(exc, CheckpointException) and exc.failures:  # DCP: the first failing rank's own error
        exc = next(iter(exc.failures.values()))[0]
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
