"""`taxbench run cluster=slurm -- COMMAND`: the whole schedule of runs inside one Slurm allocation.

One job holds the allocation that cfg.cluster's ranks would (nodes, GPUs, partition, time limit, setup lines: the
Slurm launcher's `make_executor`, as for recipe runs). Its batch step runs one driver process on the allocation's
first node, and the driver runs the same CommandRunner schedule as a local `taxbench run`: each run's command is
started from there unchanged, so a command that is `srun ...` gets the allocation's tasks and a torchrun or deepspeed
launcher runs on that node. Runs land in the same experiment folder, and their manifests record the job (the
`attempts` of taxbench.rundir.manifest read SLURM_JOB_ID in the driver), as recipe runs on Slurm do.

The submitting process waits, prints the driver's progress, and analyses the folder as a local run does. A run that
failed, or left no evidence, comes back from the driver as the same error a local run raises (exit 1 with the command
that continues, exit 4); the job's own end without a result (cancelled, past its time limit) is SlurmJobFailed.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from taxbench.config.schema import TaxbenchConfig
from taxbench.launchers import slurm
from taxbench.launchers.command import CommandFailed, CommandRunner, NoEvidence, continue_run
from taxbench.rundir.read import RecordError

# What the driver hands back instead of raising: the errors a local `taxbench run` reports with their exit code.
REPORTED_ERRORS = (CommandFailed, NoEvidence, RecordError)


@dataclass(frozen=True)
class ScheduleDriver:
    """The job's one process: the schedule of runs. Pickled into the submitit folder with the job's config."""

    cfg: TaxbenchConfig
    root: str
    overrides: tuple[str, ...]
    program: str  # sys.argv[0] of the submitting `taxbench run`

    def __call__(self) -> Exception | None:
        # This process stands in for the submitting `taxbench run`: the continue command a failed run prints names
        # that program (taxbench.launchers.local.continue_command reads sys.argv[0]), not submitit's entry point.
        sys.argv[0] = self.program
        try:
            CommandRunner(self.cfg, Path(self.root), self.overrides).run_all()
        except REPORTED_ERRORS as exc:
            return exc
        return None


def run_in_allocation(cfg: TaxbenchConfig, root: Path, overrides: Sequence[str]) -> None:
    """Submit the schedule as one Slurm job and wait for it; raises what the schedule raised (CommandFailed,
    NoEvidence, RecordError), or SlurmJobFailed where the job ended without finishing it."""
    driver = ScheduleDriver(slurm.job_config(cfg), str(root), tuple(overrides), sys.argv[0])
    try:
        failure = slurm.launch_driver(cfg, root, driver)
    except slurm.SlurmJobFailed as exc:
        raise slurm.SlurmJobFailed(f"{exc}; runs that ended well are kept: continue with: "
                                   f"{continue_run(cfg, overrides)}") from exc
    if failure is not None:
        raise failure
