"""Every `python -m taxbench ...` command in the README and docs/ still composes: Hydra's compose and taxbench's
config loader run on its overrides (nothing is launched), so a renamed key, group or recipe fails here, not for a
reader. Subcommands that take paths are checked to exist."""

from __future__ import annotations

import re
import shlex

import pytest
from helpers import REPO, compose_raw
from hydra.core.override_parser.overrides_parser import OverridesParser

from taxbench.cli import SUBCOMMANDS
from taxbench.commands.run import quoted_argument_lists
from taxbench.config.schema import load_config

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
COMMAND = re.compile(r"python -m taxbench\b(?P<rest>(?:[^`\n\\]|\\\n|\\(?!\n))*)")  # \ continues a line
OWN_KEYS = {"layouts": ("layouts", "policy"), "scan": ("scan.",), "verify": ("verify.",),
            "stacks": ("stacks", "family")}
PLACEHOLDER = re.compile(r"<[^>]*>|\.\.\.|\bN\b|MODE|NAME")


def documented_commands() -> list[tuple[str, str]]:
    """(where, the command's words after `python -m taxbench`) for every documented command with concrete words."""
    found = []
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        for match in COMMAND.finditer(text):
            line = text[: match.start()].count("\n") + 1
            rest = match.group("rest").replace("\\\n", " ")
            rest = re.split(r"\s#|\s\||&&|;|\s>", rest)[0]  # a shell comment, pipe or chain ends the command
            if PLACEHOLDER.search(rest):
                continue  # "python -m taxbench ... experiment.name=<name>" is a pattern, not a command
            try:
                words = shlex.split(rest)
            except ValueError:
                continue  # an inline mention cut by the prose, e.g. a quote closed on the next line
            found.append((f"{doc.name}:{line}", " ".join(shlex.quote(w) for w in words)))
    return found


def _first_of_sweeps(overrides: list[str]) -> list[str]:
    """A multirun's sweeps (cluster.gpus=512,1024) as their first point."""
    parsed = OverridesParser.create().parse_overrides(overrides)
    return [f"{o.get_key_element()}={next(iter(o.sweep_string_iterator()))}" if o.is_sweep_override() else o.input_line
            for o in parsed]


@pytest.mark.parametrize(("where", "command"), documented_commands())
def test_a_documented_command_composes(where: str, command: str) -> None:
    words = shlex.split(command)
    if words and words[0] in SUBCOMMANDS and not SUBCOMMANDS[words[0]].overrides:
        return  # these take paths (runs/<experiment>); argparse's own tests cover their options
    if words[:1] == ["run"]:  # taxbench run: the overrides before `--`, then the user's command
        words = quoted_argument_lists(words[1:words.index("--")] if "--" in words else words[1:])
    elif words and words[0] in SUBCOMMANDS:
        own = OWN_KEYS.get(words[0], ())
        words = [w for w in words[1:] if not w.startswith(own) or not own]
        while words[:1] and not ("=" in words[0] or words[0].startswith(("+", "~", "-"))):
            words = words[1:]  # verify/certificate: the reference folders or certificates
    overrides = [w for w in words if w not in ("-m", "--multirun") and not w.startswith("-")]
    if any(w in ("--cfg", "-c", "--help", "-h", "--hydra-help", "-sc") for w in words):
        overrides = [w for w in overrides if "=" in w or w.startswith(("+", "~"))]
    raw = compose_raw(*_first_of_sweeps(overrides))
    load_config(raw)  # unknown keys and wrong types of a stored recipe
    assert where


def test_the_docs_hold_commands_to_check() -> None:
    commands = documented_commands()
    assert len(commands) >= 20, commands
    assert any("+recipe=moe_1t" in c for _, c in commands)
