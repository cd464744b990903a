"""Command line: `python -m taxbench [hydra overrides]` runs an experiment; subcommands work on results.

    python -m taxbench                              # embedded default: dense_tiny, 2 gloo ranks on CPU
    python -m taxbench +recipe=moe_tiny cluster.threads_per_rank=2
    python -m taxbench +recipe=moe_1t cluster.gpus=2432 plan=true
    python -m taxbench analyse runs/<experiment>    # re-analyse and print the summary
    python -m taxbench report runs/<experiment or sweep> [--wandb]
    python -m taxbench diff RUN_A RUN_B             # tracing ladder: first origin per rank
    python -m taxbench localize RUN_A RUN_B         # replay deeper rungs until an op is named
    python -m taxbench layouts +recipe=moe_1t_proxy 'layouts=[pp1.dp4, pp2.dp2]'   # cross-layout validation
    python -m taxbench stacks 'stacks=[taxbench, deepspeed]'   # each stack under its own switch and taxbench's
    python -m taxbench scan +recipe=moe_tiny cluster.threads_per_rank=2   # replay every op of a step
    python -m taxbench build-shards corpus.txt shards/

The command line is the top of the import graph. It imports what a command needs where the command starts, so that
`taxbench analyse`, `--help` and shell completion load neither torch nor a launcher: these are the package's only
function-local imports of taxbench modules (tests/test_layers.py holds every other module to top-level imports).
"""

from __future__ import annotations

import argparse
import difflib
import itertools
import os
import re
import shlex
import shutil
import sys
import textwrap
import warnings
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import hydra
import yaml
from hydra.errors import HydraException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from taxbench import exit_codes
from taxbench.config.schema import (
    ClusterConfig,
    ConfigError,
    Launcher,
    ReportConfig,
    TaxbenchConfig,
    load_config,
    register_configs,
    unknown_key_message,
    world_size,
)
from taxbench.diagnostics import logger
from taxbench.rundir.experiment_folder import claimed, experiment_root
from taxbench.rundir.provenance import capture_launch

if TYPE_CHECKING:
    from taxbench.commands.scan import ScanSettings
    from taxbench.launchers.local import RankMain
    from taxbench.launchers.outcome import Outcome, Queued

log = logger(__name__)


def fail(message: str, code: int = exit_codes.CONFIG_ERROR) -> None:
    print(f"taxbench: error: {message}", file=sys.stderr)
    raise SystemExit(code)


def fail_with(exc: Exception) -> None:
    """fail() with the exit code the error carries (taxbench.rundir.read.UnreadableRecords: 4), else 2."""
    fail(str(exc), getattr(exc, "exit_code", exit_codes.CONFIG_ERROR))


def launch(cfg: TaxbenchConfig, root: Path, rank_main: RankMain | None = None) -> Outcome:
    """Run the experiment (or what `rank_main` runs on every rank: taxbench verify's rerun); what it left
    (taxbench.launchers.outcome): Launched once every rank has finished, Queued for a Slurm point of a multirun (the
    sweep's end waits for it), DryRun for a Slurm dry run (cluster.dry_run=true: the job script is written, nothing
    submitted)."""
    from taxbench.launchers.local import launch_inprocess, launch_local
    from taxbench.launchers.outcome import DryRun, Launched
    from taxbench.launchers.worker import run_rank

    rank_main = rank_main or run_rank
    if cfg.cluster.launcher is Launcher.local:
        launch_local(cfg, root, rank_main)
    elif cfg.cluster.launcher is Launcher.inprocess:
        launch_inprocess(cfg, root, rank_main)
    elif cfg.cluster.launcher is Launcher.slurm:
        try:
            from taxbench.launchers.slurm import dry_run_slurm, launch_slurm
        except ImportError as exc:
            fail(f"cluster=slurm needs submitit ({exc}); install it with: pip install 'taxbench[slurm]'")
        try:
            if cfg.cluster.dry_run:
                return DryRun(root, dry_run_slurm(cfg, root))
            return launch_slurm(cfg, root, block=not _is_multirun(), rank_main=rank_main)
        except ConfigError as exc:
            fail(str(exc))
    else:
        raise ConfigError(f"cluster.launcher={cfg.cluster.launcher.value!r} is not available in this version")
    return Launched(root, cfg.report)


def run_plan(raw: DictConfig) -> int:
    """plan=true: print the meta-device plan for cluster.gpus GPUs and exit; launches nothing, needs no GPU."""
    from taxbench.parallel.plan import make_plan, render_plan

    try:
        cfg = load_config(raw)
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


def run_experiment(raw: DictConfig) -> int | Queued:
    """The experiment's exit code; for a Slurm point of a multirun, queued without waiting, its Queued outcome (the
    multirun's end publishes it, taxbench.launchers.multirun)."""
    if raw.get("plan", False):
        return run_plan(raw)
    if raw.cluster.launcher == Launcher.local:  # its imports overlap this process's from here on
        from taxbench.launchers.rank_server import start_rank_server
        start_rank_server()
    from taxbench.launchers.local import RankFailed
    from taxbench.launchers.outcome import Launched, LaunchFailed, Queued, publish_launch
    from taxbench.preflight import prepare, stack_native_audits
    from taxbench.rundir.read import RecordError

    try:
        if raw.cluster.launcher == Launcher.torchrun:
            return run_as_started_rank(raw)
        cfg = prepare(raw)
        with claimed(cfg, experiment_root(cfg, _multirun_point())) as root:
            log.debug("experiment folder %s: cluster=%s, %d ranks", root, cfg.cluster.name, world_size(cfg.cluster))
            try:
                capture_launch()
                outcome = launch(cfg, root)
                if isinstance(outcome, Queued):
                    return outcome
                code = publish_launch(outcome, group=root.parent.name if _is_multirun() else None)
            except (RankFailed, LaunchFailed) as exc:  # a rank died, a Slurm job ended without results
                fail(str(exc), exit_codes.FAILED)
            if isinstance(outcome, Launched):
                print_audits(stack_native_audits(cfg))
            return code
    except (ConfigError, RecordError) as exc:  # RecordError: results that cannot be read back or written
        fail_with(exc)
    return exit_codes.CONFIG_ERROR


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
def hydra_entry(raw: DictConfig) -> int | Queued:
    """Hydra's task function. Under a multirun its return value reaches the multirun callback (Hydra's JobReturn): a
    point queued on Slurm hands its Queued outcome over that way."""
    code = run_experiment(raw)
    if isinstance(code, int) and code and not _is_multirun():
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


def _certificate(args: argparse.Namespace) -> int:
    from taxbench.commands.verify import certificate_command

    return certificate_command(args.experiment, args.out)


def _tracing(args: argparse.Namespace) -> int:
    from taxbench.commands.tracing import run_tracing_command

    return run_tracing_command(args)


def _input_errors() -> tuple[type[Exception], ...]:
    """Exceptions that mean bad input to a subcommand: reported as `taxbench: error: ...`, never as a traceback."""
    from taxbench.commands.tracing import input_errors
    from taxbench.datasets.shards import ShardError
    from taxbench.rundir.read import RecordError
    from taxbench.rundir.records import RunWriteError

    return (RecordError, RunWriteError, ShardError, FileNotFoundError, *input_errors())


EXIT_CODES = "exit codes: 0 ok, 1 a run failed, 2 bad input, 3 a gate failed or runs differ, 4 incomplete evidence"


def _subparser(sub: argparse._SubParsersAction, name: str, summary: str, description: str, exits: str,
               ) -> argparse.ArgumentParser:
    """A subcommand whose --help says what it does and what its exit codes mean, wrapped for an 80-column terminal."""
    return sub.add_parser(name, help=summary, description=description, epilog=exits,
                          formatter_class=_Formatter)


class _Formatter(argparse.HelpFormatter):
    """argparse's formatter at no more than 80 columns, whatever the terminal reports."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, width=min(80, shutil.get_terminal_size().columns), max_help_position=28)


def _parser() -> argparse.ArgumentParser:
    """The parser of the subcommands that work on results. Built from argparse alone: `taxbench analyse` and its
    --help import no torch and no launcher (tests/test_cli.py checks it)."""
    parser = argparse.ArgumentParser(prog="taxbench", description="Work on finished taxbench experiments.",
                                     epilog=EXIT_CODES, formatter_class=_Formatter)
    sub = parser.add_subparsers(dest="command", required=True)
    analyse_cmd = _subparser(
        sub, "analyse", "re-analyse an experiment, print its summary",
        "Re-analyse an experiment folder: check every run against its manifest, estimate the tax, decide the "
        "gates, print the summary and rewrite summary.json (and report/ where the experiment wrote one).",
        "exit codes: 0 the gates passed, 2 bad input (not an experiment folder), 3 a gate failed, 4 incomplete "
        "evidence (missing, truncated or unreadable records)")
    analyse_cmd.add_argument("root", type=Path, metavar="EXPERIMENT", help="an experiment folder (runs/<name>)")
    analyse_cmd.set_defaults(handler=_analyse)
    report_cmd = _subparser(
        sub, "report", "write report.html and report.md",
        "Analyse an experiment, or a sweep folder that a taxbench multirun made, and write report/report.html "
        "(self-contained, with plots) and report/report.md; --wandb also logs it to Weights & Biases.",
        "exit codes: 0 passed, 2 bad input (not an experiment or a sweep folder), 3 a gate failed, 4 incomplete "
        "evidence")
    report_cmd.add_argument("root", type=Path, metavar="FOLDER", help="an experiment folder or a sweep folder")
    report_cmd.add_argument("--wandb", action="store_true", help="also log to wandb (offline unless WANDB_MODE is set)")
    report_cmd.add_argument("--wandb-project", default=ReportConfig.wandb_project, help="wandb project")
    report_cmd.add_argument("--wandb-group", default=None, help="wandb group (default: the sweep folder's name)")
    report_cmd.set_defaults(handler=_report)
    shards_cmd = _subparser(
        sub, "build-shards", "tokenize a text file into token shards",
        "Tokenize a text file (one token per byte) into a folder of token shards that recipe.data reads.",
        "exit codes: 0 written, 2 bad input")
    shards_cmd.add_argument("text_file", type=Path)
    shards_cmd.add_argument("out_dir", type=Path)
    shards_cmd.add_argument("--tokens-per-shard", type=int, default=1 << 24)
    shards_cmd.add_argument("--dtype", choices=["uint16", "uint32"], default="uint16")
    shards_cmd.set_defaults(handler=_build_shards)
    diff_cmd = _subparser(
        sub, "diff", "diff two runs' traces, first origin per rank",
        "Compare two runs' trace captures (<run>/trace/, from experiment.trace) op by op, aligned by (module, op "
        "occurrence), and name per rank the first op whose inputs agree and whose outputs differ.",
        "exit codes: 0 identical, 2 bad input, 3 the traces differ, 4 no evidence (no trace, or no step in common)")
    diff_cmd.add_argument("run_a", type=Path)
    diff_cmd.add_argument("run_b", type=Path)
    diff_cmd.add_argument("--step", type=int, action="append", help="compare only this step (repeatable)")
    diff_cmd.add_argument("--json", action="store_true", help="print the report as JSON")
    diff_cmd.set_defaults(handler=_tracing)
    loc_cmd = _subparser(
        sub, "localize", "replay the first diverging step until an op is named",
        "Find the first step where two runs' fingerprints differ, replay both from their checkpoints with deeper "
        "tracing rungs (modules, then ops, then every op's tensors) until the op where they part is named.",
        "exit codes: 0 no divergence, 2 bad input, 3 diverged (origin named or bounded), 4 no evidence")
    loc_cmd.add_argument("run_a", type=Path)
    loc_cmd.add_argument("run_b", type=Path)
    loc_cmd.add_argument("--work-dir", type=Path, default=None,
                         help="where replays go (default: <run_b>/../localize/<run_a>-vs-<run_b>)")
    loc_cmd.add_argument("--max-numel", type=int, default=0,
                         help="record larger tensors by shape only (bounds rung-3 cost); 0 = no limit")
    loc_cmd.add_argument("--json", action="store_true", help="print the result as JSON")
    loc_cmd.set_defaults(handler=_tracing)
    cert_cmd = _subparser(
        sub, "certificate", "write an experiment's portable reference",
        "Write the portable reference of an experiment's deterministic run (its per-step, per-rank fingerprints "
        "and the manifest's essentials, hash-sealed), small enough to commit, for taxbench verify.",
        "exit codes: 0 written, 2 bad input, 4 incomplete evidence (records missing or unreadable)")
    cert_cmd.add_argument("experiment", type=Path, help="an experiment folder (runs/<experiment>)")
    cert_cmd.add_argument("-o", "--out", type=Path, required=True, help="the certificate file to write")
    cert_cmd.set_defaults(handler=_certificate)
    return parser


def subcommand(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        return int(args.handler(args))
    except _input_errors() as exc:
        fail_with(exc)
    return exit_codes.CONFIG_ERROR


SUBCOMMANDS = ("analyse", "report", "build-shards", "diff", "localize", "certificate")
# Subcommands that take Hydra overrides like an experiment, plus keys of their own.
LAYOUTS = "layouts"
SCAN = "scan"
VERIFY = "verify"
STACKS = "stacks"
RUN = "run"  # `taxbench run [overrides] -- COMMAND`: the user's own command as the pair (taxbench.commands.run)
HYDRA_SUBCOMMANDS = (LAYOUTS, SCAN, VERIFY, STACKS, RUN)
LAYOUTS_USAGE = """\
usage: taxbench layouts [hydra overrides] 'layouts=[L1, L2, ...]'
                        [policy=deterministic|baseline]

Runs the recipe under each layout, two runs of one arm's policy per layout
(default: the deterministic arm), and compares them: whether each layout is
repeatable on its own, the step-0 and final weights by a layout-invariant
digest, and per step the loss and gradient norm with their distance in float32
ulps. A layout is dot-joined factors: pp<N>, tp<N>, dp<N>, ep<N>, v<N> (virtual
stages), ddp or fsdp; a factor left out is 1, dp follows from the world size
(cluster.cpu_ranks). experiment.steps sets the steps per run (default 8).

  python -m taxbench layouts +recipe=moe_1t_proxy \\
      'layouts=[pp1.dp4, pp2.dp2, pp2.dp2.ep2, tp2.dp2]'

exit codes: 0 every layout repeatable, 2 bad input (checked for every layout
before any runs), 3 a layout not repeatable, 4 evidence missing
"""


MAIN_HELP = """\
taxbench: what does bitwise determinism cost your LLM pretraining recipe, and
do you really have it?

Run a baseline/deterministic pair (Hydra overrides, key=value):
  python -m taxbench                     # dense_tiny, 2 gloo ranks on CPU
  python -m taxbench +recipe=moe_tiny cluster.threads_per_rank=2
  python -m taxbench +recipe=moe_1t cluster.gpus=2432 plan=true
  python -m taxbench -m +recipe=moe_1t cluster=slurm \\
      cluster.gpus=512,1024,2432
  python -m taxbench +recipe=moe_1t cluster=slurm cluster.gpus=2432 \\
      cluster.dry_run=true               # the job script only

Config groups: a recipe with +recipe=NAME, the arms with
mode@arms.baseline=MODE and mode@arms.deterministic=MODE.
{groups}
Every key with its value: python -m taxbench --cfg job

Your own training command, unchanged, as the pair:
  run [overrides] -- COMMAND [ARGS...]
                             e.g. run -- torchrun --nproc-per-node 2 train.py

Work on results (taxbench SUBCOMMAND --help for each):
  analyse EXPERIMENT         re-analyse an experiment, print its summary
  report FOLDER              write report.html/report.md (and --wandb)
  diff RUN_A RUN_B           tracing ladder: first origin per rank
  localize RUN_A RUN_B       replay deeper rungs until an op is named
  layouts [overrides] 'layouts=[pp1.dp4, pp2.dp2]'
                             one recipe under several parallel layouts
  stacks [overrides] 'stacks=[taxbench, deepspeed]'
                             each stack under its own switch and taxbench's
                             policy: one table of tax and gates
  scan [overrides]           replay every op of one step per policy
  verify EXPERIMENT|CERT [overrides]
                             rerun a stored deterministic run, compare bits
  certificate EXPERIMENT -o FILE
                             an experiment's portable reference, for verify
  build-shards TEXT OUT_DIR  tokenize a text file into token shards

Shell completion: eval "$(taxbench -sc install=bash)"
Hydra's own flags (--cfg, --info, -m, ...): python -m taxbench --hydra-help

{exit_codes}
"""

# The config groups a person chooses from (the schema group holds the structured configs Hydra validates against).
CHOSEN_GROUPS = ("recipe", "mode", "cluster")


def main_help() -> str:
    """`python -m taxbench --help`: Hydra's help template cannot wrap its group lists or name the console script, so
    the help is ours, its group options read from the config package as Hydra would find them."""
    from importlib.resources import files

    conf = files("taxbench.conf")
    lines = []
    for group in CHOSEN_GROUPS:
        names = sorted(entry.name.removesuffix(".yaml") for entry in conf.joinpath(group).iterdir()
                       if entry.name.endswith(".yaml"))
        lines.append(textwrap.fill(", ".join(names), width=80, initial_indent=f"  {group}: ",
                                   subsequent_indent=" " * (len(group) + 4), break_on_hyphens=False))
    return MAIN_HELP.format(groups="\n".join(lines), exit_codes=textwrap.fill(EXIT_CODES, width=80))


def _override_key(override: str) -> str:
    return override.lstrip("+~").partition("=")[0]


SCAN_USAGE = """\
usage: taxbench scan [hydra overrides] [scan.repeats=K]
                     [scan.optimizer_step=false] [scan.out=FILE]

Runs one training step of the recipe under each policy (baseline,
deterministic) on one rank in this process, replays every ATen op K times
(default 3) on cloned inputs with the same RNG state, and lists per policy the
ops whose outputs differed (op, module, how many of K, input shapes, dtype) and
the ops without a deterministic implementation. Writes scan.json (default
<experiment.out_dir>/scan-<experiment.name>/).

  python -m taxbench scan +recipe=moe_tiny cluster.threads_per_rank=2

exit codes: 0 the deterministic policy has no such op, 2 bad input, 3 it has
one, 4 no op replayed (no evidence)
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
    from taxbench.config.layout_names import parse_layout_list
    from taxbench.launchers.layouts import check_arm, layout_configs, repeat_settings, run_layouts
    from taxbench.launchers.outcome import publish_launch
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
        cfg = load_config(_compose(overrides))
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
            return publish_launch(run_layouts(configs, policy, root, cfg.report))
    return exit_codes.CONFIG_ERROR


STACKS_USAGE = """\
usage: taxbench stacks [hydra overrides] ['stacks=[S1, S2, ...]']
                       [family=dense|moe]

Runs the same model size on each training stack named (default: taxbench,
titan, megatron, deepspeed), each under its own determinism switch
(mode@arms.deterministic=stack_native) and under taxbench's full policy
(mode@arms.deterministic=deterministic): one experiment per cell, then one
table of tax +/- interval and the three gate verdicts per stack and policy.
family picks each stack's recipe (dense: dense_tiny, titan_llama3_debug,
megatron_gpt_debug, deepspeed_dense_debug; moe: moe_tiny, titan_moe_debug,
megatron_moe_debug, deepspeed_moe_debug); the stacks that build their model
from the recipe's fields (all but torchtitan) get one model and batch shape
(dense_tiny's, with 4 experts for moe; a recipe.* override wins), and the
table gives each row's parameter count. A cell that cannot run here is listed,
not failed: "needs CUDA" (Megatron-Core), "not installed" (with the pip line).
experiment.steps sets the steps per run (default 8); the other overrides apply
to every cell. taxbench report <folder> renders the matrix again.

  python -m taxbench stacks 'stacks=[taxbench, deepspeed]' experiment.steps=30

exit codes: 0 every cell that ran passed, 2 bad input (checked for every cell
before any runs), 3 a strict gate differs in a cell, 4 evidence missing (or no
cell ran)
"""


def run_stacks_command(argv: list[str]) -> int:
    """`taxbench stacks`: each stack under its own switch and taxbench's policy (taxbench.launchers.stacks)."""
    if any(arg in ("-h", "--help") for arg in argv):
        return _print_to_a_pipe(STACKS_USAGE, exit_codes.OK)
    from taxbench.analysis.stacks_matrix import StacksPlan
    from taxbench.launchers.outcome import publish_launch
    from taxbench.launchers.stacks import (
        DEFAULT_STEPS,
        check_family,
        check_overrides,
        parse_stack_list,
        plan_stacks,
        run_stacks,
        shape_text,
    )
    from taxbench.rundir.read import RecordError

    own: dict[str, str | None] = {"stacks": None, "family": "dense"}
    overrides = []
    args = iter(argv)
    for arg in args:
        key, sep, value = arg.partition("=")
        if sep and key in own:
            while key == "stacks" and value.startswith("[") and "]" not in value:  # unquoted: join the list's words
                value += " " + next(args, "]")
            own[key] = value
        else:
            overrides.append(arg)
    given = {_override_key(o) for o in overrides}
    with _one_line_input_errors(RecordError):
        stacks = parse_stack_list(own["stacks"])
        family = check_family(str(own["family"]))
        check_overrides(overrides)
        cfg = load_config(_compose(overrides))
        if cfg.cluster.launcher is not Launcher.local:
            raise ConfigError(f"taxbench stacks launches the cells on this machine; cluster={cfg.cluster.name} is not "
                              "supported yet, use cluster=local")
        cells, configs = plan_stacks(stacks, family, overrides, given, _compose)
        if "experiment.name" not in given:
            cfg.experiment.name = f"stacks-{family}-{cfg.experiment.name.removeprefix(cfg.recipe.name + '-')}"
        steps = next((c.experiment.steps for c in configs.values()), DEFAULT_STEPS)
        plan = StacksPlan(family, steps, world_size(cfg.cluster), cfg.cluster.device.value, cells,
                          shape_text(family))
        with claimed(cfg, experiment_root(cfg)) as root:
            capture_launch()
            return publish_launch(run_stacks(plan, configs, root, cfg.report))
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
        cfg = load_config(_compose(overrides))
        check_scan(cfg, settings)
        check_before_launch(cfg)
        scans, out = run_scan(cfg, settings)
    return _print_to_a_pipe(render(scans, out), exit_code(scans))


VERIFY_USAGE = """\
usage: taxbench verify EXPERIMENT|CERTIFICATE [...] [overrides]
                       [verify.avoid_reference_nodes=true]

Reruns the reference's deterministic recipe once (its deterministic-0, from the
config in its manifest or certificate) and compares every step's fingerprints
bit for bit with the reference's, over the steps both have. Only where and how
the rerun runs may be overridden (cluster launcher/profile, partition, account,
qos, time limit, threads_per_rank, nodes, setup, sbatch_args,
experiment.out_dir/name/steps); any other difference is refused naming the
keys. With verify.avoid_reference_nodes=true a Slurm rerun excludes the
reference's hostnames (sbatch --exclude). Writes verify.json beside the rerun.
Several references (before the overrides) are rerun one after another, or on
Slurm as one job array (one submission; their jobs must have one shape).

  python -m taxbench verify runs/ref
  taxbench certificate runs/ref -o ref.cert
  python -m taxbench verify ref.cert cluster=slurm_cpu
  python -m taxbench verify certs/a.cert certs/b.cert cluster=slurm_cpu

exit codes: 0 identical, 2 bad input (a damaged or edited certificate), 3 a
fingerprint differs (first step, rank and metric; the manifests' differences as
suspects; the localize command), 4 evidence missing; for several references
the worst of theirs (3 before 4)
"""


def run_verify_command(argv: list[str]) -> int:
    """`taxbench verify`: rerun stored deterministic runs and compare them bitwise (taxbench.commands.verify)."""
    if any(arg in ("-h", "--help") for arg in argv):
        return _print_to_a_pipe(VERIFY_USAGE, exit_codes.OK)
    sources = list(itertools.takewhile(lambda arg: "=" not in arg and not arg.startswith(("+", "~")), argv))
    if not sources:
        fail("taxbench verify needs a reference: an experiment folder (runs/<experiment>) or a certificate file "
             "(taxbench verify --help)")
    from taxbench.commands.verify import (
        OWN_KEYS,
        conclude,
        load_reference,
        overview,
        plan_rerun,
        render,
        settings_of,
    )
    from taxbench.launchers.local import RankFailed, continue_command
    from taxbench.launchers.outcome import LaunchFailed
    from taxbench.launchers.worker import run_rerun_rank
    from taxbench.rundir.read import RecordError
    from taxbench.rundir.records import RunWriteError

    rest = argv[len(sources):]
    misplaced = [arg for arg in rest if "=" not in arg]
    if misplaced:
        fail(f"{misplaced[0]!r} follows the overrides; name every reference first: taxbench verify REF [REF ...] "
             "[overrides]")
    own = {arg.partition("=")[0]: arg.partition("=")[2] for arg in rest if arg.startswith("verify.")}
    unknown = sorted(set(own) - set(OWN_KEYS))
    if unknown:
        fail(f"unknown verify setting {unknown[0]!r}; verify takes {', '.join(OWN_KEYS)}")
    overrides = [arg for arg in rest if not arg.startswith("verify.")]
    if len(sources) > 1 and any(arg.lstrip("+~").startswith("experiment.name=") for arg in overrides):
        fail(f"experiment.name names one rerun, but {len(sources)} references are verified; drop it (each rerun is "
             "named verify-<experiment>-<date>-<time>-<n>)")
    with _one_line_input_errors(RecordError, RunWriteError):
        references = [load_reference(Path(source)) for source in sources]
        settings = settings_of(own)
        several = len(references) > 1
        cfgs = [plan_rerun(reference, _compose(overrides), overrides, settings, f"-{index}" if several else "")
                for index, reference in enumerate(references, 1)]
        with ExitStack() as held:
            roots = [held.enter_context(claimed(cfg, experiment_root(cfg))) for cfg in cfgs]
            capture_launch()
            runs = list(zip(cfgs, roots, strict=True))
            if several and all(cfg.cluster.launcher is Launcher.slurm for cfg in cfgs):
                failures = _launch_slurm_batch(runs, run_rerun_rank)
            else:
                failures = {}
                for index, (cfg, root) in enumerate(runs):
                    try:
                        launch(cfg, root, run_rerun_rank)
                    except (RankFailed, LaunchFailed) as exc:
                        if not several:
                            fail(str(exc), exit_codes.FAILED)
                        # The other references still get their verdicts; this one continues on its own.
                        what = exc.what if isinstance(exc, RankFailed) else str(exc)
                        alone = continue_command([sys.argv[0], "verify", sources[index], *rest], cfg.experiment.name)
                        failures[index] = f"{what}; continue this rerun with: {shlex.join(alone)}"
            results = [conclude(reference, root) for index, (reference, root) in enumerate(zip(references, roots,
                                                                                                   strict=True))
                       if index not in failures]
        text = "\n\n".join(render(result) for result in results)
        if several:
            text += "\n\n" + overview(results, [sources[index] for index in failures])
        for message in failures.values():
            print(f"taxbench: error: {message}", file=sys.stderr)
        codes = [result.exit_code for result in results] + [exit_codes.FAILED] * len(failures)
        return _print_to_a_pipe(text, exit_codes.combined(codes))
    return exit_codes.CONFIG_ERROR


def _launch_slurm_batch(runs: list[tuple[TaxbenchConfig, Path]], rank_main: RankMain) -> dict[int, str]:
    """The reruns as one Slurm job array; the tasks that ended without results, by index, with their logs."""
    try:
        from taxbench.launchers.slurm import launch_slurm_batch
    except ImportError as exc:
        fail(f"cluster=slurm needs submitit ({exc}); install it with: pip install 'taxbench[slurm]'")
    return launch_slurm_batch(runs, rank_main)


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
    if argv and argv[0] == VERIFY:
        raise SystemExit(run_verify_command(argv[1:]))
    if argv and argv[0] == STACKS:
        raise SystemExit(run_stacks_command(argv[1:]))
    if argv and argv[0] == RUN:
        from taxbench.commands.run import run_command
        raise SystemExit(run_command(argv[1:]))
    if "--help" in argv or "-h" in argv:
        raise SystemExit(_print_to_a_pipe(main_help(), exit_codes.OK))
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
