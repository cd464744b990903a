"""Command line: `python -m taxbench [hydra overrides]` runs an experiment; subcommands work on results.

    python -m taxbench                              # embedded default: dense_tiny, 2 gloo ranks on CPU
    python -m taxbench +recipe=moe_tiny cluster.threads_per_rank=2
    python -m taxbench +recipe=moe_1t cluster.gpus=2432 plan=true
    python -m taxbench analyse runs/<experiment>    # re-analyse and print the summary
    python -m taxbench report runs/<experiment or sweep> [--wandb]
    python -m taxbench diff RUN_A RUN_B             # tracing ladder: first origin per rank
    python -m taxbench localize RUN_A RUN_B         # replay deeper rungs until an op is named
    python -m taxbench layouts +recipe=moe_1t_proxy 'layouts=[pp1.dp4, pp2.dp2]'   # cross-layout validation
    python -m taxbench scan +recipe=moe_tiny cluster.threads_per_rank=2   # replay every op of a step
    python -m taxbench build-shards corpus.txt shards/

The command line is the top of the import graph. It imports what a command needs where the command starts, so that
`taxbench analyse`, `--help` and shell completion load neither torch nor a launcher: these are the package's only
function-local imports of taxbench modules (tests/test_layers.py holds every other module to top-level imports).
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import hydra
import yaml
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from taxbench import exit_codes
from taxbench.config.schema import (
    ClusterConfig,
    ConfigError,
    Launcher,
    ReportConfig,
    TaxbenchConfig,
    register_configs,
    to_typed,
    unknown_key_message,
    world_size,
)
from taxbench.diagnostics import logger
from taxbench.rundir.experiment_folder import claimed, experiment_root
from taxbench.rundir.provenance import capture_launch

if TYPE_CHECKING:
    from taxbench.commands.scan import ScanSettings

log = logger(__name__)


def fail(message: str, code: int = exit_codes.CONFIG_ERROR) -> None:
    print(f"taxbench: error: {message}", file=sys.stderr)
    raise SystemExit(code)


def fail_with(exc: Exception) -> None:
    """fail() with the exit code the error carries (taxbench.rundir.read.UnreadableRecords: 4), else 2."""
    fail(str(exc), getattr(exc, "exit_code", exit_codes.CONFIG_ERROR))


def launch(cfg: TaxbenchConfig, root: Path) -> bool:
    """Run the experiment; False when there is nothing to report yet: only queued (Slurm points of a multirun: the
    sweep report waits), or a Slurm dry run (cluster.dry_run=true: the job script is written, nothing submitted)."""
    from taxbench.launchers.local import launch_inprocess, launch_local

    if cfg.cluster.launcher is Launcher.local:
        launch_local(cfg, root)
    elif cfg.cluster.launcher is Launcher.inprocess:
        launch_inprocess(cfg, root)
    elif cfg.cluster.launcher is Launcher.slurm:
        try:
            from taxbench.launchers.slurm import dry_run_slurm, launch_slurm
        except ImportError as exc:
            fail(f"cluster=slurm needs submitit ({exc}); install it with: pip install 'taxbench[slurm]'")
        try:
            if cfg.cluster.dry_run:
                dry_run_slurm(cfg, root)
                return False
            return launch_slurm(cfg, root, block=not _is_multirun())
        except ConfigError as exc:
            fail(str(exc))
    else:
        raise ConfigError(f"cluster.launcher={cfg.cluster.launcher.value!r} is not available in this version")
    return True


def run_plan(raw: DictConfig) -> int:
    """plan=true: print the meta-device plan for cluster.gpus GPUs and exit; launches nothing, needs no GPU."""
    from taxbench.parallel.plan import make_plan, render_plan

    try:
        cfg = to_typed(OmegaConf.to_container(raw, resolve=True))  # type: ignore[arg-type]
        plan = make_plan(cfg)
    except ConfigError as exc:
        fail(str(exc))
    if not _overridden("cluster.gpus") and cfg.cluster.gpus == ClusterConfig.gpus:
        log.warning("plan=true without cluster.gpus: planning for the default %d GPUs; set cluster.gpus=N for your "
                    "cluster", cfg.cluster.gpus)
    print(render_plan(plan))
    if not plan.valid:
        fail(f"the parallel layout of recipe {plan.recipe} does not fit cluster.gpus={plan.gpus} (see above)")
    return 0


def run_experiment(raw: DictConfig) -> int:
    if raw.get("plan", False):
        return run_plan(raw)
    from taxbench.analysis.publish import report
    from taxbench.launchers.local import RankFailed
    from taxbench.preflight import prepare
    from taxbench.rundir.read import RecordError

    try:
        if raw.cluster.launcher == Launcher.torchrun:
            return run_as_started_rank(raw)
        cfg = prepare(raw)
        with claimed(cfg, experiment_root(cfg, _multirun_point())) as root:
            log.debug("experiment folder %s: cluster=%s, %d ranks", root, cfg.cluster.name, world_size(cfg.cluster))
            try:
                capture_launch()
                if not launch(cfg, root):
                    return exit_codes.OK
            except RankFailed as exc:
                fail(str(exc), exit_codes.FAILED)
            return report(root, cfg.report, group=root.parent.name if _is_multirun() else None)
    except (ConfigError, RecordError) as exc:  # RecordError: results that cannot be read back or written
        fail_with(exc)
    return exit_codes.CONFIG_ERROR


def run_as_started_rank(raw: DictConfig) -> int:
    """cluster=torchrun: this process is one rank of a world that torchrun, srun or a PyTorchJob started."""
    from taxbench.launchers.local import RankFailed
    from taxbench.launchers.torchrun import run_started_rank

    if _is_multirun():
        raise ConfigError("cluster=torchrun runs one experiment per launch, but this is a multirun (-m); start one "
                          "torchrun/srun launch per point instead")
    try:
        return run_started_rank(raw)
    except RankFailed as exc:
        fail(str(exc), exit_codes.FAILED)
    return exit_codes.FAILED


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


def _overridden(key: str) -> bool:
    """Whether the command line sets `key` (as key=..., +key=... or ++key=...)."""
    from hydra.core.hydra_config import HydraConfig

    return any(o.lstrip("+~").partition("=")[0] == key for o in HydraConfig.get().overrides.task)


def _multirun_point() -> int | None:
    """The point number of this job in a multirun (its points share experiment.name), else None."""
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.get().job.num if _is_multirun() else None


def _analyse(args: argparse.Namespace) -> int:
    from taxbench.analysis.publish import read_and_report

    return read_and_report(args.root)


def _report(args: argparse.Namespace) -> int:
    from taxbench.analysis.publish import read_and_report
    from taxbench.analysis.wandb_log import WandbUnavailable

    settings = ReportConfig(html=True, wandb=args.wandb, wandb_project=args.wandb_project,
                            wandb_group=args.wandb_group)
    try:
        return read_and_report(args.root, settings, strict_wandb=True)
    except WandbUnavailable as exc:
        fail(str(exc))
    return exit_codes.CONFIG_ERROR


def _build_shards(args: argparse.Namespace) -> int:
    from taxbench.datasets.build import build_shards_command

    return build_shards_command(args.text_file, args.out_dir, args.tokens_per_shard, args.dtype)


def _tracing(args: argparse.Namespace) -> int:
    from taxbench.commands.tracing import run_tracing_command

    return run_tracing_command(args)


def _input_errors() -> tuple[type[Exception], ...]:
    """Exceptions that mean bad input to a subcommand: reported as `taxbench: error: ...`, never as a traceback."""
    from taxbench.commands.tracing import input_errors
    from taxbench.datasets.shards import ShardError
    from taxbench.rundir.read import RecordError

    return (RecordError, ShardError, FileNotFoundError, *input_errors())


def _parser() -> argparse.ArgumentParser:
    from taxbench.commands.tracing import add_tracing_parsers

    parser = argparse.ArgumentParser(prog="taxbench", description="Work on finished taxbench experiments.")
    sub = parser.add_subparsers(dest="command", required=True)
    analyse_cmd = sub.add_parser("analyse", help="re-analyse an experiment directory, print its summary and "
                                 "rewrite summary.json and any report/")
    analyse_cmd.add_argument("root", type=Path)
    analyse_cmd.set_defaults(handler=_analyse)
    report_cmd = sub.add_parser("report", help="write report/report.html and report.md for an experiment or sweep")
    report_cmd.add_argument("root", type=Path, help="an experiment directory, or the sweep folder of a multirun")
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
        fail_with(exc)
    return exit_codes.CONFIG_ERROR


SUBCOMMANDS = ("analyse", "report", "build-shards", "diff", "localize")
# Subcommands that take Hydra overrides like an experiment, plus keys of their own.
LAYOUTS = "layouts"
SCAN = "scan"
HYDRA_SUBCOMMANDS = (LAYOUTS, SCAN)
LAYOUTS_USAGE = """usage: taxbench layouts [hydra overrides] 'layouts=[L1, L2, ...]' [policy=deterministic|baseline]

Runs the recipe under each layout, two runs of one arm's policy per layout (default: the deterministic arm), and
compares them: whether each layout is repeatable on its own, the step-0 and final weights by a layout-invariant digest,
and per step the loss and gradient norm with their distance in float32 ulps. A layout is dot-joined factors:
pp<N>, tp<N>, dp<N>, ep<N>, v<N> (virtual stages), ddp or fsdp; a factor left out is 1, dp follows from the world size
(cluster.cpu_ranks). experiment.steps sets the steps per run (default 8). Exit 0 when every layout is repeatable,
3 when one is not, 4 when evidence is missing, 2 for bad input.

  python -m taxbench layouts +recipe=moe_1t_proxy 'layouts=[pp1.dp4, pp2.dp2, pp2.dp2.ep2, tp2.dp2]'
"""


def _override_key(override: str) -> str:
    return override.lstrip("+~").partition("=")[0]


SCAN_USAGE = """usage: taxbench scan [hydra overrides] [scan.repeats=K] [scan.optimizer_step=false] [scan.out=FILE]

Runs one training step of the recipe under each policy (baseline, deterministic) on one rank in this process, replays
every ATen op K times (default 3) on cloned inputs with the same RNG state, and lists per policy the ops whose outputs
differed (op, module, how many of K, input shapes, dtype) and the ops without a deterministic implementation. Writes
scan.json (default <experiment.out_dir>/scan-<experiment.name>/). Exit 3 when the deterministic policy has such an
op, 0 when it has none, 2 for bad input.

  python -m taxbench scan +recipe=moe_tiny cluster.threads_per_rank=2
"""


def _compose(overrides: list[str]) -> DictConfig:
    """The config an experiment with these overrides would get (Hydra's compose API: no run folder, no logging)."""
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module="taxbench.conf", version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def run_layouts_command(argv: list[str]) -> int:
    """`taxbench layouts`: one recipe under several parallel layouts (taxbench.launchers.layouts)."""
    if any(arg in ("-h", "--help") for arg in argv):
        print(LAYOUTS_USAGE)
        return exit_codes.OK
    from taxbench.analysis.publish import report
    from taxbench.config.layout_names import parse_layout_list
    from taxbench.launchers.layouts import check_arm, layout_configs, repeat_settings, run_layouts
    from taxbench.rundir.read import RecordError

    own = {"layouts": None, "policy": "deterministic"}
    overrides = []
    args = iter(argv)
    for arg in args:
        key, sep, value = arg.partition("=")
        if sep and key in own:
            # `layouts=[a, b]` unquoted reaches us as "layouts=[a," and "b]": join the list's words again
            while key == "layouts" and value.startswith("[") and "]" not in value:
                value += " " + next(args, "]")
            own[key] = value
        else:
            overrides.append(arg)
    if own["layouts"] is None:
        fail("taxbench layouts needs the layouts to compare, e.g. 'layouts=[pp1.dp4, pp2.dp2]' (see taxbench "
             "layouts --help)")
    policy = str(own["policy"])
    given = {_override_key(o) for o in overrides}
    with _one_line_input_errors(RecordError):
        layouts = parse_layout_list(str(own["layouts"]))
        cfg = to_typed(OmegaConf.to_container(_compose(overrides), resolve=True))  # type: ignore[arg-type]
        if cfg.cluster.launcher is not Launcher.local:
            raise ConfigError(f"taxbench layouts launches the layouts on this machine; cluster={cfg.cluster.name} "
                              "is not supported yet, use cluster=local")
        check_arm(cfg, policy)
        cfg = repeat_settings(cfg, cfg.experiment.steps if "experiment.steps" in given else None)
        if "experiment.name" not in given:
            cfg.experiment.name = f"layouts-{cfg.experiment.name}"
        configs = layout_configs(cfg, layouts)
        with claimed(cfg, experiment_root(cfg)) as root:
            capture_launch()
            run_layouts(configs, policy, root)
            return report(root, cfg.report)
    return exit_codes.CONFIG_ERROR


def _scan_settings(own: dict[str, str]) -> ScanSettings:
    from taxbench.commands.scan import DEFAULT_REPEATS, ScanSettings

    try:
        repeats = int(own.get("scan.repeats", DEFAULT_REPEATS))
    except ValueError:
        raise ConfigError(f"scan.repeats={own['scan.repeats']!r} is not an integer") from None
    step = own.get("scan.optimizer_step", "true").lower()
    if step not in ("true", "false"):
        raise ConfigError(f"scan.optimizer_step={own['scan.optimizer_step']!r}; use true or false")
    out = own.get("scan.out")
    return ScanSettings(repeats, step == "true", Path(out) if out else None)


def run_scan_command(argv: list[str]) -> int:
    """`taxbench scan`: one step per policy with every op replayed (taxbench.commands.scan)."""
    if any(arg in ("-h", "--help") for arg in argv):
        return _print_to_a_pipe(SCAN_USAGE, exit_codes.OK)
    from taxbench.commands.scan import check_scan, exit_code, render, run_scan
    from taxbench.preflight import check_before_launch

    own = {}
    overrides = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep and key.startswith("scan."):
            if key not in ("scan.repeats", "scan.optimizer_step", "scan.out"):
                fail(f"unknown scan setting {key!r}; scan takes scan.repeats, scan.optimizer_step and scan.out")
            own[key] = value
        else:
            overrides.append(arg)
    with _one_line_input_errors():
        settings = _scan_settings(own)
        cfg = to_typed(OmegaConf.to_container(_compose(overrides), resolve=True))  # type: ignore[arg-type]
        check_scan(cfg, settings)
        check_before_launch(cfg)
        scans, out = run_scan(cfg, settings)
    return _print_to_a_pipe(render(scans, out), exit_code(scans))


def _print_to_a_pipe(text: str, code: int) -> int:
    """Print `text` and return `code`, also when stdout's reader went away (`taxbench scan | head -3`): the verdict
    does not depend on who read it."""
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return code


@contextmanager
def _one_line_input_errors(*more: type[Exception]) -> Iterator[None]:
    """Bad input to a subcommand that composes Hydra overrides (ConfigError, `more`, Hydra's and YAML's errors, a
    missing search path): one line, exit 2."""
    warnings.filterwarnings("error", message=_MISSING_SEARCHPATH, category=UserWarning)
    try:
        yield
    except (ConfigError, *more) as exc:
        fail_with(exc)
    except _HYDRA_INPUT_ERRORS as exc:
        fail(_config_error_line(exc))
    except yaml.YAMLError as exc:
        fail(_yaml_error_line(exc))
    except UserWarning as exc:
        fail(_searchpath_error_line(exc))


# Hydra and OmegaConf raise these for a bad override, an unknown config group option or a wrong type.
_HYDRA_INPUT_ERRORS = (HydraException, OmegaConfBaseException)


# Hydra only warns about a search path that does not exist, then composes without it.
_MISSING_SEARCHPATH = r"provider=hydra\.searchpath .*, path=(?P<path>.*) is not available\.?"
_UNKNOWN_KEY = re.compile(r"Key '[^']*' not in '[^']*'\s+full_key: (?P<key>\S+)")


def _config_error_line(exc: BaseException) -> str:
    """Hydra's multi-line message (and its OmegaConf cause) as one line, without the search-path and key noise."""
    full_text = "\n".join(str(error) for error in (exc, exc.__cause__) if error is not None)
    unknown = _UNKNOWN_KEY.search(full_text)
    if unknown:  # instead of Hydra's "To append to your config use +key=value": a typo is the likelier cause
        where = re.match(r"In '[^']+'", str(exc))
        return (f"{where.group(0)}: " if where else "") + unknown_key_message(unknown.group("key"))
    parts: list[str] = []
    for error in (exc, exc.__cause__):
        options: list[str] | None = None
        for line in (line.strip() for line in str(error or "").splitlines()):
            if not line or line.startswith(("full_key:", "object_type=", "reference_type=", "Set the environment")):
                continue
            if line.startswith("Config search path"):
                break
            if options is not None:
                options.append(line)
            elif line.startswith("Available options in"):
                options = []
                parts.append(line.rstrip(":").lower())
            else:
                parts.append(line.rstrip(".:"))
        if options:
            parts[-1] += ": " + ", ".join(options)
    return "; ".join(dict.fromkeys(parts)) or type(exc).__name__


def _yaml_error_line(exc: yaml.YAMLError) -> str:
    """A YAML syntax error in a config file as one line: the file, where the construct began and what broke it."""
    if not isinstance(exc, yaml.MarkedYAMLError) or exc.problem_mark is None:
        return f"a config file is not valid YAML: {' '.join(str(exc).split())}"
    problem = exc.problem_mark
    context = (f"{exc.context} at line {exc.context_mark.line + 1}, column {exc.context_mark.column + 1}: "
               if exc.context and exc.context_mark else "")
    return (f"{problem.name} is not valid YAML: {context}{exc.problem} at line {problem.line + 1}, column "
            f"{problem.column + 1}; fix the file")


def _searchpath_error_line(warning: UserWarning) -> str:
    path = re.match(_MISSING_SEARCHPATH, str(warning))
    return (f"hydra.searchpath: {path.group('path') if path else warning} is neither an existing folder nor an "
            "importable package; give a folder as file:///absolute/path or a package as pkg://module")


def _unknown_word(argv: list[str]) -> str | None:
    """The first argument that is neither an override (`key=value`, `+key=...`, `~key`) nor an option."""
    if not argv:
        return None
    first = argv[0]
    return None if first.startswith(("-", "+", "~")) or "=" in first else first


def _completion_query(argv: list[str]) -> bool:
    """Whether Hydra is asked for shell completions (`-sc query=bash`: what `eval "$(taxbench -sc install=bash)"`
    installs calls on every <TAB>, with the command line in COMP_LINE)."""
    return len(argv) == 2 and argv[0] in ("-sc", "--shell-completion") and argv[1].startswith("query=")


def _complete_subcommands(comp_line: str) -> bool:
    """Print the subcommands that complete the first argument of COMP_LINE; True when the line is a subcommand's, so
    Hydra's config completion does not apply (the shell then falls back to file names)."""
    words = comp_line.split()[1:]  # drop the program name
    if comp_line[-1:].isspace():
        words.append("")
    if len(words) == 1:
        for name in SUBCOMMANDS + HYDRA_SUBCOMMANDS:
            if name.startswith(words[0]):
                print(name)
    return len(words) > 1 and words[0] in SUBCOMMANDS


def main() -> None:
    argv = sys.argv[1:]
    if _completion_query(argv) and _complete_subcommands(os.environ.get("COMP_LINE", "")):
        return
    if argv and argv[0] in SUBCOMMANDS:
        raise SystemExit(subcommand(argv))
    if argv and argv[0] == LAYOUTS:
        raise SystemExit(run_layouts_command(argv[1:]))
    if argv and argv[0] == SCAN:
        raise SystemExit(run_scan_command(argv[1:]))
    word = _unknown_word(argv)
    if word is not None:
        close = difflib.get_close_matches(word, SUBCOMMANDS + HYDRA_SUBCOMMANDS, n=1)
        hint = f"did you mean `taxbench {close[0]}`? " if close else ""
        fail(f"unknown subcommand or override {word!r}; {hint}subcommands: "
             f"{', '.join(SUBCOMMANDS + HYDRA_SUBCOMMANDS)}; overrides look "
             "like key=value (`python -m taxbench --help`)")
    # Hydra prints its own errors with exit 1; let them reach us instead, so that a config error is one line, exit 2.
    full_errors = os.environ.get("HYDRA_FULL_ERROR") == "1"
    os.environ["HYDRA_FULL_ERROR"] = "1"
    warnings.filterwarnings("error", message=_MISSING_SEARCHPATH, category=UserWarning)
    try:
        hydra_entry()
    except _HYDRA_INPUT_ERRORS as exc:
        if full_errors:
            raise
        fail(_config_error_line(exc))
    except yaml.YAMLError as exc:
        if full_errors:
            raise
        fail(_yaml_error_line(exc))
    except UserWarning as exc:  # only the missing search path is turned into an error (above)
        if full_errors:
            raise
        fail(_searchpath_error_line(exc))
    except BrokenPipeError:  # `python -m taxbench --help | head`: the reader left, nothing to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
