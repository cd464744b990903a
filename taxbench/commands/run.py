"""`taxbench run [overrides] -- COMMAND [ARGS...]`: the command a team already runs, unchanged, as every run of a pair.

The overrides are an experiment's (experiment.*, mode@arms.deterministic=stack_native, report.*) plus the `run`
section (taxbench.config.command): the deterministic arm's edits, the restart's save and resume arguments, pairs.
The experiment folder is the one a recipe run writes, so analyse, report, verify, certificate and localize read it
as they are.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import replace
from pathlib import Path

from taxbench import exit_codes
from taxbench.commands.input_errors import one_line_input_errors
from taxbench.commands.overrides import compose
from taxbench.config.command import CommandError, validate_command
from taxbench.config.schema import ConfigError, TaxbenchConfig, load_config, validate, world_size
from taxbench.rundir.experiment_folder import claimed, experiment_root
from taxbench.rundir.provenance import capture_launch
from taxbench.rundir.read import RecordError

USAGE = """\
usage: taxbench run [overrides] -- COMMAND [ARGS...]

Runs your training command, unchanged, as every run of a baseline/deterministic
pair: whole runs alternate A B B A, a probe loaded into each Python process of
the command applies the arm's policy and records every optimizer step. Prints
the tax with its interval and the three gates, as a recipe run does.

  python -m taxbench run -- torchrun --nproc-per-node 2 train.py
  python -m taxbench run 'run.deterministic.args=[--deterministic-mode]' \\
      -- torchrun --nproc-per-node 8 pretrain_gpt.py ...
  python -m taxbench run run.deterministic.config_file=ds_config.json \\
      '+run.deterministic.config_set={zero_optimization.stage: 2}' \\
      -- deepspeed train.py --deepspeed_config ds_config.json
  python -m taxbench run 'run.restart.save_args=[--save,{checkpoint}]' \\
      'run.restart.resume_args=[--resume,{checkpoint}]' -- torchrun ... train.py

Arms: baseline is the command as given; deterministic adds taxbench's policy
(torch flags, environment) and run.deterministic.{args,env,config_file,
config_set}; mode@arms.deterministic=stack_native keeps the edits alone.
Without run.restart.* the restart gate is "not run", never a pass.

exit codes: 0 both strict gates passed, 1 a run of the command failed (the
message says how to continue), 2 bad input, 3 a strict gate failed, 4 missing
evidence (a run recorded nothing, a gate not run, the policy turned off)
"""

_NAME_CHARS = re.compile(r"[^A-Za-z0-9_.-]+")


def split_command(argv: list[str]) -> tuple[list[str], list[str]]:
    """(overrides, command): the words before and after the first `--`."""
    if "--" not in argv:
        raise CommandError("no command: put the training command after `--`, e.g. "
                           "`python -m taxbench run -- torchrun --nproc-per-node 2 train.py`")
    at = argv.index("--")
    if at + 1 == len(argv):
        raise CommandError("no command after `--`: give the training command to run, e.g. "
                           "`python -m taxbench run -- torchrun --nproc-per-node 2 train.py`")
    return argv[:at], argv[at + 1:]


def command_label(command: list[str]) -> str:
    """A folder-safe name for the command: its Python script (or module) where it names one, else the program."""
    script = next((word for word in command if word.endswith(".py")), None)
    if script is None and "-m" in command[:-1]:
        script = command[command.index("-m") + 1]
    word = Path(script or command[0]).name.removesuffix(".py")
    return _NAME_CHARS.sub("_", word).strip("._") or "command"


_ARGUMENT_LISTS = re.compile(r"\+*run\.(baseline|deterministic)\.args|\+*run\.restart\.(save|resume)_args")


def quoted_argument_lists(overrides: list[str]) -> list[str]:
    """The overrides with argument lists quoted item by item, so that `[--save,{checkpoint}]` reads as words (Hydra's
    grammar would take `{checkpoint}` for a mapping and `--a=b` for more than a word). A list already quoted is kept."""
    result = []
    for override in overrides:
        key, sep, value = override.partition("=")
        if sep and _ARGUMENT_LISTS.fullmatch(key) and value.startswith("[") and value.endswith("]") \
                and not any(quote in value for quote in "'\""):
            items = [item.strip() for item in value[1:-1].split(",") if item.strip()]
            override = f"{key}=[" + ",".join("'" + item.replace("\\", "\\\\") + "'" for item in items) + "]"
        result.append(override)
    return result


def compose_config(overrides: list[str], command: list[str]) -> TaxbenchConfig:
    named = [f"recipe.name={command_label(command)}"]
    cfg = load_config(compose(named + quoted_argument_lists(overrides)))
    # The recipe only names the command: its batch is one sample per rank of the cluster, so that the recipe's layout
    # rules never refuse an allocation (cluster.gpus=16 under cluster=slurm) for a model that does not run.
    cfg.recipe = replace(cfg.recipe, micro_batch_size=1, global_batch_size=max(world_size(cfg.cluster), 1))
    cfg.run.command = list(command)
    cfg.run.cwd = cfg.run.cwd or os.getcwd()
    return cfg


def main(argv: list[str]) -> int:
    if any(arg in ("-h", "--help") for arg in argv[: argv.index("--") if "--" in argv else len(argv)]):
        print(USAGE)
        return exit_codes.OK
    from taxbench.commands.launch import check_command_launcher, launch_command
    from taxbench.launchers.command import CommandFailed, NoEvidence
    from taxbench.launchers.outcome import LaunchFailed, publish_launch

    try:
        with one_line_input_errors(CommandError):
            overrides, command = split_command(argv)
            cfg = compose_config(overrides, command)
            check_command_launcher(cfg)
            validate(cfg)
            validate_command(cfg.run)
        with claimed(cfg, experiment_root(cfg)) as root:
            capture_launch()
            print(f"taxbench: experiment {root}", flush=True)
            return publish_launch(launch_command(cfg, root, overrides))
    except (CommandError, ConfigError) as exc:
        return _fail(str(exc), exit_codes.CONFIG_ERROR)
    except (CommandFailed, LaunchFailed) as exc:  # LaunchFailed: the Slurm job ended before the schedule did
        return _fail(str(exc), exit_codes.FAILED)
    except NoEvidence as exc:
        return _fail(str(exc), exit_codes.INCOMPLETE)
    except RecordError as exc:
        return _fail(str(exc), getattr(exc, "exit_code", exit_codes.CONFIG_ERROR))


def _fail(message: str, code: int) -> int:
    print(f"taxbench: error: {message}", file=sys.stderr)
    return code

