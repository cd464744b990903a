"""Slurm through submitit, against a real Slurm on localhost (scripts/slurm_localhost.sh up; .ci/run starts it).

The sbatch-script and submission tests need no Slurm: they run under submitit's mocked Slurm (no srun or sbatch is
called). The others submit real 2-task gloo jobs through the code users run, preempt
(requeue) one and cancel one, and check results, records and verdicts; and `taxbench run cluster=slurm` runs a user's
torchrun script as every run of its pairs inside one job. Without a reachable Slurm they are skipped.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import submitit
from helpers import compose_config, compose_raw, run_taxbench
from hydra.core.utils import JobReturn, JobStatus
from submitit.slurm.test_slurm import mocked_slurm

from taxbench.analysis.summary import analyse
from taxbench.checkpoint.store import RunCheckpoints
from taxbench.commands.run import compose_config as compose_command_config
from taxbench.config.schema import ConfigError, validate
from taxbench.design import ALL_RUNS
from taxbench.launchers import slurm
from taxbench.launchers.multirun import MultirunReport
from taxbench.launchers.outcome import Launched, Queued

TINY = [
    "experiment.steps=12",
    "experiment.block_steps=6",
    "experiment.warmup_steps=2",
    "experiment.resume_step=6",
    "experiment.checkpoint_every_steps=6",  # a checkpoint at every block boundary, for the preemption tests
    "cluster.cpu_ranks=2",
    "cluster.threads_per_rank=1",
]
# Enough work per step that a preemption signal lands while the experiment is still running.
SLOWER_MODEL = ["recipe.model.d_model=128", "recipe.model.d_ff=512", "recipe.model.seq_len=128"]


def slurm_unreachable_reason() -> str | None:
    if not os.environ.get("SLURM_CONF"):
        return "no Slurm: SLURM_CONF is unset (start one with `eval \"$(scripts/slurm_localhost.sh up)\"`)"
    missing = [tool for tool in ("sinfo", "sbatch", "srun", "squeue") if shutil.which(tool) is None]
    if missing:
        return f"no Slurm: {', '.join(missing)} not on PATH"
    try:
        probe = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired:
        return f"no Slurm: sinfo timed out (SLURM_CONF={os.environ['SLURM_CONF']})"
    if probe.returncode != 0 or not probe.stdout.strip():
        return f"no Slurm reachable with SLURM_CONF={os.environ['SLURM_CONF']}: {probe.stderr.strip()[:200]}"
    return None


UNREACHABLE = slurm_unreachable_reason()
needs_slurm = pytest.mark.skipif(UNREACHABLE is not None, reason=UNREACHABLE or "")


def sbatch_script(overrides: list[str], root: Path) -> str:
    cfg = compose_config(*["experiment.name=x", *overrides])
    with mocked_slurm():  # submitit's executor refuses to exist where srun is missing
        executor = slurm.make_executor(cfg, root)
    return executor._make_submission_file_text("python -c pass", "uid")


def step_lines(run_dir: Path) -> dict[int, list[dict[str, Any]]]:
    """Per rank: the records in file order."""
    out = {}
    for file in sorted(run_dir.glob("steps.rank*.jsonl")):
        rank = int(file.name.split(".")[1].removeprefix("rank"))
        out[rank] = [json.loads(line) for line in file.read_text().splitlines() if line.strip()]
    return out


def assert_each_step_once(root: Path, steps: int) -> None:
    for ref in ALL_RUNS:
        for rank, records in step_lines(root / ref.name).items():
            assert [r["step"] for r in records] == list(range(1, steps + 1)), (ref.name, rank)


FINGERPRINTS = ("loss_bits", "grads", "grad_norm_bits", "params", "optim")


def wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(0.2)


# --- the generated sbatch script (no Slurm needed) ---------------------------------------------------------------


def test_gpu_sweep_point_asks_for_one_task_per_gpu(tmp_path: Path) -> None:
    script = sbatch_script(
        ["cluster=slurm", "cluster.gpus=2432", "cluster.gpus_per_node=8", "recipe.global_batch_size=9728",
         "recipe.micro_batch_size=4", "cluster.partition=gpu", "cluster.account=proj", "cluster.qos=high",
         "cluster.constraint=h100", "cluster.time_min=90", "+cluster.sbatch_args.exclusive=true",
         "cluster.setup=[module load cuda]"],
        tmp_path,
    )
    for line in ("--nodes=304", "--ntasks-per-node=8", "--gpus-per-node=8", "--partition=gpu", "--account=proj",
                 "--qos=high", "--constraint=h100", "--time=90", "--exclusive", "--cpus-per-task=8",
                 "module load cuda"):
        assert line in script, line
    assert str(tmp_path / ".submitit") in script


def test_cpu_job_has_cpu_ranks_tasks_and_no_gpus(tmp_path: Path) -> None:
    script = sbatch_script(["cluster=slurm_cpu", "cluster.cpu_ranks=4", "recipe.global_batch_size=16"], tmp_path)
    assert "--ntasks-per-node=4" in script and "--nodes=1" in script
    assert "gpus" not in script


def test_gpu_count_not_a_multiple_of_gpus_per_node_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cluster.gpus=12 is not a multiple of cluster.gpus_per_node=8"):
        sbatch_script(["cluster=slurm", "cluster.gpus=12", "recipe.global_batch_size=48"], tmp_path)


def test_loopback_master_on_several_nodes_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cluster.master_addr=slurm"):
        sbatch_script(["cluster=slurm", "cluster.gpus=16", "cluster.master_addr=127.0.0.1",
                       "recipe.global_batch_size=64"], tmp_path)


SETUP_SECRETS = {
    "export MYPASS=hunter2-setup": "hunter2-setup",
    'curl -H "Authorization: Bearer bearer-tok-42" https://example.com': "bearer-tok-42",
}


def test_submission_is_private_and_warns_about_secrets_in_setup(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    setup = ",".join(f"'{line}'" for line in SETUP_SECRETS)
    cfg = compose_config("cluster=slurm_cpu", f"experiment.out_dir={tmp_path}", "experiment.name=s",
                                    f"cluster.setup=[module load cuda,{setup}]")
    root = tmp_path / "s"
    with mocked_slurm() as mock:
        mock.known_cmds.append("sbatch")
        job = slurm.submit(cfg, root)
    folder = root / ".submitit"
    assert folder.stat().st_mode & 0o777 == 0o700
    assert job.paths.folder.stat().st_mode & 0o777 == 0o700
    script = job.paths.submission_file
    assert script.stat().st_mode & 0o777 == 0o600 and job.paths.submitted_pickle.stat().st_mode & 0o777 == 0o600
    text = script.read_text()
    assert all(line in text for line in SETUP_SECRETS)  # the job needs its real setup lines
    pickled = job.paths.submitted_pickle.read_bytes()
    assert not any(secret.encode() in pickled for secret in SETUP_SECRETS.values())  # the tasks do not
    err = capsys.readouterr().err
    for number in (2, 3):
        assert (f"cluster.setup line {number} looks like it holds a secret; it is copied into the job script "
                f"{script}") in err
    assert "cluster.setup line 1 " not in err and "pass secrets through the job's environment instead" in err


def test_submitit_dir_is_made_private_too(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    cfg = compose_config("cluster=slurm_cpu", f"experiment.out_dir={tmp_path}", "experiment.name=d",
                                    f"cluster.submitit_dir={shared}")
    with mocked_slurm() as mock:
        mock.known_cmds.append("sbatch")
        job = slurm.submit(cfg, tmp_path / "d")
    assert shared.stat().st_mode & 0o777 == 0o700 and job.paths.folder.parent == shared


def test_a_multirun_point_is_queued_as_a_value_that_the_sweeps_end_waits_for(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    overrides = ["cluster=slurm_cpu", f"experiment.out_dir={tmp_path}", "experiment.name=q"]
    cfg = compose_config(*overrides)
    root = tmp_path / "q"
    with mocked_slurm() as mock:
        mock.known_cmds.append("sbatch")
        queued = slurm.launch_slurm(cfg, root, block=False)
        assert isinstance(queued, Queued) and queued.launched == Launched(root, cfg.report)
        assert queued.job.job_id == json.loads((root / slurm.JOB_FILE).read_text())["job_id"]
        assert not hasattr(slurm, "SUBMITTED")  # no queue kept in the module: the point returns it

        # Hydra hands the point's return value to the multirun callback, which publishes it at the sweep's end.
        callback = MultirunReport()
        callback.on_job_end(compose_raw(*overrides), JobReturn(status=JobStatus.COMPLETED, _return_value=queued))
        assert callback.queued == [queued]
        mock.set_job_state(queued.job.job_id, "FAILED")
        for task in queued.job._sub_jobs:
            task._results_timeout_s = 0  # no result file is coming: do not wait for a slow file system
        callback.on_multirun_end(compose_raw(*overrides))
    assert callback.queued == []
    assert f"Slurm job {queued.job.job_id} for {root} ended without results (state FAILED)" in caplog.text


def test_cli_without_slurm_is_refused_in_one_line(tmp_path: Path) -> None:
    # Only the interpreter's folder on PATH: no sbatch, whether or not this machine has Slurm.
    done = run_taxbench("cluster=slurm_cpu", f"experiment.out_dir={tmp_path}", "experiment.name=n", cwd=tmp_path,
                        timeout=120, env={"PATH": str(Path(sys.executable).parent)})
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines() == [
        "taxbench: error: cluster=slurm needs a reachable Slurm (sbatch not found on PATH); run from a Slurm login "
        "node, or use cluster=local / cluster=inprocess on this machine"
    ]


def test_missing_submitit_gives_install_hint(tmp_path: Path) -> None:
    # A real interpreter where submitit cannot be imported (a None entry in sys.modules blocks the import).
    code = (
        "import sys; sys.modules['submitit'] = None\n"
        "from taxbench.cli import main\n"
        f"sys.argv = ['taxbench', 'cluster=slurm_cpu', 'experiment.out_dir={tmp_path}']\n"
        "main()\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "pip install 'taxbench[slurm]'" in done.stderr


# --- dry run: the plan, the job and its sbatch script, nothing submitted (no Slurm needed) ------------------------

NO_SLURM_PATH = {"PATH": str(Path(sys.executable).parent)}  # only the interpreter's folder: no sbatch, no srun


def test_dry_run_writes_the_script_a_submission_would_write(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    overrides = ["cluster=slurm_cpu", f"experiment.out_dir={tmp_path}", "experiment.name=d", "cluster.partition=debug",
                 "cluster.account=proj", "cluster.setup=[module load cuda,'export MYPASS=hunter2-setup']"]
    cfg = compose_config(*overrides, "cluster.dry_run=true")
    root = tmp_path / "d"
    script = slurm.dry_run_slurm(cfg, root)  # no mocked Slurm: a dry run needs neither srun nor sbatch

    assert script == root / slurm.DRY_RUN_DIR / slurm.DRY_RUN_SCRIPT
    assert script.stat().st_mode & 0o777 == 0o600 and script.parent.stat().st_mode & 0o777 == 0o700
    assert sorted(p.name for p in root.iterdir()) == [slurm.DRY_RUN_DIR]  # no .submitit, no job file
    out, err = capsys.readouterr()
    for line in ("taxbench: Slurm dry run: nothing submitted", "size: 1 node x 2 tasks per node (CPU ranks)",
                 "time limit: 60 min", "partition: debug", "account: proj", f"sbatch script: {script}"):
        assert line in out, line
    assert f"cluster.setup line 2 looks like it holds a secret; it is copied into the job script {script}" in err

    # The very script a submission hands to sbatch (submitted here to submitit's mocked Slurm).
    cfg = compose_config(*overrides)
    with mocked_slurm() as mock:
        mock.known_cmds.append("sbatch")
        job = slurm.submit(cfg, root)
    assert script.read_text() == job.paths.submission_file.read_text()


def test_moe_1t_dry_run_on_2432_gpus_prints_plan_and_job_and_writes_the_script(tmp_path: Path) -> None:
    done = run_taxbench("+recipe=moe_1t", "cluster=slurm", "cluster.gpus=2432", "cluster.dry_run=true",
                        "cluster.partition=gpu", f"experiment.out_dir={tmp_path}", "experiment.name=t", cwd=tmp_path,
                        timeout=300, env=NO_SLURM_PATH)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    root = tmp_path / "t"
    script = root / slurm.DRY_RUN_DIR / slurm.DRY_RUN_SCRIPT
    for line in ("parameters: 985,328,009,216", "layout: valid - tp=1 x pp=16 x dp=152 = 2432 GPUs",
                 "per-GPU memory estimate", "size: 304 nodes x 8 GPUs = 2432 GPUs, 8 tasks per node",
                 "8 CPUs per task", "time limit: 240 min", "partition: gpu", f"sbatch script: {script}",
                 "GPU-hours", "timed: ", "(cluster.planned_mfu, an assumption"):
        assert line in done.stdout, line
    text = script.read_text()
    for line in ("#SBATCH --nodes=304", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --cpus-per-task=8", "#SBATCH --time=240", "#SBATCH --partition=gpu",
                 f"-m submitit.core._submit {root / '.submitit'}/%j"):
        assert line in text, line
    # Nothing submitted: no submitit folder, no job file, no runs; only the script (and the folder's lock file).
    assert sorted(p.name for p in root.iterdir()) == [".taxbench.lock", slurm.DRY_RUN_DIR]


@pytest.mark.parametrize(("overrides", "problems"), [
    (["cluster.gpus=1000"], ["world size 1000 is not divisible by tp*pp = 1*16 = 16"]),
    (["cluster.gpus=2432", "recipe.parallel.ep=7", "recipe.model.n_layers=60"],
     ["is not divisible by recipe.parallel.ep=7", "recipe.model.n_experts=256 is not divisible",
      "recipe.model.n_layers=60 is not divisible by"]),
])
def test_dry_run_of_an_impossible_layout_exits_2_listing_every_problem(tmp_path: Path, overrides: list[str],
                                                                      problems: list[str]) -> None:
    out_dir = tmp_path / "runs"
    done = run_taxbench("+recipe=moe_1t", "cluster=slurm", "cluster.dry_run=true", *overrides,
                        f"experiment.out_dir={out_dir}", cwd=tmp_path, timeout=300, env=NO_SLURM_PATH)
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("taxbench: error: ")
    assert all(problem in line for problem in problems), line
    assert not out_dir.exists()


def test_dry_run_outside_slurm_is_refused_in_one_line(tmp_path: Path) -> None:
    done = run_taxbench("cluster.dry_run=true", f"experiment.out_dir={tmp_path}", "experiment.name=l", cwd=tmp_path,
                        timeout=120)
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stderr.strip().splitlines() == [
        "taxbench: error: cluster.dry_run=true writes a Slurm job script without submitting it, but cluster=local "
        "runs here; use cluster=slurm with it, or plan=true for the plan without running"
    ]
    assert not (tmp_path / "l").exists()


# --- taxbench run -- COMMAND under cluster=slurm (no Slurm needed) ------------------------------------------------

USER_DDP = Path(__file__).parent / "user_programs" / "ddp_train.py"


def run_command_under_slurm(tmp_path: Path, *overrides: str, command: list[str], timeout: float = 480,
                            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return run_taxbench("run", "cluster=slurm_cpu", f"experiment.out_dir={tmp_path}", "experiment.name=job",
                        "report.wandb=false", "report.html=false", "run.timeout_s=180", *overrides, "--", *command,
                        cwd=tmp_path, timeout=timeout, env={"WANDB_MODE": "offline", "PYTHONPATH": "", **(env or {})})


def test_taxbench_run_without_slurm_is_refused_in_one_line_before_any_folder(tmp_path: Path) -> None:
    done = run_command_under_slurm(tmp_path, command=[sys.executable, str(USER_DDP)], timeout=120, env=NO_SLURM_PATH)
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stderr.strip().splitlines() == [
        "taxbench: error: cluster=slurm needs a reachable Slurm (sbatch not found on PATH); run from a Slurm login "
        "node, or use cluster=local / cluster=inprocess on this machine"
    ]
    assert not (tmp_path / "job").exists()


def test_taxbench_run_refuses_launchers_that_start_ranks_not_a_command(tmp_path: Path) -> None:
    done = run_taxbench("run", "cluster=torchrun", f"experiment.out_dir={tmp_path / 'runs'}", "--", "true",
                        cwd=tmp_path, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "cluster=torchrun starts ranks, not a command" in done.stderr and not (tmp_path / "runs").exists()


def test_taxbench_run_composes_for_any_allocation_size() -> None:
    # The recipe only names the command: no batch rule of it refuses an allocation of 16 GPUs.
    cfg = compose_command_config(["cluster=slurm", "cluster.gpus=16"], ["torchrun", "train.py"])
    validate(cfg)
    assert cfg.recipe.name == "train" and cfg.recipe.global_batch_size == 16


def test_the_schedules_job_runs_one_driver_in_the_batch_step_of_the_whole_allocation(tmp_path: Path) -> None:
    cfg = compose_config("cluster=slurm", "cluster.gpus=16", "recipe.global_batch_size=64", "cluster.partition=gpu",
                         "cluster.time_min=90", "experiment.name=x")
    with mocked_slurm():
        executor = slurm.make_executor(cfg, tmp_path, in_batch_step=True)
    script = executor._make_submission_file_text("python -m submitit.core._submit x", "uid")
    for line in ("--nodes=2", "--ntasks-per-node=8", "--gpus-per-node=8", "--partition=gpu", "--time=90"):
        assert line in script, line
    # The driver is the batch script's command itself, as in a user's own sbatch script: no srun in front of it
    # (that would start it once per task and hold the tasks its own srun needs).
    assert "srun" not in script and "\npython -m submitit.core._submit x\n" in script


# --- real Slurm ---------------------------------------------------------------------------------------------------


@pytest.mark.slow
@needs_slurm
def test_cli_runs_the_experiment_as_one_two_task_job(tmp_path: Path) -> None:
    done = run_taxbench("cluster=slurm_cpu", f"experiment.out_dir={tmp_path}", "experiment.name=e", *TINY,
                        cwd=tmp_path, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    root = tmp_path / "e"
    job_info = json.loads((root / slurm.JOB_FILE).read_text())
    job: submitit.SlurmJob[Any] = submitit.SlurmJob(
        Path(job_info["submitit_folder"]) / "%j", job_info["job_id"], tasks=(0, 1)
    )
    results = job.results()
    assert sorted(r["rank"] for r in results) == [0, 1]
    assert all(r["restarts"] == 0 for r in results)
    summary = json.loads((root / "summary.json").read_text())
    assert summary["deterministic_ok"] and summary["world_size"] == 2
    assert_each_step_once(root, 12)


@pytest.mark.slow
@needs_slurm
def test_preempted_job_requeues_and_resumes_from_its_checkpoint_bitwise(tmp_path: Path) -> None:
    cfg = compose_config(*["cluster=slurm_cpu", f"experiment.out_dir={tmp_path}", "experiment.name=p",
                                     *TINY, *SLOWER_MODEL])
    root = tmp_path / "p"
    job = slurm.submit(cfg, root)
    job._results_timeout_s = 2
    timed = RunCheckpoints(root / "deterministic-0", 0)
    wait_until(lambda: timed.latest() is not None, 120, "the timed pair's first checkpoint")
    before = {ref.name: step_lines(root / ref.name) for ref in ALL_RUNS if (root / ref.name).exists()}
    committed = timed.latest()
    job._interrupt()  # preemption: SIGTERM then SIGUSR2; submitit requeues the job
    wait_until(lambda: job.state in ("PENDING", "REQUEUED", "REQUEUE_HOLD"), 60, "the requeue")
    subprocess.run(["scontrol", "update", f"JobId={job.job_id}", "StartTime=now"], check=True)
    results = slurm.wait(job, root)

    assert sorted(r["rank"] for r in results) == [0, 1]
    assert all(r["restarts"] >= 1 for r in results), results
    assert_each_step_once(root, cfg.experiment.steps)
    after = {ref.name: step_lines(root / ref.name) for ref in ALL_RUNS}
    for name, ranks in before.items():
        for rank, records in ranks.items():
            for old in records:
                new = after[name][rank][old["step"] - 1]
                if old["step"] <= committed:  # recorded before the checkpoint: kept exactly
                    assert new == old
                else:  # re-run after the resume: bitwise the same fingerprints as before the preemption
                    assert {k: new[k] for k in FINGERPRINTS} == {k: old[k] for k in FINGERPRINTS}
    summary = analyse(root)
    assert summary.deterministic_ok
    assert all(v.agree for v in summary.verdicts)


@pytest.mark.slow
@needs_slurm
def test_cancelled_job_fails_clearly_and_keeps_its_records(tmp_path: Path) -> None:
    cfg = compose_config(*["cluster=slurm_cpu", f"experiment.out_dir={tmp_path}", "experiment.name=c",
                                     *TINY, *SLOWER_MODEL, "experiment.steps=240"])
    # 240 steps: minutes of work left after the first checkpoint, so a cancel that a loaded machine delivers late
    # still lands before the job could finish (at 24 steps one CI run finished the experiment first).
    root = tmp_path / "c"
    job = slurm.submit(cfg, root)
    job._results_timeout_s = 2
    timed = RunCheckpoints(root / "baseline-0", 0)
    wait_until(lambda: timed.latest() is not None, 120, "the timed pair's first checkpoint")
    # scancel: SIGTERM (which submitit ignores), then SIGKILL after KillWait (1 s on the localhost cluster).
    job.cancel(check=True)
    wait_until(lambda: job.watcher.get_state(job.job_id, mode="force").startswith("CANCELLED"), 60,
               "Slurm to report the job cancelled")
    with pytest.raises(slurm.SlurmJobFailed, match=rf"Slurm job {job.job_id} .* logs: "):
        slurm.wait(job, root)
    # Everything up to the last complete checkpoint is kept; a pair that finished before the kill keeps every step.
    kept = cfg.experiment.steps if timed.finished else timed.latest()
    assert kept is not None
    for arm in ("baseline-0", "deterministic-0"):
        for rank, records in step_lines(root / arm).items():
            steps = [r["step"] for r in records]
            assert steps[:kept] == list(range(1, kept + 1)), (arm, rank)


@pytest.mark.slow
@needs_slurm
def test_an_error_an_attempt_wrote_as_it_was_requeued_is_not_the_jobs_result(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """On a busy node submitit's own `scontrol requeue` was once killed by the SIGTERM of the step it cancels, and
    the task wrote that error as its result while the job went back to pending. Here the first attempt's rank 0
    requeues the job and then raises (SIGTERM is bypassed by submitit and KillWait is 1 s, so the error is written):
    the wait must go on to the requeued attempt, whose results are the job's."""
    cfg = compose_config("cluster=slurm_cpu", f"experiment.out_dir={tmp_path}", "experiment.name=r", *TINY)
    root = tmp_path / "r"

    def requeue_then_fail_once(rank: int, *_: Any) -> None:
        if rank == 0 and os.environ.get("SLURM_RESTART_COUNT", "0") == "0":
            subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]], check=True, timeout=60)
            raise RuntimeError("the requeue's scontrol was killed")

    job = slurm.submit(cfg, root, requeue_then_fail_once)

    def requeued() -> bool:
        shown = subprocess.run(["scontrol", "show", "job", job.job_id], capture_output=True, text=True).stdout
        return "Restarts=1" in shown and "JobState=PENDING" in shown

    wait_until(requeued, 120, "the job to be requeued")

    def release_once_the_stale_error_is_met() -> None:
        # The requeued job waits for its begin time: the wait meets the first attempt's error before a second
        # attempt could replace it, and only then is the job released. (In some runs here the first attempt's error
        # never reaches its result file; the job is then released after 20 s and the wait has nothing stale to meet.)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not any("an attempt ended in an error" in m for m in caplog.messages):
            time.sleep(0.2)
        subprocess.run(["scontrol", "update", f"JobId={job.job_id}", "StartTime=now"], check=True)

    releaser = threading.Thread(target=release_once_the_stale_error_is_met, daemon=True)
    with caplog.at_level("WARNING", logger="taxbench"):
        releaser.start()
        results = slurm.wait(job, root, poll_s=0.5)
    releaser.join(timeout=10)
    assert sorted(r["rank"] for r in results) == [0, 1]
    assert all(r["restarts"] == 1 for r in results), results


@pytest.mark.slow
@needs_slurm
def test_a_slurm_multirun_queues_every_point_then_publishes_each_and_the_sweep(tmp_path: Path) -> None:
    done = run_taxbench("-m", "cluster=slurm_cpu", "experiment.order_seed=0,1", f"experiment.out_dir={tmp_path}",
                        "experiment.name=sweep", "report.wandb=false", *TINY, cwd=tmp_path, timeout=480)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    submitted = [i for i, line in enumerate(lines) if line.startswith("taxbench: submitted Slurm job")]
    waited = [i for i, line in enumerate(lines) if line.startswith("taxbench: waiting for Slurm job")]
    assert len(submitted) == 2 and len(waited) == 2 and max(submitted) < min(waited)  # all queued, then waited for
    sweep = tmp_path / "sweep"
    for point in ("point0", "point1"):  # each point published as a point that ran in the launching process is
        assert json.loads((sweep / point / "summary.json").read_text())["deterministic_ok"]
        assert (sweep / point / "report" / "report.html").is_file()
    assert (sweep / "sweep.csv").is_file()


@pytest.mark.slow
@needs_slurm
def test_taxbench_run_runs_a_torchrun_script_as_every_run_of_its_pairs_in_one_job(tmp_path: Path) -> None:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(USER_DDP), "--steps", "10"]
    done = run_command_under_slurm(tmp_path, "run.restart.save_args=[--save,{checkpoint},--save-step,5]",
                                   "run.restart.resume_args=[--resume,{checkpoint}]", command=torchrun)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    root = tmp_path / "job"
    job_id = json.loads((root / slurm.JOB_FILE).read_text())["job_id"]
    lines = done.stdout.splitlines()
    # The submitting process shows the job and relays the driver's progress from inside it.
    assert any(line.startswith(f"taxbench: submitted Slurm job {job_id} ") for line in lines)
    assert any(line.startswith(f"taxbench: Slurm job {job_id}: RUNNING on ") for line in lines)
    assert any(line.startswith("taxbench: run 6/6: deterministic-resumed (resume): ") for line in lines)
    summary = json.loads((root / "summary.json").read_text())
    outcomes = {v["gate"]: v["outcome"] for v in summary["verdicts"]}
    assert outcomes == {"repeatability": "identical", "restart_replay": "identical", "baseline_sanity": "identical"}
    assert summary["tax"]["pairs"] == 2 and summary["world_size"] == 2
    for run in ("baseline-0", "deterministic-0", "deterministic-1", "baseline-1", "deterministic-resumed"):
        manifest = json.loads((root / run / "manifest.json").read_text())
        [attempt] = manifest["attempts"]  # every run in the one job, as a recipe run's attempts record it
        assert attempt["slurm_job_id"] == job_id and attempt["hostnames"] == manifest["stack"]["hostnames"]
        assert manifest["command"]["argv"][:4] == torchrun[:4]


@pytest.mark.slow
@needs_slurm
def test_taxbench_run_whose_job_is_cancelled_says_so_in_one_line_with_its_log(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "offline"}
    process = subprocess.Popen(
        [sys.executable, "-m", "taxbench", "run", "cluster=slurm_cpu", f"experiment.out_dir={tmp_path}",
         "experiment.name=job", "report.wandb=false", "--", "sleep", "300"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = tmp_path / "job" / "baseline-0" / "command.log"
    try:
        wait_until(log.exists, 120, "the first run's command to start inside the job")
        job_id = json.loads((tmp_path / "job" / slurm.JOB_FILE).read_text())["job_id"]
        subprocess.run(["scancel", job_id], check=True)
        out, err = process.communicate(timeout=180)
    finally:
        process.kill()
    assert process.returncode == 1, out[-3000:] + err[-3000:]
    [line] = err.strip().splitlines()
    assert line.startswith(f"taxbench: error: Slurm job {job_id} ended before job finished (state CANCELLED")
    assert f"its log: {tmp_path / 'job' / '.submitit' / job_id / f'{job_id}_0_log.err'}" in line
    assert "continue with: " in line and "experiment.continue_existing=true -- sleep 300" in line
