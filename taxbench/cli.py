"""Command line: `python -m taxbench [hydra overrides]` runs an experiment; subcommands work on results.

    python -m taxbench                          # embedded default: dense_tiny, 2 gloo ranks on CPU
    python -m taxbench +recipe=moe_tiny experiment.steps=120
    python -m taxbench analyse runs/<experiment>  # re-analyse a finished experiment
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from taxbench.config import ConfigError, Launcher, TaxbenchConfig, register_configs, to_typed, validate
from taxbench.pairing import validate_pair

EXIT_CONFIG_ERROR = 2
EXIT_NOT_DETERMINISTIC = 3


def fail(message: str, code: int = EXIT_CONFIG_ERROR) -> None:
    print(f"taxbench: error: {message}", file=sys.stderr)
    raise SystemExit(code)


def prepare(raw: DictConfig) -> tuple[TaxbenchConfig, dict[str, Any]]:
    """Typed, validated config plus its plain container (what gets shipped to ranks)."""
    container = OmegaConf.to_container(raw, resolve=True)
    assert isinstance(container, dict)
    cfg = to_typed(container)
    validate(cfg)
    validate_pair(cfg)
    return cfg, container


def experiment_root(cfg: TaxbenchConfig) -> Path:
    root = Path(cfg.experiment.out_dir) / cfg.experiment.name
    if (root / "deterministic-0").exists():
        raise ConfigError(
            f"{root} already holds results; pick another experiment.name (or out_dir) instead of overwriting them"
        )
    return root


def launch(cfg: TaxbenchConfig, container: dict[str, Any], root: Path) -> None:
    from taxbench.launchers.local import launch_inprocess, launch_local

    if cfg.cluster.launcher is Launcher.local:
        launch_local(cfg, container, root)
    elif cfg.cluster.launcher is Launcher.inprocess:
        launch_inprocess(cfg, container, root)
    else:
        raise ConfigError(f"cluster.launcher={cfg.cluster.launcher.value!r} is not available in this version")


def report(root: Path) -> int:
    from taxbench.analysis.summary import analyse, render

    summary = analyse(root)
    render(summary)
    return 0 if summary.deterministic_ok else EXIT_NOT_DETERMINISTIC


def run_experiment(raw: DictConfig) -> int:
    try:
        cfg, container = prepare(raw)
        root = experiment_root(cfg)
    except ConfigError as exc:
        fail(str(exc))
    root.mkdir(parents=True, exist_ok=True)
    launch(cfg, container, root)
    return report(root)


register_configs()


@hydra.main(version_base="1.3", config_path="pkg://taxbench.conf", config_name="config")
def hydra_entry(raw: DictConfig) -> int:
    code = run_experiment(raw)
    if code and not _is_multirun():
        raise SystemExit(code)
    return code


def _is_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.initialized() and HydraConfig.get().mode.name == "MULTIRUN"


def subcommand(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="taxbench", description="Work on finished taxbench experiments.")
    sub = parser.add_subparsers(dest="command", required=True)
    analyse_cmd = sub.add_parser("analyse", help="re-analyse an experiment directory and print its summary")
    analyse_cmd.add_argument("root", type=Path)
    args = parser.parse_args(argv)
    from taxbench.analysis.records import RecordError

    try:
        return report(args.root)
    except (RecordError, FileNotFoundError) as exc:
        fail(str(exc))
    return 0


SUBCOMMANDS = {"analyse"}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in SUBCOMMANDS:
        raise SystemExit(subcommand(sys.argv[1:]))
    hydra_entry()
