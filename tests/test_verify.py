"""taxbench verify and taxbench certificate: a later rerun checked bitwise against a stored deterministic run.

The fast tests use a real tiny experiment run in this process as the reference, and real copies of its run folder as
"reruns" (conclude compares whatever deterministic-0 an experiment folder holds), so the verdicts come from real records
without launching. The slow tests run `python -m taxbench verify` end to end: reruns through the local launcher (and
through the localhost Slurm, where one is reachable).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import socket
import stat
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import compose_raw, run_schedule, run_taxbench, tiny_config
from submitit.slurm.test_slurm import mocked_slurm
from test_slurm import needs_slurm

from taxbench import exit_codes
from taxbench.commands.verify import (
    SUMMARY_FILE,
    VerifyError,
    VerifySettings,
    certificate_command,
    conclude,
    load_reference,
    plan_rerun,
    rerun_config,
)
from taxbench.commands.verify_cli import main as run_verify_command
from taxbench.launchers import slurm
from taxbench.rundir.certificate import HASH_KEY, CertificateError, _content_hash, read_certificate
from taxbench.rundir.records import steps_file

STEPS = 6


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A complete tiny experiment (one in-process rank, 6 steps): the reference every fast test checks against."""
    root = tmp_path_factory.mktemp("verify") / "ref"
    run_schedule(tiny_config(f"experiment.steps={STEPS}", "experiment.resume_step=3", "experiment.warmup_steps=1",
                             name="ref"), root)
    return root


@pytest.fixture(scope="module")
def certificate(reference: Path) -> Path:
    out = reference.parent / "ref.cert"
    assert certificate_command(reference, out) == exit_codes.OK
    return out


def as_rerun(reference: Path, where: Path) -> Path:
    """A copy of the reference experiment folder: a "rerun" that holds the very same deterministic-0."""
    root = where / "rerun"
    shutil.copytree(reference / "deterministic-0", root / "deterministic-0")
    return root


def edit_record(run_dir: Path, step: int, metric: str, value: object) -> None:
    path = steps_file(run_dir, 0)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    for record in records:
        if record["step"] == step:
            record[metric] = value
    path.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records))
    path.with_suffix(".arrow").unlink(missing_ok=True)


def test_certificate_holds_every_step_and_rank_and_compares_identical(reference: Path, certificate: Path,
                                                                      tmp_path: Path) -> None:
    cert = read_certificate(certificate)
    assert (cert.steps, cert.world_size, cert.experiment) == (STEPS, 1, "ref")
    assert cert.essentials["stack"]["hostnames"] == [socket.gethostname()]
    result = conclude(load_reference(certificate), as_rerun(reference, tmp_path))
    assert result.exit_code == exit_codes.OK and result.verdict.compared_steps == STEPS
    saved = json.loads((tmp_path / "rerun" / SUMMARY_FILE).read_text())
    assert saved["outcome"] == "identical" and saved["rerun"]["hostnames"] == saved["reference"]["hostnames"]


def test_a_hand_edited_certificate_is_refused_never_passed(certificate: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    stored = json.loads(certificate.read_text())
    stored["fingerprints"]["0"]["params"][1] = "0" * 16  # step 2's parameters, edited by hand
    edited = tmp_path / "edited.cert"
    edited.write_text(json.dumps(stored))
    with pytest.raises(CertificateError, match="content_sha256 does not match"):
        read_certificate(edited)
    # Damaged evidence, exit 4 as everywhere (docs/records-and-trust.md), through verify and through the command line.
    with pytest.raises(SystemExit) as exited:
        run_verify_command([str(edited)])
    assert exited.value.code == exit_codes.INCOMPLETE
    assert "edited or damaged" in capsys.readouterr().err
    done = run_taxbench("verify", str(edited), cwd=tmp_path)
    assert done.returncode == exit_codes.INCOMPLETE and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith(f"taxbench: error: {edited}: content_sha256 does not match"), done.stderr


@pytest.mark.parametrize(("damage", "reseal", "code"), [
    (lambda stored: stored.update(config_sha256="0" * 64), False, exit_codes.INCOMPLETE),  # edited, not resealed
    (lambda stored: stored["fingerprints"].pop("0"), True, exit_codes.INCOMPLETE),  # resealed, a rank's grid gone
    (lambda stored: stored.update(format_version=99), False, exit_codes.CONFIG_ERROR),  # no format this one reads
])
def test_a_damaged_certificate_is_damaged_evidence_and_another_format_is_bad_input(
        certificate: Path, tmp_path: Path, damage: Callable[[dict], object], reseal: bool, code: int) -> None:
    stored = json.loads(certificate.read_text())
    damage(stored)
    if reseal:
        stored[HASH_KEY] = _content_hash({k: v for k, v in stored.items() if k != HASH_KEY})
    damaged = tmp_path / "damaged.cert"
    damaged.write_text(json.dumps(stored))
    with pytest.raises(CertificateError) as raised:
        read_certificate(damaged)
    assert raised.value.exit_code == code


def test_an_edit_with_a_recomputed_hash_fails_at_the_edited_step(reference: Path, certificate: Path,
                                                                 tmp_path: Path) -> None:
    """A forger who recomputes the hash gets past the check, but never a pass: the edited step differs."""
    stored = json.loads(certificate.read_text())
    stored["fingerprints"]["0"]["grads"][3] = "0" * 16  # step 4
    stored[HASH_KEY] = _content_hash({k: v for k, v in stored.items() if k != HASH_KEY})
    forged = tmp_path / "forged.cert"
    forged.write_text(json.dumps(stored))
    result = conclude(load_reference(forged), as_rerun(reference, tmp_path))
    assert result.exit_code == exit_codes.NOT_DETERMINISTIC
    first = result.verdict.first_mismatch
    assert first is not None and (first.step, first.rank, first.metric) == (4, 0, "grads")


def test_a_different_step_names_step_rank_and_metric(reference: Path, tmp_path: Path) -> None:
    rerun = as_rerun(reference, tmp_path)
    edit_record(rerun / "deterministic-0", 5, "optim", "f" * 16)
    manifest_path = rerun / "deterministic-0" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["stack"]["packages"]["torchtitan"] = "9.9.9"  # as if the rerun's environment had upgraded it
    manifest_path.write_text(json.dumps(manifest))
    result = conclude(load_reference(reference), rerun)
    assert result.exit_code == exit_codes.NOT_DETERMINISTIC
    first = result.verdict.first_mismatch
    assert first is not None and (first.step, first.rank, first.metric) == (5, 0, "optim")
    assert [key for key, _, _ in result.suspects] == ["stack.packages.torchtitan"]
    assert result.localize_command() == (f"python -m taxbench localize {reference / 'deterministic-0'} "
                                         f"{rerun / 'deterministic-0'}")


def test_a_missing_record_is_incomplete_not_identical(reference: Path, tmp_path: Path) -> None:
    rerun = as_rerun(reference, tmp_path)
    path = steps_file(rerun / "deterministic-0", 0)
    path.write_text("".join(path.read_text().splitlines(keepends=True)[:-2]))  # steps 5 and 6 lost
    path.with_suffix(".arrow").unlink(missing_ok=True)
    result = conclude(load_reference(reference), rerun)
    assert result.exit_code == exit_codes.INCOMPLETE
    assert any("5-6 missing" in problem for problem in result.verdict.problems)


def test_a_run_that_trained_on_nan_is_neither_verified_nor_certified(reference: Path, tmp_path: Path) -> None:
    # The same NaN bits in the reference and the rerun agree, and prove nothing (exit 4, as the gates say).
    diverged = tmp_path / "diverged"
    shutil.copytree(reference, diverged)
    edit_record(diverged / "deterministic-0", 4, "loss", float("nan"))
    result = conclude(load_reference(diverged), as_rerun(diverged, tmp_path))
    assert result.exit_code == exit_codes.INCOMPLETE
    assert any("loss NaN first at step 4" in problem for problem in result.verdict.problems), result.verdict.problems
    out = tmp_path / "diverged.cert"
    assert certificate_command(diverged, out) == exit_codes.INCOMPLETE and not out.exists()


def test_a_secret_the_reference_recorded_redacted_must_be_given_again(reference: Path, tmp_path: Path) -> None:
    stored = load_reference(reference)
    config = {**stored.config, "cluster": {**stored.config["cluster"], "setup": ["export HF_TOKEN=<redacted>"]}}
    with pytest.raises(VerifyError, match=r"cluster.setup\[0\] of the reference held a secret"):
        rerun_config(dataclasses.replace(stored, config=config), compose_raw(), [], VerifySettings())


def test_a_dry_run_is_no_verification(certificate: Path) -> None:
    with pytest.raises(VerifyError, match="cluster.dry_run=true runs nothing"):
        overrides = ["cluster=slurm_cpu", "cluster.cpu_ranks=1", "cluster.dry_run=true"]
        plan_rerun(load_reference(certificate), compose_raw(*overrides), overrides, VerifySettings())


def test_only_where_and_how_may_be_overridden(certificate: Path) -> None:
    reference = load_reference(certificate)
    allowed = ["cluster=slurm_cpu", "cluster.cpu_ranks=1", "cluster.threads_per_rank=2", "cluster.time_min=5",
               "experiment.out_dir=/tmp/elsewhere", "experiment.steps=4"]
    config = rerun_config(reference, compose_raw(*allowed), allowed, VerifySettings())
    assert config["cluster"]["launcher"] == "slurm" and config["cluster"]["threads_per_rank"] == 2
    assert config["recipe"] == reference.config["recipe"] and config["experiment"]["steps"] == 4
    refused = ["recipe.model.d_model=48", "experiment.order_seed=3", "cluster.threads_per_rank=2"]
    with pytest.raises(VerifyError, match="recipe.model.d_model: 32 in the reference, 48 here") as raised:
        rerun_config(reference, compose_raw(*refused), refused, VerifySettings())
    assert "experiment.order_seed" in str(raised.value) and "threads_per_rank" not in str(raised.value)
    with pytest.raises(VerifyError, match="cluster.cpu_ranks"):  # the world size is the recipe's
        rerun_config(reference, compose_raw("cluster=local"), ["cluster=local"], VerifySettings())


def test_avoid_reference_nodes_excludes_them_from_the_slurm_job(certificate: Path, tmp_path: Path) -> None:
    reference = load_reference(certificate)
    overrides = ["cluster=slurm_cpu", "cluster.cpu_ranks=1", f"experiment.out_dir={tmp_path}",
                 "+cluster.sbatch_args.exclude=spare7"]
    cfg = plan_rerun(reference, compose_raw(*overrides), overrides, VerifySettings(avoid_reference_nodes=True))
    assert cfg.cluster.sbatch_args["exclude"] == f"spare7,{socket.gethostname()}"
    with mocked_slurm():
        script = slurm.make_executor(cfg, tmp_path)._make_submission_file_text("python -c pass", "uid")
    assert f"--exclude=spare7,{socket.gethostname()}" in script
    with pytest.raises(VerifyError, match="add cluster=slurm"):
        plan_rerun(reference, compose_raw(), [], VerifySettings(avoid_reference_nodes=True))


# --- end to end: python -m taxbench verify reruns for real ----------------------------------------------------------
REFERENCE = ["experiment.steps=20", "experiment.resume_step=10", "experiment.warmup_steps=2",
             "experiment.block_steps=5", "experiment.checkpoint_every_steps=0", "report.wandb=false",
             "report.html=false"]


def run_ok(*args: str, cwd: Path, code: int = 0) -> str:
    done = run_taxbench(*args, cwd=cwd)
    assert done.returncode == code, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.parametrize(("args", "expected"), [
    (["runs/a", "runs/b", "experiment.name=x"], "experiment.name names one rerun, but 2 references are verified"),
    (["runs/a", "cluster.threads_per_rank=2", "runs/b"], "'runs/b' follows the overrides; name every reference first"),
])
def test_several_references_are_refused_in_one_line_where_they_cannot_work(args: list[str], expected: str,
                                                                         tmp_path: Path) -> None:
    done = run_taxbench("verify", *args, cwd=tmp_path)
    assert done.returncode == exit_codes.CONFIG_ERROR and expected in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_verify_an_experiment_and_its_certificate_through_the_local_launcher(tmp_path: Path) -> None:
    run_ok(*REFERENCE, "experiment.name=ref", cwd=tmp_path)
    out = run_ok("verify", "runs/ref", cwd=tmp_path)
    assert "identical: every fingerprint of 20 steps x 2 ranks agrees bit for bit" in out
    run_ok("certificate", "runs/ref", "-o", "ref.cert", cwd=tmp_path)
    out = run_ok("verify", "ref.cert", "experiment.steps=10", "experiment.name=short", cwd=tmp_path)
    assert "the reference has 20 steps and the rerun 10: compared the 10 steps both have" in out
    assert "identical: every fingerprint of 10 steps x 2 ranks" in out
    saved = json.loads((tmp_path / "runs" / "short" / SUMMARY_FILE).read_text())
    assert saved["reference"]["hostnames"] == saved["rerun"]["hostnames"] == [socket.gethostname()]


@pytest.mark.slow
def test_moe_tiny_with_more_threads_differs_and_names_the_thread_count(tmp_path: Path) -> None:
    """moe_tiny's MoE combine reduces in another order with 2 threads: its deterministic bits depend on the count."""
    run_ok("+recipe=moe_tiny", "cluster.threads_per_rank=1", "experiment.steps=4", "experiment.resume_step=2",
           "experiment.warmup_steps=1", "experiment.checkpoint_every_steps=0", "report.wandb=false",
           "report.html=false", "experiment.name=moe", cwd=tmp_path)
    out = run_ok("verify", "runs/moe", "cluster.threads_per_rank=2", cwd=tmp_path, code=exit_codes.NOT_DETERMINISTIC)
    assert "differs: first at step 1, rank 0, metric" in out
    assert "cluster.threads_per_rank: 1 -> 2" in out and "timing.torch_threads: 1 -> 2" in out
    assert "python -m taxbench localize runs/moe/deterministic-0 runs/verify-moe-" in out


@pytest.mark.slow
@needs_slurm
def test_verify_a_certificate_through_slurm(tmp_path: Path) -> None:
    run_ok(*REFERENCE, "experiment.name=ref", cwd=tmp_path)
    run_ok("certificate", "runs/ref", "-o", "ref.cert", cwd=tmp_path)
    out = run_ok("verify", "ref.cert", "cluster=slurm_cpu", "experiment.name=onslurm", cwd=tmp_path)
    assert "identical: every fingerprint of 20 steps x 2 ranks" in out
    assert (tmp_path / "runs" / "onslurm" / slurm.JOB_FILE).exists()
    # Several references: one submission, a job array with a task per rerun, each compared on its own.
    out = run_ok("verify", "ref.cert", "runs/ref", "cluster=slurm_cpu", cwd=tmp_path)
    assert "verified 2 references:" in out and out.count("identical: every fingerprint of 20 steps x 2 ranks") == 2
    job_files = sorted((tmp_path / "runs").glob(f"verify-*/{slurm.JOB_FILE}"))
    jobs = [json.loads(path.read_text())["job_id"] for path in job_files]
    assert len(jobs) == 2 and {job.partition("_")[0] for job in jobs} == {jobs[0].partition("_")[0]}, jobs
    assert sorted(job.partition("_")[2] for job in jobs) == ["0", "1"]
    array = jobs[0].partition("_")[0]
    first = next(path.parent for path in job_files if path.parent.name.endswith("-1"))
    script = first / ".submitit" / array / f"{array}_submission.sh"  # the array's one sbatch script, owner only
    assert script.is_file() and stat.S_IMODE(script.stat().st_mode) == 0o600
    attempt = json.loads((first / "deterministic-0" / "manifest.json").read_text())["attempts"][-1]
    assert attempt["slurm_array_job"] == json.loads((first / slurm.JOB_FILE).read_text())["job_id"]
