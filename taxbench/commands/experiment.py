"""`python -m taxbench [hydra overrides]`: run an experiment (a baseline/deterministic pair), or print its plan.

Hydra composes the config and calls `hydra_entry`. The launchers, preflight and torch are imported inside
`run_experiment`, once Hydra has handed over a config to run: Hydra's shell completion and its --cfg/--info answer from
this module without them, and a local launch starts its torch-free fork server before these imports, so that the two
overlap (taxbench.launchers.rank_server).
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import TYPE_CHECKING

import hydra
import yaml
from omegaconf import DictConfig

from taxbench import exit_codes
from taxbench.commands.hydra_job import is_multirun, multirun_point, overridden
from taxbench.commands.input_errors import (
    HYDRA_INPUT_ERRORS,
    MISSING_SEARCHPATH,
    config_error_line,
    fail,
    fail_with,
    searchpath_error_line,
    yaml_error_line,
)
from taxbench.config.schema import ClusterConfig, ConfigError, Launcher, load_config, register_configs, world_size
from taxbench.diagnostics import logger
from taxbench.rundir.experiment_folder import claimed, experiment_root
from taxbench.rundir.provenance import capture_launch

if TYPE_CHECKING:
    from taxbench.launchers.outcome import Queued

log = logger(__name__)


def run_plan(raw: DictConfig) -> int:
    """plan=true: print the meta-device plan for cluster.gpus GPUs and exit; launches nothing, needs no GPU."""
    from taxbench.parallel.plan import make_plan, render_plan

    try:
        cfg = load_config(raw)
        plan = make_plan(cfg)
    except ConfigError as exc:
        fail(str(exc))
    if not overridden("cluster.gpus") and cfg.cluster.gpus == ClusterConfig.gpus:
        log.warning("plan=true without cluster.gpus: planning for the default %d GPUs; set cluster.gpus=N for your "
                    "cluster", cfg.cluster.gpus)
    print(render_plan(plan))
    if not plan.valid:
        fail(f"the parallel layout of recipe {plan.recipe} does not fit cluster.gpus={plan.gpus} (see above)")
    return 0


def run_experiment(raw: DictConfig) -> int | Queued:
    """The experiment's exit code; for a Slurm point of a multirun, queued without waiting, its Queued outcome (the
    multirun's end publishes it, taxbench.launchers.multirun)."""
    if raw.get("plan", False):
        return run_plan(raw)
    if raw.cluster.launcher == Launcher.local:  # its imports overlap this process's from here on
        from taxbench.launchers.rank_server import start_rank_server
        start_rank_server()
    from taxbench.commands.launch import launch
    from taxbench.launchers.local import RankFailed
    from taxbench.launchers.outcome import Launched, LaunchFailed, Queued, publish_launch
    from taxbench.preflight import prepare, stack_native_audits
    from taxbench.rundir.read import RecordError

    try:
        if raw.cluster.launcher == Launcher.torchrun:
            return run_as_started_rank(raw)
        cfg = prepare(raw)
        with claimed(cfg, experiment_root(cfg, multirun_point())) as root:
            log.debug("experiment folder %s: cluster=%s, %d ranks", root, cfg.cluster.name, world_size(cfg.cluster))
            try:
                capture_launch()
                outcome = launch(cfg, root)
                if isinstance(outcome, Queued):
                    return outcome
                code = publish_launch(outcome, group=root.parent.name if is_multirun() else None)
            except (RankFailed, LaunchFailed) as exc:  # a rank died, a Slurm job ended without results
                fail(str(exc), exit_codes.FAILED)
            if isinstance(outcome, Launched):
                print_audits(stack_native_audits(cfg))
            return code
    except (ConfigError, RecordError) as exc:  # RecordError: results that cannot be read back or written
        fail_with(exc)


def print_audits(audits: dict[str, list[str]]) -> None:
    """Beside the verdict: what taxbench's full policy would add or change over each stack-native arm's switch (the
    gates above answered for the switch alone)."""
    for arm, lines in audits.items():
        print(f"audit            {arm} arm is the stack's own switch; taxbench's full policy would add or change:")
        for line in lines or ["nothing (the switch sets everything taxbench's policy does)"]:
            print(f"                 - {line}")


def run_as_started_rank(raw: DictConfig) -> int:
    """cluster=torchrun: this process is one rank of a world that torchrun, srun or a PyTorchJob started."""
    from taxbench.launchers.local import RankFailed
    from taxbench.launchers.torchrun import run_started_rank

    if is_multirun():
        raise ConfigError("cluster=torchrun runs one experiment per launch, but this is a multirun (-m); start one "
                          "torchrun/srun launch per point instead")
    try:
        return run_started_rank(raw)
    except RankFailed as exc:
        fail(str(exc), exit_codes.FAILED)


register_configs()


@hydra.main(version_base="1.3", config_path="pkg://taxbench.conf", config_name="config")
def hydra_entry(raw: DictConfig) -> int | Queued:
    """Hydra's task function. Under a multirun its return value reaches the multirun callback (Hydra's JobReturn): a
    point queued on Slurm hands its Queued outcome over that way."""
    code = run_experiment(raw)
    if isinstance(code, int) and code and not is_multirun():
        raise SystemExit(code)
    return code


def main(argv: list[str]) -> int:
    """Run Hydra on `argv` (its overrides and flags: -m, --cfg, -sc, ...); a config error is one line, exit 2."""
    sys.argv[1:] = argv  # Hydra reads its arguments from sys.argv
    # Hydra prints its own errors with exit 1; let them reach us instead, so that a config error is one line, exit 2.
    full_errors = os.environ.get("HYDRA_FULL_ERROR") == "1"
    os.environ["HYDRA_FULL_ERROR"] = "1"
    warnings.filterwarnings("error", message=MISSING_SEARCHPATH, category=UserWarning)
    try:
        hydra_entry()
    except HYDRA_INPUT_ERRORS as exc:
        if full_errors:
            raise
        fail(config_error_line(exc))
    except yaml.YAMLError as exc:
        if full_errors:
            raise
        fail(yaml_error_line(exc))
    except UserWarning as exc:  # only the missing search path is turned into an error (above)
        if full_errors:
            raise
        fail(searchpath_error_line(exc))
    return exit_codes.OK
