"""`taxbench localize` on two runs of `taxbench run -- COMMAND`: the recorded command is replayed with the probe
capturing the first differing step, down the ladder, until an op or a parameter is named (slow: real torchrun)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

DDP = str(Path(__file__).parent / "user_programs" / "ddp_train.py")
ENV = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": ""}


def _taxbench(cwd: Path, *args: str, timeout: int = 400) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "taxbench", *args], capture_output=True, text=True, cwd=cwd,
                          env=ENV, timeout=timeout)


@pytest.fixture(scope="module")
def experiment(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Both arms racing index_put_ (accumulate) in the backward of a gather, which only the deterministic policy
    fixes; the deterministic arm also mixes os.urandom into a weight after step 2's optimizer step."""
    out = tmp_path_factory.mktemp("localize")
    result = _taxbench(out, "run", f"experiment.out_dir={out}", "experiment.name=job", "report.wandb=false",
                       "report.html=false", "run.timeout_s=180", "run.deterministic.args=[--urandom-step,2]", "--",
                       sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", DDP, "--steps", "4",
                       "--scatter-add")
    assert result.returncode == 3, result.stdout + result.stderr
    return out / "job"


def _localize(experiment: Path, run_a: str, run_b: str) -> dict:
    result = _taxbench(experiment, "localize", str(experiment / run_a), str(experiment / run_b), "--json")
    assert result.returncode == 3, result.stdout + result.stderr
    return json.loads(result.stdout)


@pytest.mark.slow
def test_localize_names_the_racing_op_of_the_users_backward(experiment: Path) -> None:
    found = _localize(experiment, "baseline-0", "baseline-1")
    assert found["verdict"] == "named"
    assert [step["rung"] for step in found["path"]] == [1, 2, 3]
    origin = found["origin"]
    assert origin["kind"] == "op" and origin["name"].startswith("aten.index_put") and origin["step"] == 1
    assert origin["scope"].endswith("/backward")


@pytest.mark.slow
def test_localize_names_the_parameter_the_users_code_changed_between_steps(experiment: Path) -> None:
    found = _localize(experiment, "deterministic-0", "deterministic-1")
    assert found["verdict"] == "named" and found["first_mismatch"]["step"] == 3
    origin = found["origin"]
    assert (origin["kind"], origin["name"], origin["scope"], origin["step"]) == (
        "parameter", "module.table", "start of step", 3)
    assert len(found["path"]) == 1  # rung 1 named it: no deeper replay
    replay = Path(found["path"][0]["trace_a"])
    steps = [json.loads(line)["step"] for line in (replay / "steps.rank0.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]  # the command ended once its step 3 was captured
