"""The experiment schedule that every rank runs inside one allocation.

1. Interleaved rounds (experiment.interleave=all): baseline-0, deterministic-0, deterministic-1 (repeatability gate)
   and baseline-1 (baseline sanity: what determinism buys) advance one block each per round, in an A B B A order of
   the arms (see taxbench.design.round_orders), so that drift over the allocation lands on every run alike and every
   run's steps are timed. They stop after experiment.steps, or, with experiment.target_half_width, once the tax
   interval is that narrow (see taxbench.schedule.stopping). With interleave=pair only the *-0 runs are interleaved
   and the other two run whole after them. With interleave=policy one model trains in the rounds, its policy switched
   per block in the same A B B A order (baseline-timed and deterministic-timed record each arm's blocks), and all
   four runs run whole after them, one after another: the experiment never holds more than one model.
2. deterministic-resumed: runs to experiment.resume_step, checkpoints, is torn down, and a fresh trainer resumes from
   the checkpoint (restart-replay gate). It and every other run not timed in the rounds (a gate-only run) takes
   experiment.gate_steps steps (taxbench.design.gate_run_steps), never more than the rounds took.
   Checkpoints for preemption safety are taken by time (taxbench.schedule.checkpoint_clock), between blocks.
3. With experiment.ablation (taxbench.design): the with_<knob> arms are timed in the rounds beside the pair, the
   without_<knob> replicas run whole after the resumed run, and last each timed arm runs experiment.warmup_steps +
   experiment.profile_steps steps in a run of its own (<arm>-profile) whose last steps torch.profiler records
   (taxbench.train.op_profile), so that profiling never touches a timed step.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import torch

from taxbench.checkpoint.store import RunCheckpoints, commit, finish, resume_step
from taxbench.config import policy
from taxbench.config.schema import TaxbenchConfig, max_steps
from taxbench.design import (
    ALL_RUNS,
    RESUMED,
    ExperimentDesign,
    RunRef,
    design_of,
    experiment_steps,
    gate_run_steps,
    round_orders,
)
from taxbench.parallel.distributed import DistContext
from taxbench.parallel.stack_facts import gather_stack
from taxbench.progress import IDLE, StepProgress
from taxbench.rundir.cost_file import ScheduleCost
from taxbench.rundir.manifest import RunFacts, write_run_manifest
from taxbench.rundir.records import op_table_file
from taxbench.rundir.stop_file import Stop, read_stop, write_commits
from taxbench.runtime import determinism
from taxbench.schedule.checkpoint_clock import CheckpointClock
from taxbench.schedule.cost import Stopwatch, command_started_unix, process_start_unix
from taxbench.schedule.stopping import StoppingRule
from taxbench.stacks.registry import stack_for
from taxbench.train.flops import throughput_manifest
from taxbench.train.op_profile import profile_steps
from taxbench.train.trainer import RunSpec, Trainer


def profile_run_steps(cfg: TaxbenchConfig) -> int:
    return cfg.experiment.warmup_steps + cfg.experiment.profile_steps


def total_steps(cfg: TaxbenchConfig, steps: int | None = None, design: ExperimentDesign | None = None) -> int:
    """Steps of the whole experiment at `steps` per timed run (default experiment.steps: with a precision target, the
    least it may take; the progress bar grows) and gate_run_steps per gate-only run."""
    return experiment_steps(cfg, steps, design).total


class Experiment:
    def __init__(self, cfg: TaxbenchConfig, ctx: DistContext, root: Path, progress: StepProgress = IDLE):
        self.cfg, self.ctx, self.root, self.progress = cfg, ctx, root, progress
        self.attempt_id = uuid.uuid4().hex[:12]  # this start of the schedule (rank 0 names it in the manifests)
        self._throughput: dict | None = None  # counted once, on rank 0 (see taxbench.train.flops)
        self.design = design_of(cfg)
        started, rank_started = command_started_unix(), process_start_unix()
        if started is not None and rank_started is not None:  # an in-process rank starts with its launch
            rank_started = max(started, rank_started)
        self.cost = ScheduleCost(started_unix=started, rank_started_unix=rank_started,
                                 process_group_unix=ctx.ready_unix)
        self._checkpointing = Stopwatch()  # time in commits

    def _spec(self, ref: RunRef) -> RunSpec:
        fault = self.cfg.experiment.fault
        applies = fault if fault.applies_to(ref.arm, ref.replica) else None
        return RunSpec.of(self.cfg, ref.arm, ref.replica, self.design.policies[ref.arm], self.root / ref.name, applies)

    def _trainer(self, ref: RunRef) -> Trainer:
        trainer = Trainer(self._spec(ref), self.ctx)
        self._write_manifest(ref, trainer)
        return trainer

    def _shared_trainer(self, runs: Sequence[RunRef]) -> Trainer:
        """experiment.interleave=policy: one model with a lane per timed run (built under the first run's policy,
        whose communicator its collectives keep: NCCL_ALGO is not switched per block)."""
        trainer = Trainer(self._spec(runs[0]), self.ctx)
        for ref in runs[1:]:
            trainer.add_lane(self._spec(ref))
        for ref in runs:
            self._write_manifest(ref, trainer)
        return trainer

    def _write_manifest(self, ref: RunRef, trainer: Trainer) -> None:
        """Gather what only this process knows (a collective: every rank calls it); rank 0 writes the manifest."""
        stack = gather_stack(self.ctx)
        if self.ctx.rank != 0:
            return
        arm_policy = self.design.policies[ref.arm]
        with determinism.active(arm_policy):
            applied = determinism.applied_state(self.cfg.cluster.device)
        if self._throughput is None:
            self._throughput = throughput_manifest(self.cfg.recipe, self.cfg.cluster)
        training_stack = stack_for(self.cfg.recipe.model)
        switch = training_stack.switch(self.cfg.recipe, arm_policy)
        switch.update(trainer.owned_step.received())  # what a built engine received, read back, over what was planned
        facts = RunFacts(
            policy_applied=applied,
            stack_switch=switch,
            stack_native_audit=policy.audit(arm_policy, training_stack.name) if arm_policy.stack_native else None,
            layout={
                **trainer.parallel.layout.manifest(),
                "backend": self.ctx.backend,
                "grad_accum": trainer.grad_accum,
                **trainer.pipeline_manifest(),
            },
            stack=stack,
            threads={"torch_threads": torch.get_num_threads(), "interop_threads": torch.get_num_interop_threads()},
            shared_model=sorted(trainer.lanes) if len(trainer.lanes) > 1 else None,
            throughput=self._throughput,
        )
        write_run_manifest(self.root, ref, self.cfg, arm_policy, facts, self.attempt_id)

    def run(self) -> None:
        """Run the schedule. Restarted after a preemption, it skips finished runs and resumes unfinished ones from
        their newest complete checkpoint that is intact on every rank (records written past it are dropped, so
        nothing is duplicated)."""
        self.cost.schedule_start_unix = time.time()
        interleaved = self.design.interleaved
        began = time.perf_counter()
        stop = self._run_interleaved(interleaved)
        self.cost.rounds_s = time.perf_counter() - began
        self.cost.rounds_checkpoints_s = self._checkpointing.total
        began = time.perf_counter()
        profiled = self.design.profiled
        self.progress.grow_to(total_steps(self.cfg, stop.steps, self.design))
        exp = self.cfg.experiment
        gate = gate_run_steps(exp.gate_steps, exp.steps, stop.steps)  # the gate-only runs' steps
        for ref in (r for r in ALL_RUNS if r not in interleaved and r != RESUMED):
            self._run_whole(ref, gate)
        self._run_resumed(gate)
        for ref in self.design.repeated_knob_runs:
            self._run_whole(ref, gate)
        for ref in profiled:
            self._run_profiled(ref)
        self.cost.gate_runs_s = time.perf_counter() - began
        self.cost.checkpoints_s = self._checkpointing.total
        self.cost.end_unix = time.time()
        if self.ctx.rank == 0:
            self.cost.write(self.root)

    def _checkpoints(self, ref: RunRef) -> RunCheckpoints:
        return RunCheckpoints(self.root / ref.name, self.ctx.rank)

    def _start(self, ref: RunRef, step: int | None) -> Trainer:
        """A trainer for `ref` at `step` (None: from scratch, dropping records of an interrupted earlier attempt)."""
        trainer = self._trainer(ref)
        if step is None:
            trainer.drop_records_after(0)
        else:
            trainer.load_checkpoint(self._checkpoints(ref).path(step))
        return trainer

    def _skip(self, steps: int) -> None:
        for _ in range(steps):
            self.progress.advance()

    def _timed_trainers(self, runs: Sequence[RunRef], start: int | None) -> dict[RunRef, Trainer]:
        """A trainer per timed run, or one for all under experiment.interleave=policy, at `start`."""
        if not self.design.shared_model:
            return {ref: self._start(ref, start) for ref in runs}
        shared = self._shared_trainer(runs)
        if start is None:
            shared.drop_records_after(0)
        else:
            shared.load_checkpoint(self._checkpoints(runs[0]).path(start))
        return dict.fromkeys(runs, shared)

    def _run_interleaved(self, runs: Sequence[RunRef]) -> Stop:
        exp = self.cfg.experiment
        progress = {ref: self._checkpoints(ref) for ref in runs}
        stored = read_stop(self.root)
        if stored is not None and all(p.finished for p in progress.values()):
            self._skip(len(runs) * stored.steps)
            return stored
        # Where each trainer's checkpoints go: its run's folder, or the first run's for a shared model.
        saved_in = [runs[0]] if self.design.shared_model else list(runs)
        # The runs resume from the same block boundary, so every round still holds one block of each run.
        start = resume_step([progress[ref] for ref in saved_in])
        self.progress.describe(f"timed rounds of {len(runs)} runs" + (" on one model" if self.design.shared_model
                                                                      else ""))
        trainers = self._timed_trainers(runs, start)
        rule = StoppingRule(exp, runs, self.ctx)
        clock = CheckpointClock(exp, self.ctx)
        if start:
            rule.resume(self.root, start)
        self._skip(len(runs) * (start or 0))
        first_block = (start or 0) // exp.block_steps
        cap = max_steps(exp)
        stop = None
        together = False  # the ranks left the last round's all-reduce together, and nothing but the same work since
        for block, order in enumerate(round_orders(exp.order_seed, runs, cap // exp.block_steps)):
            if block < first_block:
                continue
            times = {}
            if self.cost.first_step_unix is None:
                self.cost.first_step_unix = time.time()
            for position, ref in enumerate(order):  # a round's blocks follow each other at once
                trainers[ref].run_block(exp.block_steps, block, self.progress.advance, ref.name,
                                        together=together and position == 0, hand_over=position < len(order) - 1)
                times[ref.name] = trainers[ref].block_times
            step = (block + 1) * exp.block_steps
            elapsed = rule.add_round(times, clock.elapsed_s())  # a collective: the next round starts from it
            together = True
            self.cost.timed_steps_s += sum(sum(values[-exp.block_steps:]) for values in rule.times.values())
            stop = rule.stop_after(step)
            if stop is not None:
                break
            if step >= exp.steps:  # one more round than planned
                self.progress.grow_to(total_steps(self.cfg, step + exp.block_steps, self.design))
            if clock.due(step, exp.block_steps, cap, elapsed):
                with self._checkpointing:
                    commit(step, [(progress[ref], trainers[ref]) for ref in saved_in])
                clock.committed()
                rule.committed(step)
                if self.ctx.rank == 0:  # a continue carries them into stop.json (the tax leaves the next step out)
                    write_commits(self.root, rule.recorded_commits())
                together = False  # rank 0 wrote alone
        assert stop is not None, "the step cap always stops the rounds"
        for trainer in {id(t): t for t in trainers.values()}.values():
            trainer.close()
        if self.ctx.rank == 0:
            stop.write(self.root)
        finish(list(progress.values()))
        return stop

    def _advance(self, ref: RunRef, trainer: Trainer, until: int, last: int) -> None:
        exp = self.cfg.experiment
        checkpoints = self._checkpoints(ref)
        clock = CheckpointClock(exp, self.ctx)
        while trainer.step < until:
            n = clock.next_decision(trainer.step, exp.block_steps, until) - trainer.step
            trainer.run_untimed(n, exp.block_steps, self.progress.advance)
            if clock.due(trainer.step, n, last, clock.agreed_elapsed_s()):
                with self._checkpointing:
                    commit(trainer.step, [(checkpoints, trainer)])
                clock.committed()

    def _run_whole(self, ref: RunRef, steps: int) -> None:
        checkpoints = self._checkpoints(ref)
        if checkpoints.finished:
            self._skip(steps)
            return
        start = resume_step([checkpoints])
        self.progress.describe(ref.name)
        trainer = self._start(ref, start)
        self._skip(start or 0)
        self._advance(ref, trainer, steps, steps)
        trainer.close()
        finish([checkpoints])

    def _run_profiled(self, ref: RunRef) -> None:
        """Warm a fresh trainer of the arm up, then record its op table over experiment.profile_steps steps."""
        exp = self.cfg.experiment
        checkpoints = self._checkpoints(ref)
        if checkpoints.finished:
            self._skip(profile_run_steps(self.cfg))
            return
        self.progress.describe(f"{ref.name}: op profile")
        trainer = self._start(ref, None)
        if exp.warmup_steps:
            trainer.run_block(exp.warmup_steps, 0, self.progress.advance)
        table = profile_steps(trainer, exp.profile_steps, 1, self.progress.advance)
        table.write(op_table_file(self.root / ref.name, self.ctx.rank))
        trainer.close()
        finish([checkpoints])

    def _run_resumed(self, steps: int) -> None:
        exp = self.cfg.experiment
        checkpoints = self._checkpoints(RESUMED)
        if checkpoints.finished:
            self._skip(steps)
            return
        start = resume_step([checkpoints])
        self._skip(start or 0)
        self.progress.describe(RESUMED.name)
        if start is None or start < exp.resume_step:
            first = self._start(RESUMED, start)
            self._advance(RESUMED, first, exp.resume_step, steps)
            if checkpoints.latest() != exp.resume_step:  # else _advance has just committed it
                with self._checkpointing:
                    commit(exp.resume_step, [(checkpoints, first)])
            first.close()
            del first
            start = exp.resume_step
        # The restart-replay gate: a fresh trainer continues from the checkpoint.
        resumed = self._start(RESUMED, start)
        self._advance(RESUMED, resumed, steps, steps)
        resumed.close()
        finish([checkpoints])
