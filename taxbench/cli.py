"""Command line: `python -m taxbench [hydra overrides]` runs an experiment; subcommands work on results.

    python -m taxbench                              # embedded default: dense_tiny, 2 gloo ranks on CPU
    python -m taxbench +recipe=moe_tiny cluster.threads_per_rank=2
    python -m taxbench +recipe=moe_1t cluster.gpus=2432 plan=true
    python -m taxbench analyse runs/<experiment>    # re-analyse and print the summary
    python -m taxbench report runs/<experiment or sweep> [--wandb]
    python -m taxbench diff RUN_A RUN_B             # tracing ladder: first origin per rank
    python -m taxbench localize RUN_A RUN_B         # replay deeper rungs until an op is named
    python -m taxbench build-shards corpus.txt shards/
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from taxbench.config import ConfigError, Launcher, ReportConfig, TaxbenchConfig, register_configs, to_typed, validate
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
    from taxbench.policy import validate_policy

    for arm_policy in cfg.arms.values():
        validate_policy(arm_policy, cfg.cluster.device)
    return cfg, container


def experiment_root(cfg: TaxbenchConfig) -> Path:
    root = Path(cfg.experiment.out_dir) / cfg.experiment.name
    if _is_multirun():  # the points of a sweep share experiment.name: each gets its own folder under it
        from hydra.core.hydra_config import HydraConfig

        root = root / f"point{HydraConfig.get().job.num}"
    if (root / "deterministic-0").exists():
        if not cfg.experiment.continue_existing:
            raise ConfigError(
                f"{root} already holds results; pick another experiment.name (or out_dir) instead of overwriting "
                "them, or continue an interrupted experiment with experiment.continue_existing=true"
            )
        _require_same_config(root, cfg)
    return root


# Settings that may change when an interrupted experiment is continued: they do not affect what the runs compute.
CONTINUE_MAY_CHANGE = ("experiment.continue_existing", "report.")


def _require_same_config(root: Path, cfg: TaxbenchConfig) -> None:
    from taxbench.analysis.records import RecordError, load_manifest
    from taxbench.pairing import differences
    from taxbench.records import TIMED
    from taxbench.redaction import redact

    try:
        stored = load_manifest(root / TIMED["deterministic"].name)["config"]
    except RecordError as exc:
        raise ConfigError(f"cannot continue {root}: {exc}; start a new experiment.name") from exc

    # The stored config went through redaction; compare like with like.
    current = redact(OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True, enum_to_str=True))
    changed = [d for d in differences(stored, current) if not d[0].startswith(CONTINUE_MAY_CHANGE)]
    if changed:
        lines = "\n".join(f"  {key}: was {a!r}, now {b!r}" for key, a, b in changed)
        raise ConfigError(
            f"experiment.continue_existing=true needs the config {root} was started with; changed:\n{lines}"
        )


def launch(cfg: TaxbenchConfig, container: dict[str, Any], root: Path) -> bool:
    """Run the experiment; False when it was only queued (Slurm points of a multirun: the sweep report waits)."""
    from taxbench.launchers.local import launch_inprocess, launch_local

    if cfg.cluster.launcher is Launcher.local:
        launch_local(cfg, container, root)
    elif cfg.cluster.launcher is Launcher.inprocess:
        launch_inprocess(cfg, container, root)
    elif cfg.cluster.launcher is Launcher.slurm:
        try:
            from taxbench.launchers.slurm import launch_slurm
        except ImportError as exc:
            fail(f"cluster=slurm needs submitit ({exc}); install it with: pip install 'taxbench[slurm]'")
        try:
            return launch_slurm(cfg, container, root, block=not _is_multirun())
        except ConfigError as exc:
            fail(str(exc))
    else:
        raise ConfigError(f"cluster.launcher={cfg.cluster.launcher.value!r} is not available in this version")
    return True


def report(
    root: Path, settings: ReportConfig | None = None, group: str | None = None, strict_wandb: bool = False
) -> int:
    """Analyse an experiment (or a sweep folder), write its report and wandb run per settings, print the summary."""
    from taxbench.analysis.publish import publish

    settings = settings or ReportConfig(html=False, wandb=False)
    published = publish(root, settings, group=group, strict_wandb=strict_wandb)
    return 0 if published.deterministic_ok else EXIT_NOT_DETERMINISTIC


def run_plan(raw: DictConfig) -> int:
    """plan=true: print the meta-device plan for cluster.gpus GPUs and exit; launches nothing, needs no GPU."""
    from taxbench.plan import make_plan, render_plan

    try:
        plan = make_plan(to_typed(OmegaConf.to_container(raw, resolve=True)))  # type: ignore[arg-type]
    except ConfigError as exc:
        fail(str(exc))
    print(render_plan(plan))
    if not plan.valid:
        fail(f"the parallel layout of recipe {plan.recipe} does not fit cluster.gpus={plan.gpus} (see above)")
    return 0


def run_experiment(raw: DictConfig) -> int:
    if raw.get("plan", False):
        return run_plan(raw)
    try:
        cfg, container = prepare(raw)
        root = experiment_root(cfg)
    except ConfigError as exc:
        fail(str(exc))
    root.mkdir(parents=True, exist_ok=True)
    if not launch(cfg, container, root):
        return 0
    return report(root, cfg.report, group=root.parent.name if _is_multirun() else None)


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


def _analyse(args: argparse.Namespace) -> int:
    return report(args.root)


def _report(args: argparse.Namespace) -> int:
    from taxbench.analysis.wandb_log import WandbUnavailable

    settings = ReportConfig(html=True, wandb=args.wandb, wandb_project=args.wandb_project,
                            wandb_group=args.wandb_group)
    try:
        return report(args.root, settings, strict_wandb=True)
    except WandbUnavailable as exc:
        fail(str(exc))
    return EXIT_CONFIG_ERROR


def _build_shards(args: argparse.Namespace) -> int:
    from taxbench.datasets.build import build_shards_command

    return build_shards_command(args.text_file, args.out_dir, args.tokens_per_shard, args.dtype)


def _tracing(args: argparse.Namespace) -> int:
    from taxbench.tracing.commands import run_tracing_command

    return run_tracing_command(args)


def _input_errors() -> tuple[type[Exception], ...]:
    """Exceptions that mean bad input to a subcommand: reported as `taxbench: error: ...`, never as a traceback."""
    from taxbench.analysis.records import RecordError
    from taxbench.datasets.shards import ShardError
    from taxbench.tracing.commands import input_errors

    return (RecordError, ShardError, FileNotFoundError, *input_errors())


def _parser() -> argparse.ArgumentParser:
    from taxbench.tracing.commands import add_tracing_parsers

    parser = argparse.ArgumentParser(prog="taxbench", description="Work on finished taxbench experiments.")
    sub = parser.add_subparsers(dest="command", required=True)
    analyse_cmd = sub.add_parser("analyse", help="re-analyse an experiment directory and print its summary")
    analyse_cmd.add_argument("root", type=Path)
    analyse_cmd.set_defaults(handler=_analyse)
    report_cmd = sub.add_parser("report", help="write report/report.html and report.md for an experiment or sweep")
    report_cmd.add_argument("root", type=Path, help="an experiment directory, or a folder of experiments (sweep)")
    report_cmd.add_argument("--wandb", action="store_true", help="also log to wandb (offline unless WANDB_MODE is set)")
    report_cmd.add_argument("--wandb-project", default=ReportConfig.wandb_project)
    report_cmd.add_argument("--wandb-group", default=None, help="wandb group (default: the sweep folder's name)")
    report_cmd.set_defaults(handler=_report)
    shards_cmd = sub.add_parser("build-shards", help="tokenize a text file (bytes) into a token-shard folder")
    shards_cmd.add_argument("text_file", type=Path)
    shards_cmd.add_argument("out_dir", type=Path)
    shards_cmd.add_argument("--tokens-per-shard", type=int, default=1 << 24)
    shards_cmd.add_argument("--dtype", choices=["uint16", "uint32"], default="uint16")
    shards_cmd.set_defaults(handler=_build_shards)
    add_tracing_parsers(sub)
    for name in ("diff", "localize"):
        sub.choices[name].set_defaults(handler=_tracing)
    return parser


def subcommand(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        return int(args.handler(args))
    except _input_errors() as exc:
        fail(str(exc))
    return EXIT_CONFIG_ERROR


SUBCOMMANDS = {"analyse", "report", "build-shards", "diff", "localize"}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in SUBCOMMANDS:
        raise SystemExit(subcommand(sys.argv[1:]))
    hydra_entry()
