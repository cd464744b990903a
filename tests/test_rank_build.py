"""benchmarks/rank_build.py, scaled down: a rank of a pp x ep x FSDP2 world built through the trainer's path on a fake
process group holds its stage's share (as the plan counts it), never the whole model, and bad input is one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import compose_typed

from taxbench.workloads import build_model

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "rank_build.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600)


@pytest.mark.slow  # over 10 s: a real multi-process or CLI run (the fast tier stays under 8 min)
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


@pytest.mark.slow  # over 10 s: a real multi-process or CLI run (the fast tier stays under 8 min)
def test_each_rank_checkpoints_and_restores_only_its_share(tmp_path: Path) -> None:
    """Bytes written, hash/verify/restore times per rank; a restore reads what its rank wrote, not the model."""
    wider = ("recipe.model.d_model=256", "recipe.model.d_ff=512", "recipe.model.moe_d_ff=512")  # tensors of KiB+
    result = _run("+recipe=moe_1t_proxy", "cluster.gpus=8", "recipe.global_batch_size=16", *wider, "--ranks", "0,7",
                  "--checkpoint", str(tmp_path / "ckpt"))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    table = lines.index(next(line for line in lines if line.startswith("checkpoint of each rank's share")))
    rows = {int(line.split()[0]): [float(v) for v in line.split()[1:]] for line in lines[table + 2:table + 4]}
    assert set(rows) == {0, 7}
    built = {int(line.split()[0]): float(line.split()[6]) for line in lines if line.split()[:1] in (["0"], ["7"])
             and len(line.split()) == 11}  # held MiB: weights + grads + optimizer state
    for rank, (size, write, sha256, verify, xxh3, load, read, ratio) in rows.items():
        # The checkpoint holds the rank's weights and optimizer state (no grads): about 3/4 of what it holds.
        assert 0.7 * built[rank] < size < 0.85 * built[rank]
        assert min(write, sha256, verify, xxh3, load) >= 0
        assert read == pytest.approx(size * ratio, rel=0.01) and ratio <= 1.1
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())  # deleted afterwards


def test_a_rank_outside_the_world_is_one_line_exit_2() -> None:
    result = _run("+recipe=moe_1t_proxy", "cluster.gpus=8", "recipe.global_batch_size=16", "--ranks", "8")
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "outside the world" in result.stderr
