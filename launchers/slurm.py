"""Slurm through submitit: one job per experiment, every rank of both arms inside that one allocation.

The job runs `SlurmExperiment` on each task (one task per GPU, or `cpu_ranks` tasks on CPU); each task reads its
rank from submitit's TorchDistributedEnvironment and runs the same `run_rank` as the local launcher. Both arms are
interleaved block by block inside the allocation (see taxbench.schedule.experiment), so node-to-node variation cancels.

Preemption and timeouts: Slurm signals the job (SIGUSR2, `signal_delay_s` before the time limit, or on preemption);
submitit then calls `SlurmExperiment.checkpoint` on task 0 and requeues the job. The callable holds no state: the
experiment checkpoints every run at block boundaries, and the requeued job's `Experiment.run` skips finished runs and
resumes unfinished ones from their last complete checkpoint, dropping records written after it.

Sweeps (`python -m taxbench -m ... cluster=slurm cluster.gpus=512,1024,2432`): submitit directly, not
hydra-submitit-launcher. That plugin would run the whole Hydra job (config, validation, report) inside a Slurm job
whose shape comes from the fixed `hydra.launcher` node, so the allocation could not follow `cluster.gpus` per point
and every task would run the driver. Here Hydra's basic launcher composes and validates each point on the submitting
machine, each point submits its own job sized from its own `cluster` node (both arms interleaved inside it), and
under a multirun the points are submitted without waiting: all are queued at once, each point returns its job as
a `Queued` outcome (taxbench.launchers.outcome) to Hydra, and the multirun callback (taxbench.launchers.multirun)
waits for them, publishes each point and prints tax against GPU count.

`taxbench run cluster=slurm -- COMMAND` (taxbench.launchers.command_slurm): one job of the same shape whose batch step
runs one driver process (`launch_driver`), not one task per rank; what the driver starts (the user's own srun,
torchrun or deepspeed) runs inside that allocation.

Dry run (`cluster.dry_run=true`): after the same pre-launch checks, print the plan and the job, and write the sbatch
script submitit would hand to sbatch to `<experiment>/slurm_dry_run/submission.sh`; nothing is submitted, and no Slurm
(sbatch, srun) is needed on the machine.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import submitit
from submitit.core.utils import FailedJobError, JobPaths, UncompletedJobError

from taxbench.config.schema import ClusterConfig, ConfigError, Device, ModelKind, TaxbenchConfig, world_size
from taxbench.diagnostics import logger
from taxbench.launchers.local import RankMain
from taxbench.launchers.outcome import Launched, LaunchFailed, Queued
from taxbench.launchers.worker import run_rank
from taxbench.parallel.plan import make_plan, render_plan
from taxbench.redaction import redact, redact_text

log = logger(__name__)
# cluster.master_addr value meaning "the first node of the allocation" (submitit's TorchDistributedEnvironment).
ALLOCATION_MASTER = "slurm"
LOOPBACK = ("127.0.0.1", "localhost", "::1")
JOB_FILE = "slurm_job.json"
DRY_RUN_DIR = "slurm_dry_run"  # inside the experiment folder
DRY_RUN_SCRIPT = "submission.sh"
# Slurm job states of a job that Slurm ended (sacct/squeue names; a cancel reads "CANCELLED by <uid>" in sacct).
JOB_ENDED_BADLY = frozenset({"CANCELLED", "TIMEOUT", "PREEMPTED", "NODE_FAIL", "OUT_OF_MEMORY", "DEADLINE",
                             "BOOT_FAIL", "FAILED"})



class SlurmJobFailed(LaunchFailed):
    """The Slurm job ended without results; the message names its logs."""


@dataclass(frozen=True)
class JobShape:
    nodes: int
    tasks_per_node: int
    gpus_per_node: int
    cpus_per_task: int


def job_shape(cluster: ClusterConfig) -> JobShape:
    """One task per rank: per GPU on CUDA (nodes = gpus / gpus_per_node), `cpu_ranks` over `nodes` on CPU."""
    world = world_size(cluster)
    if cluster.device is Device.cuda:
        per_node = min(cluster.gpus_per_node, world)
        if per_node < 1 or world % per_node:
            raise ConfigError(
                f"cluster.gpus={world} is not a multiple of cluster.gpus_per_node={cluster.gpus_per_node}; "
                f"use a multiple such as cluster.gpus={max(per_node, 1) * max(world // max(per_node, 1), 1)}"
            )
        return JobShape(world // per_node, per_node, per_node, cluster.threads_per_rank)
    if cluster.nodes < 1 or world % cluster.nodes:
        raise ConfigError(
            f"cluster.cpu_ranks={world} cannot be spread evenly over cluster.nodes={cluster.nodes}; "
            "use a multiple of the node count"
        )
    return JobShape(cluster.nodes, world // cluster.nodes, 0, cluster.threads_per_rank)


def check_master(cluster: ClusterConfig, shape: JobShape) -> None:
    if shape.nodes > 1 and cluster.master_addr in LOOPBACK:
        raise ConfigError(
            f"cluster.master_addr={cluster.master_addr} is a loopback address but the job spans {shape.nodes} nodes; "
            f"use cluster.master_addr={ALLOCATION_MASTER} (the allocation's first node)"
        )


def require_slurm() -> None:
    """Refuse before anything is written when there is no Slurm to submit to."""
    if shutil.which("sbatch") is None:
        raise ConfigError(
            "cluster=slurm needs a reachable Slurm (sbatch not found on PATH); run from a Slurm login node, or use "
            "cluster=local / cluster=inprocess on this machine"
        )


def preflight(cfg: TaxbenchConfig) -> None:
    """Everything refusable before the experiment folder exists: a Slurm to submit to, the job shape, the rendezvous."""
    require_slurm()
    check_master(cfg.cluster, job_shape(cfg.cluster))


def submitit_folder(cfg: TaxbenchConfig, root: Path) -> Path:
    # A fresh folder per experiment: job ids restart at 1 when a cluster's state is wiped.
    return Path(cfg.cluster.submitit_dir) if cfg.cluster.submitit_dir else root / ".submitit"


def make_private_folder(cfg: TaxbenchConfig, root: Path) -> None:
    """The job script holds the setup lines verbatim: only the owner may enter the submitit folder (mode 0700)."""
    folder = submitit_folder(cfg, root)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        folder.chmod(0o700)
    except OSError as exc:
        key = f"cluster.submitit_dir={folder}" if cfg.cluster.submitit_dir else f"the submitit folder {folder}"
        raise ConfigError(f"{key}: cannot make it private (mode 0700): {exc}") from exc


def secret_warnings(cluster: ClusterConfig, script: Path) -> list[str]:
    """One warning per setup line / sbatch argument that the redactor would change: those are copied verbatim."""
    where = f"it is copied into the job script {script} (in a folder only you can read, mode 0700)"
    advice = "pass secrets through the job's environment instead"
    lines = [f"cluster.setup line {i}" for i, line in enumerate(cluster.setup, 1) if redact_text(line) != line]
    lines += [f"cluster.sbatch_args.{key}" for key, value in cluster.sbatch_args.items()
              if redact({key: str(value)}) != {key: str(value)}]
    return [f"{what} looks like it holds a secret; {where}; {advice}" for what in lines]


class ScriptOnlyExecutor(submitit.SlurmExecutor):
    """submitit's Slurm executor for a dry run: it renders the sbatch script a submission would use, where no Slurm is
    installed, and refuses to submit."""

    @classmethod
    def affinity(cls) -> int:
        return 1  # SlurmExecutor refuses to exist without srun on PATH; rendering a script never runs srun

    def _submit_command(self, command: str) -> submitit.Job[Any]:
        raise RuntimeError("a Slurm dry run submits nothing")

    def submission_script(self) -> str:
        """The text `submit` writes and hands to sbatch: the same parameters and the same command line."""
        return self._make_submission_file_text(self._submitit_command_str, "dry-run")


def make_executor(cfg: TaxbenchConfig, root: Path,
                  executor_class: type[submitit.SlurmExecutor] = submitit.SlurmExecutor,
                  in_batch_step: bool = False) -> submitit.SlurmExecutor:
    """The executor of a job shaped as cfg.cluster's ranks. `in_batch_step`: the job's callable runs once, in the
    batch step on the allocation's first node (as the command of a user's own sbatch script), instead of once per
    task under srun; the allocation is the same."""
    cluster = cfg.cluster
    shape = job_shape(cluster)
    check_master(cluster, shape)
    try:
        executor = executor_class(folder=submitit_folder(cfg, root) / "%j")
    except RuntimeError as exc:  # submitit: 'Could not detect "srun", are you indeed on a slurm cluster?'
        raise ConfigError(f"cluster=slurm needs a reachable Slurm ({exc}); use cluster=local on this machine") from exc
    params: dict[str, Any] = {
        "job_name": f"taxbench-{cfg.experiment.name}",
        "time": cluster.time_min,
        "nodes": shape.nodes,
        "ntasks_per_node": shape.tasks_per_node,
        "cpus_per_task": shape.cpus_per_task,
        "setup": list(cluster.setup),
        "additional_parameters": dict(cluster.sbatch_args),
    }
    if in_batch_step:
        params["use_srun"] = False
    if shape.gpus_per_node:
        params["gpus_per_node"] = shape.gpus_per_node
    for key in ("partition", "account", "qos", "constraint"):
        value = getattr(cluster, key)
        if value:
            params[key] = value
    try:
        executor.update_parameters(**params)
    except ValueError as exc:  # e.g. an unknown key in cluster.sbatch_args
        raise ConfigError(f"cluster.sbatch_args / Slurm settings rejected by submitit: {exc}") from exc
    return executor


class SlurmExperiment(submitit.helpers.Checkpointable):
    """What each Slurm task runs. Stateless: requeueing resubmits it as is and the experiment resumes from disk."""

    def __init__(self, cfg: TaxbenchConfig, root: str, master_addr: str, master_port: int,
                 rank_main: RankMain = run_rank) -> None:
        self.cfg, self.root = cfg, root
        self.master_addr, self.master_port = master_addr, master_port
        self.rank_main = rank_main  # what each task runs: the experiment schedule, or taxbench verify's rerun

    def __call__(self) -> dict[str, Any]:
        env = submitit.helpers.TorchDistributedEnvironment()
        cluster = self.cfg.cluster
        expected = cluster.gpus if cluster.device is Device.cuda else cluster.cpu_ranks
        if env.world_size != expected:
            raise RuntimeError(
                f"the Slurm job has {env.world_size} tasks but the config asks for {expected} ranks; "
                "check cluster.sbatch_args for task-count overrides"
            )
        # Where the node's hostname does not resolve, gloo's rendezvous on it hangs: a loopback master_addr
        # (single node only) sidesteps that. MASTER_ADDR is not exported from the environment object on purpose:
        # export() refuses to overwrite variables a requeued or nested job already has.
        addr = env.master_addr if self.master_addr == ALLOCATION_MASTER else self.master_addr
        port = self.master_port or env.master_port
        self.rank_main(env.rank, env.world_size, env.local_rank, self.cfg, self.root, addr, port)
        return {
            "rank": env.rank,
            "host": socket.gethostname(),
            "restarts": int(os.environ.get("SLURM_RESTART_COUNT", "0")),
        }


def job_config(cfg: TaxbenchConfig) -> TaxbenchConfig:
    """The config the job's tasks get, pickled into the submitit folder: setup lines and sbatch arguments are used by
    the job script only, so the pickle holds them redacted (the manifests record them redacted anyway)."""
    cluster = cfg.cluster
    return replace(cfg, cluster=replace(cluster, setup=redact(cluster.setup), sbatch_args=redact(cluster.sbatch_args)))


def make_job_files_private(job: submitit.Job[Any]) -> None:
    """Mode 0600 for the job script and pickle too: they stay private if the folder is copied or opened up later.
    Not by umask: sbatch hands the submitting umask to the job (SLURM_UMASK), and the job's records should not be
    private."""
    job.paths.folder.chmod(0o700)
    for path in (job.paths.submission_file, job.paths.submitted_pickle):
        try:
            path.chmod(0o600)
        except FileNotFoundError:  # a requeued job may be rewriting its pickle already
            pass


def submit(cfg: TaxbenchConfig, root: Path, rank_main: RankMain = run_rank) -> submitit.Job[Any]:
    task = SlurmExperiment(job_config(cfg), str(root), cfg.cluster.master_addr, cfg.cluster.master_port, rank_main)
    return _submit(cfg, root, task, in_batch_step=False)


def _submit(cfg: TaxbenchConfig, root: Path, task: Callable[[], Any], in_batch_step: bool) -> submitit.Job[Any]:
    preflight(cfg)
    executor = make_executor(cfg, root, in_batch_step=in_batch_step)
    make_private_folder(cfg, root)
    try:
        job = executor.submit(task)
    except FailedJobError as exc:  # sbatch refused the job (controller down, bad partition, ...); it printed why
        last = next((line for line in reversed(str(exc).splitlines()) if line.strip()), "no message")
        raise ConfigError(f"cluster=slurm: sbatch refused the job: {last.strip()}") from exc
    make_job_files_private(job)
    for warning in secret_warnings(cfg.cluster, job.paths.submission_file):
        log.warning(warning)
    root.mkdir(parents=True, exist_ok=True)
    (root / JOB_FILE).write_text(
        json.dumps({"job_id": job.job_id, "submitit_folder": str(submitit_folder(cfg, root))}, indent=2),
        encoding="utf-8",
    )
    return job


# Slurm states of a job that has not ended: a requeued job is pending again, then runs again.
LIVE_STATES = frozenset({"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING", "RUNNING", "RESIZING",
                         "SUSPENDED", "COMPLETING", "PREEMPTED"})


def wait(job: submitit.Job[Any], root: Path, poll_s: float = 2.0) -> list[dict[str, Any]]:
    """Block until the job (including any requeues) has finished; results of every task.

    An attempt that is being requeued can end in an error of its own: submitit's `scontrol requeue` runs inside the
    job step that the requeue cancels, and on a busy node the step's SIGTERM reaches it before it exits, so the task
    writes that error as its result. While the job lives on (pending or running again), that result is stale: the
    wait goes on until the job has ended, and its last attempt's results are the job's."""
    while True:
        try:
            return job.results()
        except (FailedJobError, UncompletedJobError) as exc:
            state = _state(job)
            if state.split()[0] not in LIVE_STATES:
                raise SlurmJobFailed(
                    f"Slurm job {job.job_id} for {root} ended without results (state {state}); logs: "
                    f"{job.paths.stderr} and {job.paths.stdout}. Records and complete checkpoints written so far "
                    f"are kept.\n{str(exc)[-2000:]}"
                ) from exc
            log.warning(f"Slurm job {job.job_id}: an attempt ended in an error, but the job is {state} (requeued): "
                        "waiting for its next attempt")
            while _state(job).split()[0] in LIVE_STATES:
                time.sleep(poll_s)


def _state(job: submitit.Job[Any]) -> str:
    """The job's state as sacct reports it now ("CANCELLED by 0": its first word is the state)."""
    return job.get_info(mode="force").get("State") or "UNKNOWN"


def launch_slurm(cfg: TaxbenchConfig, root: Path, block: bool = True,
                 rank_main: RankMain = run_rank) -> Launched | Queued:
    """Submit the experiment (or what `rank_main` runs on every task): Launched once it has finished, or, with
    block=False (the points of a multirun), Queued at once with the job to wait for."""
    job = submit(cfg, root, rank_main)
    print(f"taxbench: submitted Slurm job {job.job_id} ({root}); logs in {job.paths.folder}", flush=True)
    launched = Launched(root, cfg.report)
    if not block:
        return Queued(launched, job, functools.partial(wait, job, root))
    wait(job, root)
    return launched


def launch_driver(cfg: TaxbenchConfig, root: Path, driver: Callable[[], Any], poll_s: float = 1.0) -> Any:
    """Run `driver` (picklable; its config as job_config gives it) as the one process of a job holding the allocation
    cfg.cluster's ranks would hold, in its batch step on the first node: what it starts (srun, torchrun, deepspeed)
    runs inside that allocation. Until the job ends, the job's state changes and the driver's own progress lines
    (those of its stdout that start with "taxbench:") are printed here. The driver's return value; SlurmJobFailed in
    one line naming the log where the job ended without one (cancelled, past its time limit, the driver crashed).
    An interrupt here (Ctrl-C) cancels the job: its runs stop with it, as a local run's do."""
    job = _submit(cfg, root, driver, in_batch_step=True)
    driver_task = job.task(0)  # the job's other tasks are never started: the driver starts what runs on them
    print(f"taxbench: submitted Slurm job {job.job_id} ({root}); logs in {job.paths.folder}", flush=True)
    relay = _ProgressRelay(driver_task.paths.stdout)
    state = "UNKNOWN"  # what the watcher says before the controller has answered
    try:
        while not driver_task.done():
            info = driver_task.watcher.get_info(job.job_id)
            if info.get("State", state) != state:
                state = info["State"]
                where = f" on {info['NodeList']}" if info.get("NodeList") and state == "RUNNING" else ""
                print(f"taxbench: Slurm job {job.job_id}: {state}{where}", flush=True)
            relay.print_new()
            time.sleep(poll_s)
        relay.print_new()
        result, why = driver_task.result(), ""
    except (FailedJobError, UncompletedJobError) as exc:
        relay.print_new()
        result, why = None, "the driver raised" if isinstance(exc, FailedJobError) else "it left no result"
    except KeyboardInterrupt:
        job.cancel(check=False)
        raise
    # A cancel or the time limit signals every process of the job at once: the driver may still hand back the
    # failure of the run it saw killed, but the job's own end is the cause.
    final = driver_task.watcher.get_state(job.job_id, mode="force")
    if why or final.split()[0] in JOB_ENDED_BADLY:
        raise SlurmJobFailed(f"Slurm job {job.job_id} ended before {root.name} finished (state {final}"
                             f"{', ' + why if why else ''}); its log: {driver_task.paths.stderr}")
    return result


class _ProgressRelay:
    """Prints the complete lines a job's stdout log gained since the last call that are taxbench's own progress."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset = path, 0

    def print_new(self) -> None:
        try:
            with self.path.open("rb") as handle:
                handle.seek(self.offset)
                chunk = handle.read()
        except FileNotFoundError:  # the job has not started yet
            return
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self.offset += len(complete)
        for line in complete.decode("utf-8", errors="replace").splitlines():
            if line.startswith("taxbench:"):
                print(line, flush=True)


def write_private(path: Path, text: str) -> None:
    """`text` to `path` readable by the owner only (mode 0600 in a 0700 folder): a job script holds the setup lines."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.parent.chmod(0o700)
        path.unlink(missing_ok=True)  # a rerun: the new file gets mode 0600 whatever the old one had
        with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w", encoding="utf-8") as handle:
            handle.write(text)
    except OSError as exc:
        raise ConfigError(f"cannot write the sbatch script {path}: {exc}") from exc


def render_job(cfg: TaxbenchConfig, shape: JobShape, script: Path) -> str:
    cluster = cfg.cluster
    nodes = f"{shape.nodes} node{'s' if shape.nodes > 1 else ''}"
    if shape.gpus_per_node:
        size = (f"{nodes} x {shape.gpus_per_node} GPUs = {shape.nodes * shape.gpus_per_node} GPUs, "
                f"{shape.tasks_per_node} tasks per node (one rank per GPU)")
    else:
        size = f"{nodes} x {shape.tasks_per_node} tasks per node (CPU ranks), no GPUs"
    lines = [
        "taxbench: Slurm dry run: nothing submitted",
        f"  job: taxbench-{cfg.experiment.name}",
        f"  size: {size}, {shape.cpus_per_task} CPUs per task",
        f"  time limit: {cluster.time_min} min",
    ]
    lines += [f"  {key}: {getattr(cluster, key)}" for key in ("partition", "account", "qos", "constraint")
              if getattr(cluster, key)]
    lines += [f"  sbatch script: {script}",
              "  to submit it, run the same command without cluster.dry_run=true"]
    return "\n".join(lines)


def dry_run_slurm(cfg: TaxbenchConfig, root: Path) -> Path:
    """Print the plan and the job, write the sbatch script a submission would use; submit nothing. The script's path.

    Needs no Slurm here. The script names the submitit folder a real submission would use (<root>/.submitit by
    default); that folder is not created."""
    shape = job_shape(cfg.cluster)
    executor = make_executor(cfg, root, ScriptOnlyExecutor)
    assert isinstance(executor, ScriptOnlyExecutor)
    if cfg.cluster.device is Device.cuda and str(cfg.recipe.model.kind) == ModelKind.titan.value:
        print("taxbench: no per-GPU plan for torchtitan's own model (the planner counts models of the recipe's "
              "fields)", flush=True)
    elif cfg.cluster.device is Device.cuda:
        plan = make_plan(cfg)
        print(render_plan(plan), flush=True)
        if not plan.valid:
            raise ConfigError(f"the parallel layout of recipe {plan.recipe} does not fit cluster.gpus={plan.gpus} "
                              "(see above)")
    else:
        print(f"taxbench: no per-GPU plan for cluster.device={cfg.cluster.device.value}", flush=True)
    script = root.absolute() / DRY_RUN_DIR / DRY_RUN_SCRIPT
    write_private(script, executor.submission_script())
    print(render_job(cfg, shape, script), flush=True)
    for warning in secret_warnings(cfg.cluster, script):
        log.warning(warning)
    return script


def _job_parameters(executor: submitit.SlurmExecutor) -> dict[str, Any]:
    return {key: value for key, value in executor.parameters.items() if key != "job_name"}


def submit_batch(runs: list[tuple[TaxbenchConfig, Path]], rank_main: RankMain = run_rank) -> list[submitit.Job[Any]]:
    """Submit several experiments (taxbench verify's reruns of several references) as one Slurm job array: one sbatch,
    one queue entry, one task per experiment. They must ask for one job shape (an array's tasks share it); the array's
    submitit folder is the first experiment's, and each experiment folder's slurm_job.json names it."""
    first_cfg, first_root = runs[0]
    for cfg, _ in runs:
        preflight(cfg)
    executor = make_executor(first_cfg, first_root)
    for cfg, root in runs[1:]:
        theirs = _job_parameters(make_executor(cfg, root, ScriptOnlyExecutor))
        if theirs != _job_parameters(executor):
            differing = sorted(key for key in {*theirs, *_job_parameters(executor)}
                               if theirs.get(key) != executor.parameters.get(key))
            raise ConfigError(f"one Slurm submission (a job array) runs every experiment with one job shape, but "
                              f"{cfg.experiment.name} and {first_cfg.experiment.name} differ in "
                              f"{', '.join(differing)}; submit them separately")
    executor.update_parameters(job_name=f"taxbench-{first_cfg.experiment.name}-and-{len(runs) - 1}-more")
    make_private_folder(first_cfg, first_root)
    try:
        with executor.batch():
            jobs = [executor.submit(SlurmExperiment(job_config(cfg), str(root), cfg.cluster.master_addr,
                                                    cfg.cluster.master_port, rank_main)) for cfg, root in runs]
    except FailedJobError as exc:
        last = next((line for line in reversed(str(exc).splitlines()) if line.strip()), "no message")
        raise ConfigError(f"cluster=slurm: sbatch refused the job array: {last.strip()}") from exc
    folder = submitit_folder(first_cfg, first_root)
    # One sbatch script for the whole array, in the array's own folder (a task's paths name <array>_<i>/ instead).
    script = JobPaths(folder / "%j", job_id=jobs[0].job_id.partition("_")[0]).submission_file
    script.parent.chmod(0o700)
    script.chmod(0o600)
    for job, (_, root) in zip(jobs, runs, strict=True):
        make_job_files_private(job)
        root.mkdir(parents=True, exist_ok=True)
        (root / JOB_FILE).write_text(json.dumps({"job_id": job.job_id, "submitit_folder": str(folder)}, indent=2),
                                     encoding="utf-8")
    for warning in secret_warnings(first_cfg.cluster, script):
        log.warning(warning)
    return jobs


def launch_slurm_batch(runs: list[tuple[TaxbenchConfig, Path]], rank_main: RankMain = run_rank) -> dict[int, str]:
    """Submit the experiments as one job array and wait for every task; the tasks that ended without results, by
    index, each with its logs (the others' records are complete)."""
    jobs = submit_batch(runs, rank_main)
    array = jobs[0].job_id.partition("_")[0]
    print(f"taxbench: submitted Slurm job array {array} ({len(jobs)} tasks); logs in {jobs[0].paths.folder.parent}",
          flush=True)
    failed = {}
    for index, (job, (_, root)) in enumerate(zip(jobs, runs, strict=True)):
        try:
            wait(job, root)
        except SlurmJobFailed as exc:
            failed[index] = str(exc)
    return failed
