"""The experiment schedule that every rank runs inside one allocation.

1. Timed pair: baseline-0 and deterministic-0 advance in interleaved blocks, in a seeded random order per round,
   so that drift over the allocation lands on both arms alike.
2. deterministic-1: an independent deterministic run (repeatability gate).
3. deterministic-resumed: runs to experiment.resume_step, checkpoints, is torn down, and a fresh trainer resumes from
   the checkpoint (restart-replay gate).
4. baseline-1: a second baseline run (baseline sanity: shows what determinism buys).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from taxbench import manifest, policy
from taxbench.config import ARM_NAMES, TaxbenchConfig
from taxbench.distributed import DistContext
from taxbench.records import run_name, write_manifest
from taxbench.trainer import Trainer


@dataclass(frozen=True)
class RunRef:
    arm: str
    replica: str

    @property
    def name(self) -> str:
        return run_name(self.arm, self.replica)


TIMED = {arm: RunRef(arm, "0") for arm in ARM_NAMES}
REPEAT = RunRef("deterministic", "1")
RESUMED = RunRef("deterministic", "resumed")
BASELINE_REPEAT = RunRef("baseline", "1")
ALL_RUNS = (TIMED["baseline"], TIMED["deterministic"], REPEAT, RESUMED, BASELINE_REPEAT)


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

    def _trainer(self, ref: RunRef) -> Trainer:
        run_dir = self.root / ref.name
        fault = self.cfg.experiment.fault
        applies = fault.enabled and fault.arm == ref.arm and str(fault.replica) == ref.replica
        trainer = Trainer(self.cfg, ref.arm, ref.replica, self.cfg.arms[ref.arm], self.ctx, run_dir, fault if applies else None)
        self._write_manifest(ref, trainer)
        return trainer

    def _write_manifest(self, ref: RunRef, trainer: Trainer) -> None:
        stack = manifest.gather_stack(self.ctx)
        if self.ctx.rank != 0:
            return
        arm_policy = self.cfg.arms[ref.arm]
        with policy.active(arm_policy):
            applied = policy.applied_state(self.cfg.cluster.device)
        write_manifest(
            self.root / ref.name,
            {
                "experiment": self.root.name,
                "run": ref.name,
                "arm": ref.arm,
                "replica": ref.replica,
                "config": OmegaConf.to_container(OmegaConf.structured(self.cfg), resolve=True),
                "policy": OmegaConf.to_container(OmegaConf.structured(arm_policy)),
                "policy_applied": applied,
                "layout": {
                    "world_size": self.ctx.world_size,
                    "backend": self.ctx.backend,
                    "grad_accum": trainer.grad_accum,
                    "data_parallel": "ddp" if self.ctx.world_size > 1 else "none",
                    "tp": self.cfg.recipe.parallel.tp,
                    "pp": self.cfg.recipe.parallel.pp,
                    "ep": self.cfg.recipe.parallel.ep,
                },
                "stack": stack,
            },
        )

    def run(self) -> None:
        exp = self.cfg.experiment
        rounds = exp.steps // exp.block_steps
        timed = {arm: self._trainer(ref) for arm, ref in TIMED.items()}
        for block, order in enumerate(arm_order(exp.order_seed, rounds)):
            for arm in order:
                timed[arm].run_block(exp.block_steps, block, self.on_step)
        for trainer in timed.values():
            trainer.close()
        del timed

        self._run_whole(REPEAT)
        self._run_resumed()
        self._run_whole(BASELINE_REPEAT)

    def _run_whole(self, ref: RunRef, steps: int | None = None, trainer: Trainer | None = None) -> Trainer:
        exp = self.cfg.experiment
        trainer = trainer or self._trainer(ref)
        remaining = exp.steps - trainer.step if steps is None else steps
        while remaining > 0:
            n = min(exp.block_steps - trainer.step % exp.block_steps, remaining)
            trainer.run_block(n, trainer.step // exp.block_steps, self.on_step)
            remaining -= n
        trainer.close()
        return trainer

    def _run_resumed(self) -> None:
        exp = self.cfg.experiment
        checkpoint = self.root / RESUMED.name / "checkpoints" / f"step{exp.resume_step}.rank{self.ctx.rank}.pt"
        first = self._run_whole(RESUMED, steps=exp.resume_step)
        first.save_checkpoint(checkpoint)
        del first
        resumed = self._trainer(RESUMED)
        resumed.load_checkpoint(checkpoint)
        self._run_whole(RESUMED, trainer=resumed)
