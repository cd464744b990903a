"""`taxbench run -- COMMAND`: the user's own training command as every run of a pair, and the edits that make an arm.

The arms differ only by the policy (torch flags the probe applies, the policy's environment) and the stack's own
switch, given as edits to the command:
- `args`: appended, or replacing the same flag where the command already has it (`--flag value`, `--flag=value`);
- `env`: environment variables set for the run;
- `config_file` + `config_set`: dotted keys set in a JSON or YAML file that the command names (a DeepSpeed JSON),
  edited into a copy in the run folder and the command pointed at the copy; the user's file is never written.
Restart replay runs the command's own save and resume (`restart.save_args`, `restart.resume_args`, with
`{checkpoint}` replaced by a folder inside the run folder).

Torch-free: the edits are pure functions of the command, checked before anything runs.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

CHECKPOINT_PLACEHOLDER = "{checkpoint}"
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class CommandError(ValueError):
    """A command or an edit that cannot be run as asked; the message names the value and the fix."""


@dataclass
class ArmEdits:
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    config_file: str | None = None  # a JSON or YAML file the command names among its arguments
    config_set: dict[str, Any] = field(default_factory=dict)  # dotted key -> value, set in the run's copy


@dataclass
class RestartArgs:
    save_args: list[str] = field(default_factory=list)  # make the command save its checkpoint to {checkpoint}
    resume_args: list[str] = field(default_factory=list)  # make it resume from {checkpoint}


@dataclass
class CommandConfig:
    """The `run` section: empty for recipe experiments."""

    command: list[str] = field(default_factory=list)
    cwd: str | None = None  # where the command runs (None: where taxbench was started)
    baseline: ArmEdits = field(default_factory=ArmEdits)
    deterministic: ArmEdits = field(default_factory=ArmEdits)
    restart: RestartArgs = field(default_factory=RestartArgs)
    pairs: int = 2  # whole-run pairs before any precision target (A B, then B A: the four gated runs)
    max_pairs: int = 8  # with experiment.target_half_width: pairs are added until it is met or this many ran
    timeout_s: float = 0.0  # per run; 0: none
    # Timing-only runs (pairs past the first two) digest every Nth step (0: none); the gated runs digest every step.
    timing_fingerprint_every: int = 0

    @property
    def active(self) -> bool:
        return bool(self.command)


@dataclass(frozen=True)
class EditedCommand:
    """One run's command line and environment, as the manifest records them."""

    argv: list[str]
    env: dict[str, str]  # only what the edits set (the rest is the launch's environment)
    config_copy: str | None  # the edited copy of config_file in the run folder
    edits: dict[str, Any]  # what was edited, for the manifest

    def to_dict(self) -> dict[str, Any]:
        return {"argv": self.argv, "env": self.env, "config_copy": self.config_copy, "edits": self.edits}


def validate_command(run: CommandConfig) -> None:
    """Everything that can be known before a run: a command, edits that apply to it, sane counts."""
    if not run.command:
        raise CommandError("no command after `--`: give the training command to run, e.g. "
                           "`python -m taxbench run -- torchrun --nproc-per-node 2 train.py`")
    if run.pairs < 2:
        raise CommandError(f"run.pairs={run.pairs} must be >= 2: two pairs (A B, B A) give the two runs of each arm "
                           "that the repeatability and baseline-sanity gates compare")
    if run.max_pairs < run.pairs:
        raise CommandError(f"run.max_pairs={run.max_pairs} must be >= run.pairs={run.pairs}")
    if run.timeout_s < 0:
        raise CommandError(f"run.timeout_s={run.timeout_s} must be >= 0 (0: no limit)")
    if run.timing_fingerprint_every < 0:
        raise CommandError(f"run.timing_fingerprint_every={run.timing_fingerprint_every} must be >= 0 (0: none)")
    for arm in ("baseline", "deterministic"):
        edits: ArmEdits = getattr(run, arm)
        for name in edits.env:
            if not _ENV_NAME.fullmatch(name):
                raise CommandError(f"run.{arm}.env: {name!r} is not an environment variable name")
        if edits.config_set and not edits.config_file:
            raise CommandError(f"run.{arm}.config_set needs run.{arm}.config_file: the JSON or YAML file the "
                               "command names, whose copy gets the keys")
        if edits.config_file:
            _config_position(run.command, edits.config_file, f"run.{arm}.config_file")
            _load_config_file(_resolved(edits.config_file, run.cwd), f"run.{arm}.config_file")
    save, resume = run.restart.save_args, run.restart.resume_args
    if bool(save) != bool(resume):
        raise CommandError("run.restart needs both save_args and resume_args (the command's own save, then its own "
                           "resume from the same {checkpoint}), or neither (the restart gate is then not run)")
    for key, args in (("save_args", save), ("resume_args", resume)):
        if args and not any(CHECKPOINT_PLACEHOLDER in arg for arg in args):
            raise CommandError(f"run.restart.{key}={list(args)} names no {CHECKPOINT_PLACEHOLDER}: taxbench puts "
                               "the checkpoint in a folder of the run and replaces the placeholder with it")


def _resolved(path: str, cwd: str | None) -> Path:
    candidate = Path(path)
    return candidate if candidate.is_absolute() or cwd is None else Path(cwd) / candidate


def _config_position(argv: Sequence[str], config_file: str, key: str) -> tuple[int, str]:
    """Where the command names `config_file`: (argument index, the argument's prefix before the path, e.g.
    "--deepspeed_config=")."""
    for index, arg in enumerate(argv):
        prefix, sep, value = arg.rpartition("=")
        if arg == config_file:
            return index, ""
        if sep and value == config_file:
            return index, prefix + sep
    raise CommandError(f"{key}={config_file!r} is not among the command's arguments; the copy would never be read. "
                       "Name the file exactly as the command does")


def _load_config_file(path: Path, key: str) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise CommandError(f"{key}: {path} cannot be read ({exc.strerror or exc})") from exc
    try:
        loaded = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise CommandError(f"{key}: {path} is not valid {'JSON' if path.suffix == '.json' else 'YAML'} "
                           f"({str(exc).splitlines()[0]})") from exc
    if not isinstance(loaded, dict):
        raise CommandError(f"{key}: {path} holds no mapping of keys to values")
    return loaded


def set_dotted(config: dict[str, Any], dotted: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `config` with each dotted key set (intermediate mappings created where missing)."""
    result = copy.deepcopy(config)
    for key, value in dotted.items():
        node = result
        *parents, leaf = key.split(".")
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise CommandError(f"config_set key {key!r}: {part!r} holds {child!r}, not a mapping of keys")
            node = child
        node[leaf] = value
    return result


def _flag_of(arg: str) -> str | None:
    return arg.split("=", 1)[0] if arg.startswith("-") else None


def with_args(argv: Sequence[str], added: Sequence[str]) -> list[str]:
    """`argv` with `added` appended, where a flag the command already has is replaced (its value with it): the
    command then reads one value, the edit's. `--flag=value` and `--flag value` are both recognised."""
    result = list(argv)
    index = 0
    while index < len(added):
        arg = added[index]
        flag = _flag_of(arg)
        takes_value = "=" not in arg and index + 1 < len(added) and _flag_of(added[index + 1]) is None
        group = list(added[index:index + (2 if takes_value else 1)])
        index += len(group)
        if flag is None:
            result += group
            continue
        at = next((i for i, existing in enumerate(result) if _flag_of(existing) == flag), None)
        if at is None:
            result += group
            continue
        had_value = "=" not in result[at] and at + 1 < len(result) and _flag_of(result[at + 1]) is None
        result[at:at + (2 if had_value else 1)] = group
    return result


def edited_command(run: CommandConfig, arm: str, run_dir: Path, extra_args: Sequence[str] = (),
                   checkpoint: Path | None = None) -> EditedCommand:
    """The command line and environment of one run of `arm` (its edits applied; `extra_args`, the restart's save or
    resume arguments, after them with {checkpoint} replaced)."""
    edits: ArmEdits = getattr(run, arm)
    argv = list(run.command)
    config_copy = None
    if edits.config_file:
        index, prefix = _config_position(argv, edits.config_file, f"run.{arm}.config_file")
        source = _resolved(edits.config_file, run.cwd)
        config = set_dotted(_load_config_file(source, f"run.{arm}.config_file"), edits.config_set)
        copy_path = run_dir / f"command-config{source.suffix}"
        text = json.dumps(config, indent=2) if source.suffix == ".json" else yaml.safe_dump(config, sort_keys=False)
        copy_path.write_text(text, encoding="utf-8")
        argv[index] = prefix + str(copy_path)
        config_copy = str(copy_path)
    argv = with_args(argv, edits.args)
    if extra_args:
        if checkpoint is None:
            raise CommandError("restart arguments need a checkpoint folder")
        argv = with_args(argv, [arg.replace(CHECKPOINT_PLACEHOLDER, str(checkpoint)) for arg in extra_args])
    return EditedCommand(argv, dict(edits.env), config_copy,
                         {"args": list(edits.args), "env": dict(edits.env), "config_file": edits.config_file,
                          "config_set": dict(edits.config_set), "restart_args": list(extra_args)})
