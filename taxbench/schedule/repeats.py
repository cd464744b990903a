"""Two runs of one arm, each whole from step 0, with the layout-invariant digest of their weights at the first and
the last step: what `taxbench layouts` runs under each layout (the experiment's trainers, manifests and records;
only the schedule is its own).

<layout folder>/<arm>-0 and <arm>-1 each hold the usual manifest and step records, and logical_weights.json
(taxbench.parallel.logical_digest): the digests at step 0 and at the last step, which compare across layouts where
the per-rank fingerprints cannot (each rank fingerprints its own shard).
"""

from __future__ import annotations

import json
from pathlib import Path

from taxbench.config.schema import TaxbenchConfig
from taxbench.design import RunRef
from taxbench.parallel.distributed import DistContext
from taxbench.parallel.logical_digest import WeightsDigest, gather_digest
from taxbench.progress import IDLE, StepProgress
from taxbench.rundir.records import SCHEMA_VERSION, WEIGHTS_FORMAT, weights_file, write_text_atomically
from taxbench.schedule.experiment import Experiment
from taxbench.train.trainer import Trainer

REPLICAS = ("0", "1")


def repeat_runs(arm: str) -> tuple[RunRef, ...]:
    return tuple(RunRef(arm, replica) for replica in REPLICAS)


class RepeatedRuns(Experiment):
    """Runs `arm` twice, one run after the other, for experiment.steps steps each."""

    def __init__(self, cfg: TaxbenchConfig, ctx: DistContext, root: Path, arm: str,
                 progress: StepProgress = IDLE) -> None:
        super().__init__(cfg, ctx, root, progress)
        self.runs = repeat_runs(arm)

    def run(self) -> None:
        steps = self.cfg.experiment.steps
        for ref in self.runs:
            self.progress.describe(ref.name)
            trainer = self._start(ref, None)
            digests = {"0": self._digest(trainer)}
            self._write_digests(ref, digests)
            self._advance(ref, trainer, steps, steps)
            digests[str(steps)] = self._digest(trainer)
            self._write_digests(ref, digests)
            trainer.close()

    def _digest(self, trainer: Trainer) -> WeightsDigest | None:
        return gather_digest(trainer.raw_model.parts, self.ctx.rank, self.ctx.world_size)

    def _write_digests(self, ref: RunRef, digests: dict[str, WeightsDigest | None]) -> None:
        if self.ctx.rank != 0:
            return
        record = {"schema_version": SCHEMA_VERSION, "format": WEIGHTS_FORMAT, "run": ref.name,
                  "steps": {step: digest.to_dict() for step, digest in digests.items() if digest is not None}}
        write_text_atomically(weights_file(self.root / ref.name), json.dumps(record, indent=2))
