"""End of a Hydra multirun: wait for sweep points queued on Slurm, then print the sweep table (tax vs GPU count).

Registered in conf/config.yaml under `hydra.callbacks`, so it runs for every multirun, local or Slurm. Each point
lands in `<out_dir>/<experiment.name>/point<N>/` (taxbench.cli.experiment_root); the sweep folder is their parent.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn
from hydra.experimental.callback import Callback
from omegaconf import DictConfig


class MultirunReport(Callback):
    def __init__(self) -> None:
        self.sweep_roots: list[Path] = []

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        # job_return.cfg is the config the point ran with (experiment.name already resolved there).
        experiment = job_return.cfg.experiment if job_return.cfg is not None else config.experiment
        root = Path(experiment.out_dir) / experiment.name
        if root not in self.sweep_roots:
            self.sweep_roots.append(root)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from taxbench.cli import report

        for root in wait_for_queued_points():
            try:
                report(root)
            except Exception as exc:  # one broken point must not hide the rest of the sweep
                print(f"taxbench: {root}: not analysed: {exc}", file=sys.stderr)
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
            print(f"taxbench: {exc}", file=sys.stderr)
            continue
        finished.append(root)
    return finished


def print_sweep(root: Path) -> None:
    from taxbench.analysis.records import RecordError
    from taxbench.analysis.sweep import analyse_sweep, render_sweep

    try:
        sweep = analyse_sweep(root)
    except RecordError as exc:
        print(f"taxbench: no sweep table: {exc}", file=sys.stderr)
        return
    render_sweep(sweep)
