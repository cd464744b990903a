"""Start an experiment on the launcher its config names: a recipe experiment's ranks, verify's reruns, and the
schedule of `taxbench run -- COMMAND`."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from taxbench.commands.hydra_job import is_multirun
from taxbench.commands.input_errors import fail
from taxbench.config.schema import ConfigError, Launcher, TaxbenchConfig
from taxbench.launchers.local import RankMain, launch_inprocess, launch_local
from taxbench.launchers.outcome import DryRun, Launched, Outcome
from taxbench.launchers.worker import run_rank


def launch(cfg: TaxbenchConfig, root: Path, rank_main: RankMain | None = None) -> Outcome:
    """Run the experiment (or what `rank_main` runs on every rank: taxbench verify's rerun); what it left
    (taxbench.launchers.outcome): Launched once every rank has finished, Queued for a Slurm point of a multirun (the
    sweep's end waits for it), DryRun for a Slurm dry run (cluster.dry_run=true: the job script is written, nothing
    submitted)."""
    rank_main = rank_main or run_rank
    if cfg.cluster.launcher is Launcher.local:
        launch_local(cfg, root, rank_main)
    elif cfg.cluster.launcher is Launcher.inprocess:
        launch_inprocess(cfg, root, rank_main)
    elif cfg.cluster.launcher is Launcher.slurm:
        slurm = _slurm_launcher()
        try:
            if cfg.cluster.dry_run:
                return DryRun(root, slurm.dry_run_slurm(cfg, root))
            return slurm.launch_slurm(cfg, root, block=not is_multirun(), rank_main=rank_main)
        except ConfigError as exc:
            fail(str(exc))
    else:
        raise ConfigError(f"cluster.launcher={cfg.cluster.launcher.value!r} is not available in this version")
    return Launched(root, cfg.report)


def launch_slurm_batch(runs: list[tuple[TaxbenchConfig, Path]], rank_main: RankMain) -> dict[int, str]:
    """The runs as one Slurm job array; the tasks that ended without results, by index, with their logs."""
    return _slurm_launcher().launch_slurm_batch(runs, rank_main)


def check_command_launcher(cfg: TaxbenchConfig) -> None:
    """Before the experiment folder exists: a launcher that can run `taxbench run`'s schedule, and for cluster=slurm a
    Slurm to submit to (the recipe runs' preflight). ConfigError in one line otherwise."""
    launcher = cfg.cluster.launcher
    if launcher not in (Launcher.local, Launcher.slurm):
        raise ConfigError(f"taxbench run starts the command from this machine (cluster=local) or from one Slurm "
                          f"allocation (cluster=slurm); cluster={cfg.cluster.name} starts ranks, not a command: "
                          "under torchrun or srun, put that launcher after `--` instead")
    if cfg.cluster.dry_run:
        raise ConfigError("cluster.dry_run=true is for recipe runs; taxbench run submits its job (drop "
                          "cluster.dry_run, or run a recipe's dry run for the job script)")
    if launcher is Launcher.slurm:
        _slurm_launcher().preflight(cfg)


def launch_command(cfg: TaxbenchConfig, root: Path, overrides: Sequence[str]) -> Launched:
    """`taxbench run`'s whole schedule of runs where the config says: on this machine (cluster=local), or as one
    driver inside one Slurm allocation (cluster=slurm, taxbench.launchers.command_slurm). Raises what the schedule
    raises (taxbench.launchers.command), or LaunchFailed where the Slurm job ended without finishing it."""
    if cfg.cluster.launcher is Launcher.slurm:
        _slurm_launcher()
        from taxbench.launchers.command_slurm import run_in_allocation

        run_in_allocation(cfg, root, overrides)
    else:
        from taxbench.launchers.command import CommandRunner

        CommandRunner(cfg, root, overrides).run_all()
    return Launched(root, cfg.report)


def _slurm_launcher() -> ModuleType:
    """taxbench.launchers.slurm, or one line naming the extra to install: submitit is optional (taxbench[slurm])."""
    try:
        from taxbench.launchers import slurm
    except ImportError as exc:
        fail(f"cluster=slurm needs submitit ({exc}); install it with: pip install 'taxbench[slurm]'")
    return slurm
