"""Hydra multirun: name each point's overrides as it starts; at the end wait for points queued on Slurm, then print
the sweep table (tax vs GPU count).

A point queued on Slurm returns its `Queued` outcome to Hydra as its job's return value
(taxbench.commands.experiment.hydra_entry); Hydra's launcher runs the point and this callback in one process and hands
that value to `on_job_end`, which keeps it until the sweep's end.

Registered in conf/config.yaml under `hydra.callbacks`, so it runs for every multirun, local or Slurm. Each point
lands in `<out_dir>/<experiment.name>/point<N>/` (taxbench.rundir.experiment_folder.experiment_root); the sweep folder
is their parent.
It also keeps Hydra's copy of the sweep config (`<sweep folder>/multirun.yaml`) free of secrets.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from taxbench.analysis.console import render_sweep
from taxbench.analysis.sweep import analyse_sweep
from taxbench.diagnostics import logger
from taxbench.launchers.outcome import LaunchFailed, Queued, publish_launch
from taxbench.redaction import redact
from taxbench.rundir.experiment_folder import mark_sweep
from taxbench.rundir.provenance import hydra_overrides
from taxbench.rundir.read import RecordError

log = logger(__name__)
MULTIRUN_YAML = "multirun.yaml"


class MultirunReport(Callback):
    def __init__(self) -> None:
        self.sweep_roots: list[Path] = []
        self.queued: list[Queued] = []  # points submitted to Slurm without waiting, in submission order
        self.sweep_config: tuple[Path, dict[str, Any]] | None = None  # Hydra's copy, written at the first job

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        # Right after this hook Hydra's sweeper saves the whole config, command-line overrides (cluster.setup lines)
        # included, to <sweep folder>/multirun.yaml; there is no hook in between. The name points at /dev/null while
        # it does, so the clear copy never reaches the disk; the first job start puts a redacted copy in its place.
        path = Path(config.hydra.sweep.dir) / MULTIRUN_YAML
        mark_sweep(path.parent)  # the sweep folder is this multirun's: `taxbench report` may analyse it as a whole
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)
        path.symlink_to(os.devnull)
        self.sweep_config = path, redact(OmegaConf.to_container(config, resolve=False))

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if config.hydra.mode == RunMode.MULTIRUN:
            # Which point runs which overrides, redacted (Hydra's own "#0 : ..." line would show secrets).
            print(f"point{config.hydra.job.num}: {' '.join(hydra_overrides())}", flush=True)
        if self.sweep_config is None:
            return
        path, redacted = self.sweep_config
        self.sweep_config = None
        partial = path.with_name(f".{path.name}.tmp")
        OmegaConf.save(OmegaConf.create(redacted), partial)
        partial.replace(path)

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        # job_return.cfg is the config the point ran with (experiment.name already resolved there).
        experiment = job_return.cfg.experiment if job_return.cfg is not None else config.experiment
        root = Path(experiment.out_dir) / experiment.name
        if root not in self.sweep_roots:
            self.sweep_roots.append(root)
        if job_return.status is JobStatus.COMPLETED and isinstance(job_return.return_value, Queued):
            self.queued.append(job_return.return_value)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        while self.queued:
            publish_queued(self.queued.pop(0))
        if config.cluster.get("dry_run", False):
            return  # nothing ran: each point printed its job and wrote its script
        for root in self.sweep_roots:
            print_sweep(root)


def publish_queued(queued: Queued) -> None:
    """Wait for a point queued on Slurm, then publish it as a point that ran in this process is; a failed job or a
    broken point is reported and the sweep goes on."""
    root = queued.launched.root
    try:
        publish_launch(queued, group=root.parent.name)
    except LaunchFailed as exc:
        log.error("%s", exc)
    except Exception as exc:  # one broken point must not hide the rest of the sweep
        log.error("%s: not analysed: %s", root, exc)


def print_sweep(root: Path) -> None:
    try:
        sweep = analyse_sweep(root)
    except RecordError as exc:
        log.warning("no sweep table: %s", exc)
        return
    render_sweep(sweep)
