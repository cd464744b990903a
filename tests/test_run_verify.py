"""taxbench certificate and taxbench verify on an experiment of `taxbench run -- COMMAND`: the user's command rerun
once, as its deterministic arm ran, and compared bitwise with the reference.

The slow tests share one real experiment (the user's DDP script from tests/user_programs/ under torchrun, 2 gloo
ranks, a few steps, built the way tests/test_probe.py builds its own) and one `taxbench verify` of its certificate
(a rerun of the command); edited references are concluded against a copy of that rerun, and only the script that
changed since its reference is rerun again.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_probe import DDP, _taxbench_run

from taxbench import exit_codes
from taxbench.commands.verify import certificate_command, conclude, load_reference
from taxbench.commands.verify_cli import main as run_verify_command
from taxbench.rundir.certificate import RUN_FOLDER, essentials, read_certificate
from taxbench.rundir.records import steps_file
from taxbench.rundir.run_manifest import Manifest

STEPS = 4
SECRET_NAME, SECRET = "TB_VERIFY_TOKEN", "s3cr3t-v4lue"  # an environment edit the command gets: never written down


# ------------------------------------------------------------------------------------------------ fast
def test_a_command_runs_essentials_read_its_own_folder_as_a_placeholder() -> None:
    """A rerun writes its edited config copy into its own folder: that folder is no difference between two runs."""
    def manifest(run_dir: str) -> dict:
        return {"command": {"argv": ["deepspeed", "train.py", "--deepspeed_config", f"{run_dir}/command-config.json"],
                            "cwd": "/work", "config_copy": f"{run_dir}/command-config.json", "env": {"A": "1"},
                            "edits": {"config_set": {"zero_optimization.stage": 2}}, "wall_s": 1.0,
                            "probe": {"optimizers": ["AdamW"], "loaded_processes": 3}}}

    reference = essentials(Manifest.of(manifest("/runs/job/deterministic-0")))
    rerun = essentials(Manifest.of(manifest("/runs/verify-job/deterministic-0")))
    assert reference == rerun and reference["command"]["argv"][-1] == f"{RUN_FOLDER}/command-config.json"
    assert reference["command"]["optimizers"] == ["AdamW"] and "wall_s" not in reference["command"]
    assert "command" not in essentials(Manifest.of({"config": {}}))  # a recipe run's essentials are as they were


# ------------------------------------------------------------------------------------------------ real commands
@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A `taxbench run` experiment of the user's DDP script (a copy, train.py in the command's folder: one test
    changes it later) whose deterministic arm gets a secret through the environment."""
    where = tmp_path_factory.mktemp("run-verify")
    shutil.copy(DDP, where / "train.py")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "train.py",
               "--steps", str(STEPS)]
    result = _taxbench_run(where, f"+run.deterministic.env.{SECRET_NAME}={SECRET}", command=command)
    assert result.returncode == exit_codes.INCOMPLETE, result.stdout + result.stderr  # restart replay not run
    return where / "job"


def _verify(reference: Path, *overrides: str, secret: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": ""}
    env.pop(SECRET_NAME, None)
    if secret:
        env[SECRET_NAME] = SECRET
    return subprocess.run([sys.executable, "-m", "taxbench", "verify", str(reference),
                           f"experiment.out_dir={reference.parent / 'verify'}", *overrides],
                          capture_output=True, text=True, timeout=300, env=env)


def _copy(job: Path, name: str) -> Path:
    copied = job.parent / name
    shutil.copytree(job, copied, ignore=shutil.ignore_patterns(".taxbench.lock"))
    return copied


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _write_records(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records))
    path.with_suffix(".arrow").unlink(missing_ok=True)
    (path.parent / "steps.arrow").unlink(missing_ok=True)


@pytest.fixture(scope="module")
def verified(job: Path) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """The experiment's certificate, and `taxbench verify` of it: one rerun of the command."""
    cert = job.parent / "job.cert"
    made = subprocess.run([sys.executable, "-m", "taxbench", "certificate", str(job), "-o", str(cert)],
                          capture_output=True, text=True, timeout=120)
    assert made.returncode == exit_codes.OK, made.stdout + made.stderr
    return cert, _verify(cert)


def _rerun_copy(verified: tuple[Path, subprocess.CompletedProcess[str]], where: Path) -> Path:
    """A copy of the verified rerun's experiment folder, to conclude another reference against (no new rerun)."""
    summary = Path(verified[1].stdout.rsplit("summary: ", 1)[1].strip())
    shutil.copytree(summary.parent / "deterministic-0", where / "rerun" / "deterministic-0")
    return where / "rerun"


@pytest.mark.slow
def test_the_certificate_of_a_command_reruns_it_bit_for_bit(
        verified: tuple[Path, subprocess.CompletedProcess[str]], job: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    cert, result = verified
    assert SECRET not in cert.read_text()
    read = read_certificate(cert)
    assert read.steps == STEPS and read.world_size == 2
    command = read.essentials["command"]
    assert command["argv"][-3:] == ["train.py", "--steps", str(STEPS)] and command["cwd"] == str(job.parent)
    assert command["env"] == {SECRET_NAME: "<redacted>"} and read.config["run"]["command"][-1] == str(STEPS)

    assert result.returncode == exit_codes.OK, result.stdout + result.stderr
    assert f"identical: every fingerprint of {STEPS} steps x 2 ranks agrees bit for bit" in result.stdout
    summary = json.loads(Path(result.stdout.rsplit("summary: ", 1)[1].strip()).read_text())
    assert summary["outcome"] == "identical" and summary["compared_steps"] == STEPS

    # Only where the rerun runs may change; the secret is taken from verify's environment, or the rerun is refused.
    for overrides, words in ((["run.deterministic.args=[--lr,1]"], "run.deterministic.args"),
                             (["experiment.steps=2"], "the steps the command takes"),
                             (["cluster=slurm_cpu"], "on this machine")):
        with pytest.raises(SystemExit) as refused:
            run_verify_command([str(cert), *overrides])
        assert refused.value.code == exit_codes.CONFIG_ERROR and words in capsys.readouterr().err
    unset = _verify(cert, secret=False)
    assert unset.returncode == exit_codes.CONFIG_ERROR and f"export {SECRET_NAME}" in unset.stderr
    assert "Traceback" not in unset.stderr


@pytest.mark.slow
def test_a_reference_whose_records_were_edited_differs_at_that_step(
        job: Path, verified: tuple[Path, subprocess.CompletedProcess[str]], tmp_path: Path) -> None:
    tampered = _copy(job, "tampered")
    path = steps_file(tampered / "deterministic-0", 1)
    records = _records(path)
    records[2]["params"] = "0" * 16  # step 3, rank 1
    _write_records(path, records)
    result = conclude(load_reference(tampered), _rerun_copy(verified, tmp_path))
    assert result.exit_code == exit_codes.NOT_DETERMINISTIC
    first = result.verdict.first_mismatch
    assert first is not None and (first.step, first.rank, first.metric) == (3, 1, "params")


@pytest.mark.slow
def test_a_reference_with_a_step_record_removed_is_incomplete_never_a_pass(
        job: Path, verified: tuple[Path, subprocess.CompletedProcess[str]], tmp_path: Path) -> None:
    cut = _copy(job, "cut")
    path = steps_file(cut / "deterministic-0", 0)
    _write_records(path, [r for r in _records(path) if r["step"] != 2])
    cert = tmp_path / "cut.cert"
    assert certificate_command(cut, cert) == exit_codes.INCOMPLETE and not cert.exists()
    result = conclude(load_reference(cut), _rerun_copy(verified, tmp_path))
    assert result.exit_code == exit_codes.INCOMPLETE and result.verdict.outcome == "incomplete"
    assert any("step 2" in problem for problem in result.verdict.problems), result.verdict.problems


@pytest.mark.slow
def test_a_command_that_now_plants_urandom_differs_from_its_reference(job: Path) -> None:
    """The user's script changed since the reference: it mixes os.urandom into the weights after step 2."""
    script = job.parent / "train.py"
    original = script.read_text()
    planted = original.replace('"--urandom-step", type=int, default=0', '"--urandom-step", type=int, default=2')
    assert planted != original
    script.write_text(planted)
    try:
        result = _verify(job)
    finally:
        script.write_text(original)
    assert result.returncode == exit_codes.NOT_DETERMINISTIC, result.stdout + result.stderr
    assert "differs: first at step 3, rank " in result.stdout and "suspects" in result.stdout
    assert "localize the first difference" in result.stdout
