"""The command line as a person uses it: shell completion, diagnostics' verbosity, multirun output."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from taxbench.cli import SUBCOMMANDS
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


def test_analysis_does_not_import_torch() -> None:
    """`taxbench analyze` and sweeps read records, summaries and op tables: torch's ~2 s import is not theirs to pay."""
    probe = ("import sys, taxbench.cli, taxbench.analysis.publish, taxbench.analysis.sweep; "
             "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
