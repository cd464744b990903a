"""The experiment schedule that every rank runs inside one allocation.

1. Timed pair: baseline-0 and deterministic-0 advance in interleaved blocks, in a seeded random order per round,
   so that drift over the allocation lands on both arms alike.
2. deterministic-1: an independent deterministic run (repeatability gate).
3. deterministic-resumed: runs to experiment.resume_step, checkpoints, is torn down, and a fresh trainer resumes from
   the checkpoint (restart-replay gate).
4. baseline-1: a second baseline run (baseline sanity: shows what determinism buys).
"""

from __future__ import annotations

import os
import random
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from omegaconf import OmegaConf

from taxbench import manifest, policy, provenance
from taxbench.checkpoints import RunCheckpoints, commit, finish, resume_step
from taxbench.config import ARM_NAMES, TaxbenchConfig
from taxbench.distributed import DistContext
from taxbench.records import ALL_RUNS, BASELINE_REPEAT, MANIFEST, REPEAT, RESUMED, TIMED, RunRef, write_manifest
from taxbench.trainer import Trainer


def arm_order(order_seed: int, rounds: int) -> list[list[str]]:
    rng = random.Random(order_seed)
    orders = []
    for _ in range(rounds):
        order = list(ARM_NAMES)
        rng.shuffle(order)
        orders.append(order)
    return orders


def total_steps(cfg: TaxbenchConfig) -> int:
    return len(ALL_RUNS) * cfg.experiment.steps


class Experiment:
    def __init__(self, cfg: TaxbenchConfig, ctx: DistContext, root: Path, on_step: Callable[[], None] | None = None):
        self.cfg, self.ctx, self.root, self.on_step = cfg, ctx, root, on_step
        self.attempt_id = uuid.uuid4().hex[:12]  # this start of the schedule (rank 0 names it in the manifests)

    def _trainer(self, ref: RunRef) -> Trainer:
        run_dir = self.root / ref.name
        fault = self.cfg.experiment.fault
        arm_policy = self.cfg.arms[ref.arm]
        trainer = Trainer(self.cfg, ref.arm, ref.replica, arm_policy, self.ctx, run_dir,
                          fault if fault.applies_to(ref.arm, ref.replica) else None)
        self._write_manifest(ref, trainer)
        return trainer

    def _attempts(self, ref: RunRef, stack: dict) -> list[dict]:
        """Every start of this run's processes (a requeue or continue adds one), with where it ran."""
        attempts = []
        if (self.root / ref.name / MANIFEST).exists():
            from taxbench.analysis.records import load_manifest  # names a damaged manifest in one line

            attempts = load_manifest(self.root / ref.name).get("attempts", [])
        if not attempts or attempts[-1]["id"] != self.attempt_id:
            attempts.append({
                "id": self.attempt_id,
                "started_utc": datetime.now(UTC).isoformat(timespec="seconds"),
                "hostnames": stack["hostnames"],
                "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
                "slurm_restart_count": os.environ.get("SLURM_RESTART_COUNT"),
            })
        return attempts

    def _write_manifest(self, ref: RunRef, trainer: Trainer) -> None:
        stack = manifest.gather_stack(self.ctx)
        if self.ctx.rank != 0:
            return
        arm_policy = self.cfg.arms[ref.arm]
        with policy.active(arm_policy):
            applied = policy.applied_state(self.cfg.cluster.device)
        config = OmegaConf.to_container(OmegaConf.structured(self.cfg), resolve=True, enum_to_str=True)
        write_manifest(
            self.root / ref.name,
            {
                "experiment": self.root.name,
                "run": ref.name,
                "arm": ref.arm,
                "replica": ref.replica,
                "config": config,
                "policy": OmegaConf.to_container(OmegaConf.structured(arm_policy)),
                "policy_applied": applied,
                # Rank 0's view (world, dp/tp/ep sizes, mesh); fingerprints stay per rank in steps.rank<R>.jsonl.
                "layout": {
                    **trainer.parallel.layout.manifest(),
                    "backend": self.ctx.backend,
                    "grad_accum": trainer.grad_accum,
                    **trainer.pipeline_manifest(),
                },
                "stack": stack,
                "attempts": self._attempts(ref, stack),
                "provenance": provenance.manifest_provenance(config),
            },
        )

    def run(self) -> None:
        """Run the schedule. Restarted after a preemption, it skips finished runs and resumes unfinished ones from
        their newest complete checkpoint that is intact on every rank (records written past it are dropped, so
        nothing is duplicated)."""
        self._run_timed_pair()
        self._run_whole(REPEAT)
        self._run_resumed()
        self._run_whole(BASELINE_REPEAT)

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
        if self.on_step is not None:
            for _ in range(steps):
                self.on_step()

    def _checkpoint_due(self, step: int) -> bool:
        exp = self.cfg.experiment
        every = exp.checkpoint_every_blocks * exp.block_steps
        return every > 0 and step < exp.steps and step % every == 0

    def _run_timed_pair(self) -> None:
        exp = self.cfg.experiment
        progress = {arm: self._checkpoints(ref) for arm, ref in TIMED.items()}
        if all(p.finished for p in progress.values()):
            self._skip(2 * exp.steps)
            return
        # Both arms resume from the same block boundary, so every round still holds one block of each arm.
        start = resume_step(list(progress.values()))
        timed = {arm: self._start(ref, start) for arm, ref in TIMED.items()}
        self._skip(2 * (start or 0))
        first_block = (start or 0) // exp.block_steps
        for block, order in enumerate(arm_order(exp.order_seed, exp.steps // exp.block_steps)):
            if block < first_block:
                continue
            for arm in order:
                timed[arm].run_block(exp.block_steps, block, self.on_step)
            step = (block + 1) * exp.block_steps
            if self._checkpoint_due(step):
                commit(step, [(progress[arm], timed[arm]) for arm in ARM_NAMES])
        for trainer in timed.values():
            trainer.close()
        finish(list(progress.values()))

    def _advance(self, ref: RunRef, trainer: Trainer, until: int) -> None:
        exp = self.cfg.experiment
        checkpoints = self._checkpoints(ref)
        while trainer.step < until:
            n = min(exp.block_steps - trainer.step % exp.block_steps, until - trainer.step)
            trainer.run_block(n, trainer.step // exp.block_steps, self.on_step)
            if self._checkpoint_due(trainer.step):
                commit(trainer.step, [(checkpoints, trainer)])

    def _run_whole(self, ref: RunRef) -> None:
        exp = self.cfg.experiment
        checkpoints = self._checkpoints(ref)
        if checkpoints.finished:
            self._skip(exp.steps)
            return
        start = resume_step([checkpoints])
        trainer = self._start(ref, start)
        self._skip(start or 0)
        self._advance(ref, trainer, exp.steps)
        trainer.close()
        finish([checkpoints])

    def _run_resumed(self) -> None:
        exp = self.cfg.experiment
        checkpoints = self._checkpoints(RESUMED)
        if checkpoints.finished:
            self._skip(exp.steps)
            return
        start = resume_step([checkpoints])
        self._skip(start or 0)
        if start is None or start < exp.resume_step:
            first = self._start(RESUMED, start)
            self._advance(RESUMED, first, exp.resume_step)
            if not self._checkpoint_due(exp.resume_step):  # else _advance has just committed it
                commit(exp.resume_step, [(checkpoints, first)])
            first.close()
            del first
            start = exp.resume_step
        # The restart-replay gate: a fresh trainer continues from the checkpoint.
        resumed = self._start(RESUMED, start)
        self._advance(RESUMED, resumed, exp.steps)
        resumed.close()
        finish([checkpoints])
