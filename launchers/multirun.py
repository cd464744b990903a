"""Hydra multirun: name each point's overrides as it starts; at the end wait for points queued on Slurm, then print
the sweep table (tax vs GPU count).

Registered in conf/config.yaml under `hydra.callbacks`, so it runs for every multirun, local or Slurm. Each point
lands in `<out_dir>/<experiment.name>/point<N>/` (taxbench.cli.experiment_root); the sweep folder is their parent.
It also keeps Hydra's copy of the sweep config (`<sweep folder>/multirun.yaml`) free of secrets.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from taxbench.analysis.console import render_sweep
from taxbench.analysis.publish import report
from taxbench.analysis.sweep import analyse_sweep
from taxbench.diagnostics import logger
from taxbench.redaction import redact
from taxbench.rundir.experiment_folder import mark_sweep
from taxbench.rundir.provenance import hydra_overrides
from taxbench.rundir.read import RecordError

log = logger(__name__)
MULTIRUN_YAML = "multirun.yaml"


class MultirunReport(Callback):
    def __init__(self) -> None:
        self.sweep_roots: list[Path] = []
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

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        for root in wait_for_queued_points():
            try:
                report(root)
            except Exception as exc:  # one broken point must not hide the rest of the sweep
                log.error("%s: not analysed: %s", root, exc)
        if config.cluster.get("dry_run", False):
            return  # nothing ran: each point printed its job and wrote its script
        for root in self.sweep_roots:
            print_sweep(root)


def wait_for_queued_points() -> list[Path]:
    """Roots of the Slurm points that finished; a failed job is reported and left out."""
    launcher = sys.modules.get("taxbench.launchers.slurm")
    if launcher is None:
        return []
    finished = []
    while launcher.SUBMITTED:
        root, job = launcher.SUBMITTED.pop(0)
        print(f"taxbench: waiting for Slurm job {job.job_id} ({root})", flush=True)
        try:
            launcher.wait(job, root)
        except launcher.SlurmJobFailed as exc:
            log.error("%s", exc)
            continue
        finished.append(root)
    return finished


def print_sweep(root: Path) -> None:
    try:
        sweep = analyse_sweep(root)
    except RecordError as exc:
        log.warning("no sweep table: %s", exc)
        return
    render_sweep(sweep)
