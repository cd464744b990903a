"""An experiment folder written before the typed run-folder contract (taxbench/rundir/) reads as it did then.

tests/fixtures/v1_inprocess was written by `python -m taxbench cluster=inprocess experiment.steps=12
experiment.block_steps=4 experiment.warmup_steps=2 experiment.resume_step=6 recipe.global_batch_size=4
recipe.model.d_model=32 recipe.model.d_ff=64 recipe.model.seq_len=16` at commit a02d12d, before the manifest, stop,
cost and step-record formats became typed models; its summary.json is what that code computed. Analysing it now must
give the same verdicts, figures and exit code.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from helpers import run_taxbench

FIXTURE = Path(__file__).parent / "fixtures" / "v1_inprocess"
# What the analysis measures of itself, or where it reads from: not part of the verdict or the figures.
LIVE = {"root", "code"}
LIVE_COST = {"wall_s", "seconds.analysis", "share"}


def _without_live(summary: dict[str, Any]) -> dict[str, Any]:
    kept = {key: value for key, value in summary.items() if key not in LIVE}
    cost = dict(kept["cost_split"])
    for dotted in LIVE_COST:
        if "." in dotted:
            outer, inner = dotted.split(".")
            cost[outer] = {key: value for key, value in cost[outer].items() if key != inner}
        else:
            cost.pop(dotted)
    kept["cost_split"] = cost
    return kept


def test_a_folder_of_the_old_code_analyses_to_its_stored_summary(tmp_path: Path) -> None:
    root = tmp_path / FIXTURE.name
    shutil.copytree(FIXTURE, root)
    stored = json.loads((FIXTURE / "summary.json").read_text())
    (root / "summary.json").unlink()

    result = run_taxbench("analyse", str(root), cwd=tmp_path, timeout=300)

    assert result.returncode == stored["exit_code"] == 0, result.stderr[-3000:]
    computed = json.loads((root / "summary.json").read_text())
    assert computed["root"] == str(root)
    assert _without_live(computed) == _without_live(stored)


def test_computing_a_result_writes_no_mirror_and_publishing_asks_for_them(tmp_path: Path) -> None:
    from taxbench.analysis.experiment import compute_experiment
    from taxbench.rundir.read import leave_mirrors

    root = tmp_path / FIXTURE.name
    shutil.copytree(FIXTURE, root)
    for mirror in root.glob("*/*.arrow"):
        mirror.unlink()
    before = sorted(path.name for path in root.rglob("*"))

    computed = compute_experiment(root).summary
    assert sorted(path.name for path in root.rglob("*")) == before  # reading and computing wrote nothing

    leave_mirrors(root)  # the step of its own that `taxbench analyse` and a launch's report take
    assert {path.name for path in (root / "baseline-0").glob("*.arrow")} == {"steps.arrow", "steps.rank0.arrow"}
    assert compute_experiment(root).summary.verdicts == computed.verdicts
