"""What a launch leaves behind, as a value, and the one step that turns it into a verdict.

Every way of launching (local, in-process, torchrun's rank 0, Slurm, `taxbench layouts`) ends in an outcome:
- `Launched`: every rank has finished; the experiment folder holds the records to analyse;
- `Queued`: submitted to Slurm without waiting (the points of a multirun are queued all at once); it becomes
  `Launched` once its job has ended. The point hands it to Hydra as its job's return value, where the multirun
  callback (taxbench.launchers.multirun) collects it and publishes it at the sweep's end;
- `DryRun`: nothing ran (cluster.dry_run=true: the job script was written); there is nothing to analyse.

`publish_launch` is the one publish step after a launch: it analyses the experiment folder, writes the report and the
wandb run per the config's `report` settings and prints the summary (taxbench.analysis.publish), for every launcher
alike.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from taxbench import exit_codes
from taxbench.analysis.publish import report
from taxbench.config.schema import ReportConfig


class LaunchFailed(RuntimeError):
    """A queued launch ended without results; the message names its logs."""


@dataclass(frozen=True)
class Launched:
    root: Path  # the experiment folder, every rank's records complete
    settings: ReportConfig  # how its analysis is published (the config's `report`)


@dataclass(frozen=True)
class Queued:
    launched: Launched  # what the job leaves once it has ended
    job: Any  # the Slurm job (a submitit.Job; submitit is imported by the Slurm launcher only)
    wait: Callable[[], object]  # blocks until the job (requeues included) has ended; LaunchFailed without results

    def finish(self) -> Launched:
        print(f"taxbench: waiting for Slurm job {self.job.job_id} ({self.launched.root})", flush=True)
        self.wait()
        return self.launched


@dataclass(frozen=True)
class DryRun:
    root: Path
    script: Path  # the sbatch script a submission would hand to Slurm


Outcome = Launched | Queued | DryRun


def publish_launch(outcome: Outcome, group: str | None = None) -> int:
    """Analyse and report what a launch left (a queued one once its job has ended: LaunchFailed when it left no
    results); its exit code (taxbench.exit_codes), OK for a dry run. `group`: the wandb group (a multirun's sweep
    folder name)."""
    if isinstance(outcome, DryRun):
        return exit_codes.OK
    launched = outcome.finish() if isinstance(outcome, Queued) else outcome
    return report(launched.root, launched.settings, group=group)
