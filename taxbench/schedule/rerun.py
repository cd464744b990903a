"""One whole run of the deterministic arm: what `taxbench verify` reruns to check it against a stored reference.

The run is the experiment's deterministic-0 (same trainer, manifest and step records, checkpointed as the experiment
would, so a preempted Slurm job resumes), with none of the experiment's other runs: verifying costs one run.
"""

from __future__ import annotations

from taxbench.design import TIMED
from taxbench.schedule.experiment import Experiment

RERUN = TIMED["deterministic"]


class Rerun(Experiment):
    def run(self) -> None:
        self._run_whole(RERUN, self.cfg.experiment.steps)
