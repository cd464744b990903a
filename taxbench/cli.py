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

This module is the parser's top and the dispatch: every subcommand is one entry of SUBCOMMANDS, naming the module
under taxbench/commands/ whose `main(argv: list[str]) -> int` runs it (argv: the words after the subcommand's name;
the return value is the exit code) and the line `taxbench --help` shows for it. Adding a subcommand is adding that
module and its entry, e.g. for taxbench/commands/run.py:

    "run": Subcommand("run", "[overrides] -- COMMAND [ARGS...]", "e.g. run -- torchrun --nproc-per-node 2 train.py",
                      overrides=True, section=YOUR_COMMAND),

the help, shell completion, the did-you-mean hint and tests/test_docs.py read the table.
A subcommand's module is imported only when it runs, so that `taxbench analyse`, every `--help` and shell completion
load neither torch nor a launcher (tests/test_cli.py checks it with -X importtime); the modules whose own --help must
stay light import their heavy parts once the arguments are read (scripts/import_graph.py names them).
"""

from __future__ import annotations

import difflib
import importlib
import os
import sys
import textwrap
from dataclasses import dataclass
from importlib.resources import files
from typing import Any

from taxbench import exit_codes
from taxbench.commands.input_errors import fail

# The sections of `taxbench --help` that list subcommands, in their order (one without a subcommand is left out).
YOUR_COMMAND = "Your own training command, unchanged, as the pair:"
RESULTS = "Work on results (taxbench SUBCOMMAND --help for each):"
SECTIONS = (YOUR_COMMAND, RESULTS)


@dataclass(frozen=True)
class Subcommand:
    module: str  # taxbench.commands.<module>, whose main(argv) -> int runs the subcommand
    usage: str  # its arguments, as `taxbench --help` lists them
    summary: str  # what it does, one phrase for `taxbench --help`
    overrides: bool = False  # takes Hydra overrides (key=value) like an experiment, rather than paths
    section: str = RESULTS  # where `taxbench --help` lists it




# In the order `taxbench --help` lists them.
SUBCOMMANDS: dict[str, Subcommand] = {
    "run": Subcommand("run", "[overrides] -- COMMAND [ARGS...]", "e.g. run -- torchrun --nproc-per-node 2 train.py",
                      overrides=True, section=YOUR_COMMAND),
    "analyse": Subcommand("analyse", "EXPERIMENT", "re-analyse an experiment, print its summary"),
    "report": Subcommand("report", "FOLDER", "write report.html/report.md (and --wandb)"),
    "diff": Subcommand("diff", "RUN_A RUN_B", "tracing ladder: first origin per rank"),
    "localize": Subcommand("localize_cli", "RUN_A RUN_B", "replay deeper rungs until an op is named"),
    "layouts": Subcommand("layouts", "[overrides] 'layouts=[pp1.dp4, pp2.dp2]'",
                          "one recipe under several parallel layouts", overrides=True),
    "stacks": Subcommand("stacks", "[overrides] 'stacks=[taxbench, deepspeed]'",
                         "each stack under its own switch and taxbench's policy: one table of tax and gates",
                         overrides=True),
    "scan": Subcommand("scan_cli", "[overrides]", "replay every op of one step per policy", overrides=True),
    "verify": Subcommand("verify_cli", "EXPERIMENT|CERT [overrides]", "rerun a stored deterministic run, compare bits",
                         overrides=True),
    "certificate": Subcommand("certificate", "EXPERIMENT -o FILE", "an experiment's portable reference, for verify"),
    "build-shards": Subcommand("build_shards", "TEXT OUT_DIR", "tokenize a text file into token shards"),
}
EXPERIMENT = "experiment"  # taxbench.commands.experiment: no subcommand, Hydra overrides

EXIT_CODES = "exit codes: 0 ok, 1 a run failed, 2 bad input, 3 a gate failed or runs differ, 4 incomplete evidence"

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

{subcommands}

Shell completion: eval "$(taxbench -sc install=bash)"
Hydra's own flags (--cfg, --info, -m, ...): python -m taxbench --hydra-help

{exit_codes}
"""

# The config groups a person chooses from (the schema group holds the structured configs Hydra validates against).
CHOSEN_GROUPS = ("recipe", "mode", "cluster")
_SUMMARY_COLUMN = 29


def main_help() -> str:
    """`python -m taxbench --help`: Hydra's help template cannot wrap its group lists or name the console script, so
    the help is ours, its group options read from the config package as Hydra would find them."""
    conf = files("taxbench.conf")
    groups = []
    for group in CHOSEN_GROUPS:
        names = sorted(entry.name.removesuffix(".yaml") for entry in conf.joinpath(group).iterdir()
                       if entry.name.endswith(".yaml"))
        groups.append(textwrap.fill(", ".join(names), width=80, initial_indent=f"  {group}: ",
                                    subsequent_indent=" " * (len(group) + 4), break_on_hyphens=False))
    sections = []
    for heading in SECTIONS:
        lines = [heading]
        for name, entry in SUBCOMMANDS.items():
            if entry.section != heading:
                continue
            words = f"  {name} {entry.usage}"
            if len(words) > _SUMMARY_COLUMN - 2:  # too long to share a line with its summary
                lines.append(words)
                words = ""
            lines.append(textwrap.fill(entry.summary, width=80, initial_indent=words.ljust(_SUMMARY_COLUMN),
                                       subsequent_indent=" " * _SUMMARY_COLUMN))
        if len(lines) > 1:
            sections.append("\n".join(lines))
    return MAIN_HELP.format(groups="\n".join(groups), subcommands="\n\n".join(sections),
                            exit_codes=textwrap.fill(EXIT_CODES, width=80))


def subcommand(argv: list[str]) -> int:
    """Run `taxbench <argv>` whose first word names a subcommand; its exit code."""
    module = importlib.import_module(f"taxbench.commands.{SUBCOMMANDS[argv[0]].module}")
    return int(module.main(argv[1:]))


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
    """Print the subcommands that complete the first argument of COMP_LINE; True when the line is that of a
    subcommand taking paths, so Hydra's config completion does not apply (the shell then falls back to file names)."""
    words = comp_line.split()[1:]  # drop the program name
    if comp_line[-1:].isspace():
        words.append("")
    if len(words) == 1:
        for name in SUBCOMMANDS:
            if name.startswith(words[0]):
                print(name)
    return len(words) > 1 and words[0] in SUBCOMMANDS and not SUBCOMMANDS[words[0]].overrides


class _ReaderMayLeave:
    """stdout that, once its reader has gone (`taxbench analyse runs/x | head -2`), drops what is still written
    instead of failing: the command finishes its work (summary.json included) and exits with its verdict, quietly."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._to_devnull()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._to_devnull()

    def _to_devnull(self) -> None:
        """What is buffered, and all that follows, goes to /dev/null (so the interpreter's last flush succeeds)."""
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, self._stream.fileno())
        os.close(devnull)

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, buffer, ...: the stream's own
        return getattr(self._stream, name)


def main() -> None:
    sys.stdout = _ReaderMayLeave(sys.stdout)
    argv = sys.argv[1:]
    if _completion_query(argv) and _complete_subcommands(os.environ.get("COMP_LINE", "")):
        return
    if argv and argv[0] in SUBCOMMANDS:
        raise SystemExit(subcommand(argv))
    if "--help" in argv or "-h" in argv:
        print(main_help())
        raise SystemExit(exit_codes.OK)
    word = _unknown_word(argv)
    if word is not None:
        close = difflib.get_close_matches(word, list(SUBCOMMANDS), n=1)
        hint = f"did you mean `taxbench {close[0]}`? " if close else ""
        fail(f"unknown subcommand or override {word!r}; {hint}subcommands: {', '.join(SUBCOMMANDS)}; overrides "
             "look like key=value (`python -m taxbench --help`)")
    raise SystemExit(importlib.import_module(f"taxbench.commands.{EXPERIMENT}").main(argv))
