"""The CLI as a person runs it: in a real (pseudo-)terminal, where rich draws live progress bars."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers import run_taxbench_in_terminal

from taxbench import exit_codes
from taxbench.analysis.synthetic import Injection, SyntheticExperiment, change_config, write_experiment


@pytest.mark.slow
def test_experiment_runs_in_a_terminal_with_a_live_progress_bar(tmp_path: Path) -> None:
    code, shown = run_taxbench_in_terminal(
        "cluster=inprocess", "experiment.steps=12", "experiment.block_steps=6", "experiment.warmup_steps=2",
        "experiment.resume_step=6", "report.wandb=false", "report.html=false", "experiment.name=tty",
        f"experiment.out_dir={tmp_path}", cwd=tmp_path, timeout=300)
    assert "Traceback" not in shown and "TypeError" not in shown, shown[-3000:]
    assert code == 0, shown[-3000:]
    assert "steps/s" in shown  # the live bar was drawn (its rate column included)
    assert (tmp_path / "tty" / "summary.json").exists()


@pytest.mark.slow
def test_the_progress_bar_keeps_counts_rate_and_eta_at_80_columns_with_the_default_name(tmp_path: Path) -> None:
    """The default experiment name (<recipe>-<date>-<time>-<random>) is long: it gives way, not the numbers."""
    code, shown = run_taxbench_in_terminal(
        "cluster=inprocess", "experiment.steps=40", "experiment.block_steps=10", "experiment.warmup_steps=2",
        "experiment.resume_step=10", "report.wandb=false", "report.html=false", f"experiment.out_dir={tmp_path}",
        cwd=tmp_path, timeout=300, columns=80)
    assert code == 0, shown[-3000:]
    frames = [re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", frame) for frame in re.split(r"[\r\n]", shown)]
    bars = [frame for frame in frames if frame.startswith("dense_tiny-") and "━" in frame]
    assert bars, shown[-3000:]
    assert all(len(frame) <= 80 for frame in bars)
    numbers = re.compile(r" \d+/\d+ +(\d+\.\d|---) steps/s (\d+:\d\d:\d\d|-:--:--)$")
    assert all(numbers.search(frame.rstrip()) for frame in bars), "\n".join(bars)
    assert any(re.search(r" 1\d+/200 +\d+\.\d steps/s \d+:\d\d:\d\d$", frame.rstrip()) for frame in bars)


def test_the_verdict_header_and_the_tax_break_between_phrases_at_80_columns(tmp_path: Path) -> None:
    """In a real terminal of 80 columns, the header, the verdict and the tax break only between their phrases, and
    the tax shows its interval by its two ends (a ratio's interval is not symmetric about the estimate)."""
    root = tmp_path / "dense_tiny-2026-12-05-11-36-08-a1b2c3d4-with-a-long-name"
    write_experiment(root, SyntheticExperiment(ranks=2, steps=12, block_steps=3, resume_step=6, cv=0.2),
                     Injection("deterministic-1", step=5, rank=1))
    change_config(root, lambda config: config["experiment"].update(calibration=False))
    code, shown = run_taxbench_in_terminal("analyse", str(root), cwd=tmp_path, timeout=300, columns=80)
    assert code == exit_codes.NOT_DETERMINISTIC, shown[-3000:]
    lines = [re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", line).rstrip() for line in shown.splitlines()]
    # Paths and commands are never folded (to be copied); everything else fits.
    assert all(len(line) <= 80 for line in lines if not line.startswith(("results", "localize"))), "\n".join(lines)
    text = "\n".join(lines)
    header = next(i for i, line in enumerate(lines) if line.startswith(root.name))
    assert lines[header] == f"{root.name}  synthetic | 2 ranks" and lines[header + 1] == "cuda", text
    verdict = next(i for i, line in enumerate(lines) if line.startswith("verdict"))
    assert lines[verdict].split(maxsplit=1)[1] == "deterministic: NO", text
    assert lines[verdict + 1].strip() == "(repeatability differs first at step 5, rank 1, params)", text
    tax = next(line for line in lines if line.startswith("tax"))
    assert re.fullmatch(r"tax +inconclusive: [+-]\d+\.\d\d% \(95% CI [+-]\d+\.\d\d% to [+-]\d+\.\d\d%: spans zero\);",
                        tax), text
