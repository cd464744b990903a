"""The command line as a person uses it: shell completion, diagnostics' verbosity, multirun output."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from taxbench.cli import SUBCOMMANDS, main_help
from taxbench.rundir.experiment_folder import SWEEP_MARKER


@pytest.fixture
def taxbench_on_path(tmp_path: Path) -> dict[str, str]:
    """An environment whose PATH holds a `taxbench` console script like the one pip installs (Hydra's completion
    script is bound to the executable's name and calls it on every <TAB>)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "taxbench"
    script.write_text(f"#!{sys.executable}\nfrom taxbench.cli import main\nmain()\n")
    script.chmod(0o755)
    repo = str(Path(__file__).resolve().parents[1])
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
            "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}


def bash_completions(line: str, env: dict[str, str], cwd: Path) -> list[str]:
    """What bash offers in cwd for <TAB> at the end of `line` after `eval "$(taxbench -sc install=bash)"`."""
    words = line.split()
    cword = len(words) if line.endswith(" ") else len(words) - 1
    script = ('eval "$(taxbench -sc install=bash)"\n'
              f'COMP_LINE="{line}"; COMP_POINT={len(line)}; COMP_WORDS=({line}); COMP_CWORD={cword}\n'
              'hydra_bash_completion\nprintf "%s\\n" "${COMPREPLY[@]}"\n')
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=120)
    assert done.returncode == 0 and not done.stderr, done.stderr
    return [word for word in done.stdout.splitlines() if word]


def test_bash_completion_offers_subcommands_and_hydra_overrides(
    taxbench_on_path: dict[str, str], tmp_path: Path
) -> None:
    (tmp_path / "runs").mkdir()
    first = bash_completions("taxbench ", taxbench_on_path, tmp_path)
    assert set(SUBCOMMANDS) <= set(first) and "cluster=" in first and "experiment." in first
    assert bash_completions("taxbench loc", taxbench_on_path, tmp_path) == ["localize"]
    assert bash_completions("taxbench clu", taxbench_on_path, tmp_path) == ["cluster.", "cluster="]
    # A subcommand's arguments are paths, not overrides: bash completes file names.
    assert bash_completions("taxbench report r", taxbench_on_path, tmp_path) == ["runs"]


TINY_RUN = ("experiment.steps=4", "experiment.block_steps=2", "experiment.warmup_steps=1", "experiment.resume_step=2",
            "report.wandb=false", "report.html=false")


@pytest.mark.slow
def test_debug_messages_show_on_stderr_only_with_hydra_verbose(tmp_path: Path, taxbench_cli) -> None:
    # One spawned rank: its debug messages must follow the launcher's level too.
    args = ("cluster.cpu_ranks=1", *TINY_RUN, f"experiment.out_dir={tmp_path}")
    verbose = taxbench_cli(*args, "experiment.name=verbose", "hydra.verbose=taxbench", cwd=tmp_path, timeout=300)
    assert verbose.returncode == 0, verbose.stderr
    debug = [line for line in verbose.stderr.splitlines() if line.startswith("taxbench: debug: ")]
    assert f"taxbench: debug: experiment folder {tmp_path / 'verbose'}: cluster=local, 1 ranks" in debug
    assert any(line.endswith("deterministic-resumed start from scratch") for line in debug), debug  # from the rank
    assert "taxbench: debug:" not in verbose.stdout  # the results stay clean

    quiet = taxbench_cli(*args, "experiment.name=quiet", cwd=tmp_path, timeout=300)
    assert quiet.returncode == 0, quiet.stderr
    assert "taxbench: debug:" not in quiet.stderr + quiet.stdout


@pytest.mark.slow
def test_a_multirun_names_each_points_overrides_before_it_runs(tmp_path: Path, taxbench_cli) -> None:
    done = taxbench_cli("-m", "cluster=inprocess", "experiment.order_seed=0,1", *TINY_RUN, "experiment.name=sweep",
                        f"experiment.out_dir={tmp_path}", "cluster.setup=['export MY_TOKEN=abc123secret']",
                        cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    named = [line for line in lines if line.startswith(("point0:", "point1:"))]
    assert len(named) == 2 and "experiment.order_seed=0" in named[0] and "experiment.order_seed=1" in named[1]
    assert all("experiment.steps=4" in line and "MY_TOKEN=<redacted>" in line for line in named), named
    # Each point's line comes before that point's own summary.
    assert lines.index(named[1]) < next(i for i, line in enumerate(lines) if line.startswith("point1  "))
    assert "abc123secret" not in done.stdout + done.stderr
    # The multirun marked its sweep folder as its own: `taxbench report` takes it as a whole.
    assert (tmp_path / "sweep" / SWEEP_MARKER).is_file()
    report = taxbench_cli("report", str(tmp_path / "sweep"), cwd=tmp_path, timeout=300)
    assert report.returncode == 0 and (tmp_path / "sweep" / "sweep.csv").is_file(), report.stderr


def _imported(*args: str, cwd: Path) -> set[str]:
    """The modules `python -m taxbench <args>` imported, read from -X importtime (the command itself, not a probe)."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "taxbench", *args], capture_output=True,
                          text=True, cwd=cwd, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return {line.rpartition("|")[2].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}


def test_analysis_and_help_do_not_import_torch(tmp_path: Path) -> None:
    """`taxbench analyse`, `report` and every --help read records, summaries and op tables: torch's seconds-long
    import and the launchers are not theirs to pay (building the argument parser once imported localize's
    launchers and torch)."""
    from taxbench.analysis.synthetic import SyntheticExperiment, write_experiment

    root = write_experiment(tmp_path / "exp", SyntheticExperiment(ranks=2, steps=24))
    commands = [("analyse", str(root)), ("report", str(root)), ("--help",), ("localize", "--help")]
    for args in commands:
        modules = _imported(*args, cwd=tmp_path)
        assert "taxbench.cli" in modules, args  # the probe sees the command's imports
        heavy = sorted(m for m in modules if m == "torch" or m.startswith(("torch.", "taxbench.launchers")))
        assert heavy == [], (args, heavy[:5])


def _subcommand_help(name: str, capsys: pytest.CaptureFixture[str]) -> str:
    """What `taxbench <name> --help` prints, from the module the dispatch table names."""
    module = importlib.import_module(f"taxbench.commands.{SUBCOMMANDS[name].module}")
    try:
        code = module.main(["--help"])
    except SystemExit as exc:  # argparse's --help
        code = exc.code
    assert code == 0, name
    return capsys.readouterr().out


def test_every_help_fits_80_columns_and_names_the_exit_codes(monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # a wide terminal: the help is still wrapped for 80
    texts = {"--help": main_help(), **{name: _subcommand_help(name, capsys) for name in SUBCOMMANDS}}
    for name, entry in SUBCOMMANDS.items():
        assert f"usage: taxbench {name} " in texts[name], name  # the table names the module that runs it
        assert f"  {name} {entry.usage}" in main_help(), name
    for name, text in texts.items():
        long_lines = [line for line in text.splitlines() if len(line) > 80]
        assert long_lines == [], (name, long_lines)
        assert "exit codes: 0" in text, name
    assert "schema" not in main_help() and 'eval "$(taxbench -sc install=bash)"' in main_help()
    assert "moe_1t_proxy" in main_help()  # the recipes are read from the config package


def test_the_wandb_run_folder_is_printed_whole_on_a_line_of_its_own() -> None:
    import io

    from rich.console import Console

    from taxbench.analysis.publish import _say_wandb

    folder = Path("/tmp") / ("x" * 70) / "wandb" / "offline-run-20261204_211500-abcdefgh"
    console = Console(file=io.StringIO(), width=80)
    _say_wandb([folder], console)
    lines = console.file.getvalue().splitlines()
    assert lines[-1] == str(folder) and lines[0].startswith("wandb offline")  # copied whole, never folded


def test_a_reader_that_leaves_early_is_no_failure(tmp_path: Path) -> None:
    """`taxbench analyse runs/x | head -2`: the reader closes the pipe before the summary is written; the command still
    finishes its work quietly and exits with its verdict (0 here), as `python -m taxbench --help | head` does."""
    from taxbench.analysis.synthetic import SyntheticExperiment, write_experiment

    root = write_experiment(tmp_path / "exp", SyntheticExperiment(ranks=2, steps=24))
    for args in (("analyse", str(root)), ("--help",)):
        read_end, write_end = os.pipe()
        os.close(read_end)  # the reader has gone before the first line
        try:
            done = subprocess.run([sys.executable, "-m", "taxbench", *args], stdout=write_end, stderr=subprocess.PIPE,
                                  text=True, cwd=tmp_path, timeout=120, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        finally:
            os.close(write_end)
        assert (done.returncode, done.stderr) == (0, ""), args
    assert (root / "summary.json").is_file()


def test_a_taxbench_folder_in_the_current_folder_is_named_in_one_line(tmp_path: Path) -> None:
    """`python -m taxbench` imports a `taxbench/` folder of the current folder first (as in a fresh clone)."""
    (tmp_path / "taxbench").mkdir()
    done = subprocess.run([sys.executable, "-m", "taxbench", "analyse", "runs/x"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [done.stderr.strip()] and "shadows it" in done.stderr, done.stderr
    assert f"{tmp_path / 'taxbench'} is imported as the taxbench package" in done.stderr


def test_a_subcommand_is_one_entry_of_the_table(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """An entry names the module that runs it and its line in the help; nothing else in cli.py changes."""
    from taxbench import cli

    entry = cli.Subcommand("analyse", "[overrides] -- COMMAND [ARGS...]", "e.g. run -- torchrun train.py",
                           overrides=True, section=cli.YOUR_COMMAND)
    monkeypatch.setitem(cli.SUBCOMMANDS, "run", entry)
    shown = cli.main_help()
    assert (f"{cli.YOUR_COMMAND}\n  run [overrides] -- COMMAND [ARGS...]\n" + " " * 29 + "e.g. run -- torchrun train.py"
            in shown)
    assert shown.index(cli.YOUR_COMMAND) < shown.index(cli.RESULTS)
    with pytest.raises(SystemExit) as exited:  # dispatched to the entry's module (here analyse's argparse --help)
        cli.subcommand(["run", "--help"])
    assert exited.value.code == 0 and "usage: taxbench analyse" in capsys.readouterr().out
