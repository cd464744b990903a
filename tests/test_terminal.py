"""The CLI as a person runs it: in a real (pseudo-)terminal, where rich draws live progress bars."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import run_taxbench_in_terminal


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
