"""benchmarks/rank_build.py, scaled down: a rank of a pp x ep x FSDP2 world built through the trainer's path on a fake
process group holds its stage's share (as the plan counts it), never the whole model, and bad input is one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import compose_typed

from taxbench.workloads import build_model

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "rank_build.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600)


def test_each_rank_holds_its_share_within_the_plan() -> None:
    result = _run("+recipe=moe_1t_proxy", "cluster.gpus=8", "recipe.global_batch_size=16", "--ranks", "0,7")
    assert result.returncode == 0, result.stderr
    rows = {int(line.split()[0]): line.split() for line in result.stdout.splitlines() if line.split()[:1] in
            (["0"], ["7"])}
    assert set(rows) == {0, 7} and rows[0][1] == "0" and rows[7][1] == "1"  # rank 7 holds the last stage
    cfg = compose_typed("+recipe=moe_1t_proxy")
    whole = sum(p.numel() for p in build_model(cfg.recipe.model, deterministic_kernels=True).parameters())
    for row in rows.values():
        params, ratio = int(row[2].replace(",", "")), float(row[8])
        assert 0 < params < whole / 3  # a stage's experts sliced over ep and its layers sharded over dp
        assert 0.9 <= ratio <= 1.1
    assert "ok: every rank within 10% of the plan" in result.stdout


def test_a_rank_outside_the_world_is_one_line_exit_2() -> None:
    result = _run("+recipe=moe_1t_proxy", "cluster.gpus=8", "recipe.global_batch_size=16", "--ranks", "8")
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "outside the world" in result.stderr
