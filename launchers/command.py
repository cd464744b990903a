"""`taxbench run -- COMMAND`: the user's own command, unchanged, as every run of a pair, alternated A B B A.

Whole runs alternate on one allocation: pair 0 runs baseline then deterministic, pair 1 deterministic then baseline
(their four runs also feed the repeatability and baseline-sanity gates), then the restart replay (the command's own
save, then its own resume), then, with experiment.target_half_width, more pairs in alternating order until the
tax's interval is that narrow or run.max_pairs ran. Each run is a process tree of the command with the probe on its
PYTHONPATH (taxbench/probe): its records, its manifest (written once the run has ended well) and the command's output
(`command.log`) land in the run's folder. A run that fails is exit 1 with the command that continues the experiment;
a continue keeps every run whose manifest was written and runs the rest again from their start.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import taxbench
from taxbench.config.command import EditedCommand, edited_command
from taxbench.config.policy import arm_env_values, audit, full_policy, policy_env, validate_policy_env
from taxbench.config.schema import ARM_NAMES, PolicyConfig, TaxbenchConfig, load_config
from taxbench.design import RunRef
from taxbench.launchers.local import continue_command
from taxbench.rundir.manifest import RunFacts, write_run_manifest
from taxbench.rundir.probe_files import (
    PROBE_DIR,
    PROBE_ENV,
    ProbeSettings,
    ProbeTrace,
    RankFacts,
    loaded_processes,
    read_rank_facts,
)
from taxbench.rundir.read import load_run
from taxbench.rundir.records import MANIFEST
from taxbench.rundir.run_manifest import load_manifest
from taxbench.rundir.step_record import BLOCK, RANK, STEP, TIME_S
from taxbench.rundir.stop_file import STEPS, TARGET, Stop
from taxbench.stats.tax import estimate_pairs_tax

PROBE_BOOT = Path(taxbench.__file__).parent / "probe" / "boot"
RESUMED_REPLICA = "resumed"
CHECKPOINT_FOLDER = "checkpoint"  # <experiment>/deterministic-resumed/checkpoint: where {checkpoint} points
LOG_FILE = "command.log"


class CommandFailed(RuntimeError):
    """A run of the command exited non-zero or ran past run.timeout_s (exit 1); the message says how to continue."""


class NoEvidence(RuntimeError):
    """A run of the command left no step records of its own: the probe never loaded, no optimizer stepped, or a
    resumed process recorded nothing (exit 4)."""


@dataclass(frozen=True)
class PlannedRun:
    ref: RunRef
    block: int  # the pair it belongs to (the restart's processes: -1)
    gated: bool  # compared by a gate: fingerprints every step
    part: str = ""  # the restart replay's processes: "save" (the command's own save), then "resume"

    @property
    def label(self) -> str:
        return self.ref.name + (f" ({self.part})" if self.part else "")


def pair_runs(pair: int) -> list[PlannedRun]:
    """The runs of pair `pair`, in their order: A B for even pairs, B A for odd ones."""
    arms = ARM_NAMES if pair % 2 == 0 else tuple(reversed(ARM_NAMES))
    return [PlannedRun(RunRef(arm, str(pair)), pair, gated=pair < 2) for arm in arms]


def restart_runs() -> list[PlannedRun]:
    ref = RunRef("deterministic", RESUMED_REPLICA)
    return [PlannedRun(ref, -1, True, "save"), PlannedRun(ref, -1, True, "resume")]


def probe_policy(cfg: TaxbenchConfig, arm: str) -> PolicyConfig | None:
    """The policy whose torch flags the probe applies: taxbench's for the deterministic arm; none for the baseline
    (the command as given) and for a stack-native arm (the stack's own switch alone)."""
    policy = cfg.arms[arm]
    return policy if arm == "deterministic" and not policy.stack_native else None


def arm_environment(cfg: TaxbenchConfig, arm: str, base: dict[str, str]) -> dict[str, str]:
    """The run's environment: the launch's, with the policy's variables for a deterministic arm under taxbench's
    policy (a valid value the user set is kept), then the arm's own edits."""
    env = dict(base)
    policy = probe_policy(cfg, arm)
    if policy is not None:
        validate_policy_env(policy, cfg.cluster.device, env)
        wanted = policy_env(policy) | arm_env_values(policy, {k: env.get(k) for k in policy_env(policy)})
        for name, value in wanted.items():
            if value is None:
                env.pop(name, None)
            elif not env.get(name):
                env[name] = value
    env.update(getattr(cfg.run, arm).env)
    return env


class CommandRunner:
    """Runs the planned runs of one experiment folder, one at a time, and keeps what each left."""

    def __init__(self, cfg: TaxbenchConfig, root: Path, overrides: Sequence[str], again: str | None = None) -> None:
        """`again`: the command line a failed run names to go on (None: this `taxbench run`, continued; "": none)."""
        self.cfg, self.root, self.overrides, self.again = cfg, root, list(overrides), again
        self.attempt = uuid.uuid4().hex[:12]
        self.cwd = Path(cfg.run.cwd) if cfg.run.cwd else Path.cwd()

    # -------------------------------------------------------------------------------------------------- the plan
    def run_all(self) -> None:
        planned = pair_runs(0) + pair_runs(1)
        if self.cfg.run.restart.save_args:
            planned += restart_runs()
        total = len(planned)
        for index, run in enumerate(planned, start=1):
            self.run_one(run, index, total)
        for pair in range(2, self.cfg.run.pairs):  # timing-only pairs asked for beyond the gated two
            for run in pair_runs(pair):
                self.run_one(run, 0, 0)
        pairs = self.cfg.run.pairs
        target = self.cfg.experiment.target_half_width
        stopped_by, half_width = STEPS, None
        while target > 0:
            half_width = self.half_width(pairs)
            if half_width <= target:
                stopped_by = TARGET
                break
            if pairs >= self.cfg.run.max_pairs:
                stopped_by = "max_pairs"
                break
            for run in pair_runs(pairs):
                self.run_one(run, 0, 0)
            pairs += 1  # a pair past run.pairs, until the target or run.max_pairs
        Stop(self.steps_of(RunRef("baseline", "0")), stopped_by, half_width, pairs=pairs).write(self.root)

    def half_width(self, pairs: int) -> float:
        frames = [(load_run(self.root / f"baseline-{p}", fields={STEP, RANK, TIME_S, BLOCK}),
                   load_run(self.root / f"deterministic-{p}", fields={STEP, RANK, TIME_S, BLOCK}))
                  for p in range(pairs)]
        estimate = estimate_pairs_tax(frames, self.cfg.experiment.warmup_steps, self.cfg.experiment.confidence)
        print(f"taxbench: {pairs} pairs: tax {estimate.tax:+.2%}, interval half-width {estimate.half_width:.2%}",
              flush=True)
        return estimate.half_width

    def steps_of(self, ref: RunRef) -> int:
        frame = load_run(self.root / ref.name, fields={STEP, RANK})
        return int(frame[STEP].max()) if not frame.empty else 0

    # -------------------------------------------------------------------------------------------------- one run
    def run_one(self, run: PlannedRun, index: int, total: int, trace: ProbeTrace | None = None) -> None:
        """Run `run` (skipped when an earlier attempt ended it well); `trace`: a replay's capture."""
        run_dir = self.root / run.ref.name
        if (run_dir / MANIFEST).exists():  # ended well in an earlier attempt: kept
            return
        if run.part != "resume":
            _clear(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        fingerprint_every = 1 if run.gated else self.cfg.run.timing_fingerprint_every
        policy = probe_policy(self.cfg, run.ref.arm)
        settings = ProbeSettings(str(run_dir.resolve()), run.ref.arm, run.ref.replica, run.block,
                                 None if policy is None else asdict(policy), fingerprint_every,
                                 resume=run.part == "resume", trace=trace)
        restart = self.cfg.run.restart
        extra = {"save": restart.save_args, "resume": restart.resume_args}.get(run.part, [])
        command = edited_command(self.cfg.run, run.ref.arm, run_dir, extra,
                                 (run_dir / CHECKPOINT_FOLDER).resolve())
        env = arm_environment(self.cfg, run.ref.arm, dict(os.environ))
        env[PROBE_ENV] = str(settings.write())
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROBE_BOOT), env.get("PYTHONPATH")]))
        env["TAXBENCH_PROBE_PATH"] = str(Path(taxbench.__file__).parent.parent)
        where = f"run {index}/{total}: " if total else ""
        print(f"taxbench: {where}{run.label}: {shlex.join(command.argv)}", flush=True)
        began = time.perf_counter()
        code = self._execute(command, env, run_dir)
        wall = time.perf_counter() - began
        if code != 0:
            raise CommandFailed(self._failure(run, code, run_dir))
        facts = read_rank_facts(run_dir)
        if not facts:
            raise NoEvidence(self._no_records(run_dir))
        if run.part == "save":
            return  # the resume process completes this run
        if run.part == "resume" and any(f.resumed_from is None for f in facts):  # the saving process's facts remain
            raise NoEvidence(f"{run_dir.name}: the resumed process recorded no step of its own: it took none, or the "
                             f"probe could not place its first step in the run (its output: {run_dir / LOG_FILE}); "
                             "restart replay has no evidence")
        self._write_manifest(run, command, facts, wall)
        steps = max(f.steps + (f.resumed_from or 0) for f in facts)
        print(f"taxbench: {run.label}: {steps} steps on {facts[0].world_size} ranks in {wall:.1f} s", flush=True)

    def _execute(self, command: EditedCommand, env: dict[str, str], run_dir: Path) -> int:
        timeout = self.cfg.run.timeout_s or None
        with (run_dir / LOG_FILE).open("ab") as log:
            try:
                process = subprocess.Popen(command.argv, cwd=self.cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True)
            except OSError as exc:
                raise CommandFailed(f"{command.argv[0]}: cannot start the command ({exc.strerror or exc})") from None
            try:
                return process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, 9)
                process.wait()
                return -9
            except BaseException:  # Ctrl-C or a kill of taxbench: the command's processes go with it
                os.killpg(process.pid, 9)
                process.wait()
                raise

    def _failure(self, run: PlannedRun, code: int, run_dir: Path) -> str:
        log = run_dir / LOG_FILE
        tail = _tail(log, 12)
        how = f"ran past run.timeout_s={self.cfg.run.timeout_s}" if code == -9 else f"exited with code {code}"
        failed = f"{run.label}: the command {how} (its output: {log})\n{tail}"
        again = continue_run(self.cfg, self.overrides) if self.again is None else self.again
        return f"{failed}\ncontinue with: {again}" if again else failed

    def _no_records(self, run_dir: Path) -> str:
        failed = sorted((run_dir / PROBE_DIR).glob("failed.*"))
        if failed:
            return (f"{run_dir.name}: the probe could not start: {failed[0].read_text(encoding='utf-8').strip()} "
                    f"(in {len(failed)} process(es)); the run is no evidence")
        if loaded_processes(run_dir) == 0:
            return (f"{run_dir.name}: the command ran, but taxbench's probe never loaded in any of its processes, so "
                    "no step was recorded. Likely causes: `python -I`, `-E` or `-S` in the command, a launcher or "
                    "container that drops the environment (PYTHONPATH, TAXBENCH_PROBE; e.g. mpirun without -x), or "
                    "a sitecustomize.py in the script's own folder that Python imports first")
        return (f"{run_dir.name}: the probe loaded in {loaded_processes(run_dir)} process(es), but none stepped a "
                "torch optimizer (torch.optim.Optimizer.step): there is nothing to fingerprint or time. Is this the "
                "training command?")

    def _write_manifest(self, run: PlannedRun, command: EditedCommand, facts: list[RankFacts], wall: float) -> None:
        first = facts[0]
        policy = self.cfg.arms[run.ref.arm]
        native = policy.stack_native and run.ref.arm == "deterministic"
        layout = {"world_size": first.world_size, "dp": first.world_size, "ranks_recorded": [f.rank for f in facts]}
        stack = {**first.software, "hostnames": sorted({f.hostname for f in facts}),
                 "devices": [f.device for f in facts]}
        switch = ("the command with taxbench's policy: torch flags applied by the probe, the policy's environment, "
                  "and the edits" if probe_policy(self.cfg, run.ref.arm) is not None else
                  "the stack's own switch alone (the edits), torch flags as the command leaves them" if native else
                  "the command as given, with its edits")
        facts_of_run = RunFacts(
            policy_applied=first.policy_applied,
            stack_switch={"arm": switch, "edits": command.edits},
            stack_native_audit=_audit_live(first.policy_applied) if native else None,
            layout=layout,
            stack=stack,
            threads={"torch_threads": int(first.policy_applied.get("cpu_threads") or 0)},
            shared_model=None,
            throughput=None,
        )
        write_run_manifest(self.root, run.ref, self.cfg, policy, facts_of_run, self.attempt, command={
            **command.to_dict(), "cwd": str(self.cwd), "wall_s": wall,
            "probe": {"fingerprint_every": 1 if run.gated else self.cfg.run.timing_fingerprint_every,
                      "loaded_processes": loaded_processes(self.root / run.ref.name),
                      "resumed_from": first.resumed_from, "optimizers": first.optimizers},
        })


def continue_run(cfg: TaxbenchConfig, overrides: Sequence[str]) -> str:
    """The `taxbench run` command line that continues this experiment (runs that ended well are kept)."""
    return shlex.join([*continue_command([sys.argv[0], "run", *overrides], cfg.experiment.name),
                       "--", *cfg.run.command])


def replay_run(original: Path, into: Path, trace: ProbeTrace) -> Path:
    """Run a recorded run of the command again, as it ran (its config, arm, edits and cwd; a restart replay's own
    save, then its resume), with the probe capturing `trace`'s steps; the command ends once they are captured. The
    replay's folder: `into/<run name>`. The environment is today's with the arm's (the launch's was not recorded)."""
    manifest = load_manifest(original)
    cfg = load_config(manifest.run_config)
    ref = RunRef(manifest.arm, str(manifest.replica))
    runner = CommandRunner(cfg, into, [], again="")  # cfg.run.cwd: the folder the command ran in
    if ref.replica != RESUMED_REPLICA:
        runner.run_one(PlannedRun(ref, int(ref.replica), gated=True), 0, 0, trace)
        return into / ref.name
    resumed_from = manifest.resumed_from
    save, resume = restart_runs()
    if max(trace.steps) <= resumed_from:  # the saving process took the step: it alone is replayed
        runner.run_one(save, 0, 0, trace)
    else:
        runner.run_one(save, 0, 0)
        runner.run_one(resume, 0, 0, replace(trace, resumed_from=resumed_from))
    return into / ref.name


def _audit_live(applied: dict) -> list[str]:
    """What taxbench's full policy would add or change over what the stack's switch left live (the audit of a
    recipe's stack-native arm, read from the flags torch reported in the command)."""
    env = applied.get("env", {})
    native = PolicyConfig(
        name="stack_native", deterministic=bool(applied.get("use_deterministic_algorithms")),
        cudnn_benchmark=bool(applied.get("cudnn_benchmark")),
        allow_tf32=bool(applied.get("matmul_allow_tf32") or applied.get("cudnn_allow_tf32")),
        cublas_workspace_config=env.get("CUBLAS_WORKSPACE_CONFIG"), nccl_algo=env.get("NCCL_ALGO"),
        nvte_allow_nondeterministic_algo=env.get("NVTE_ALLOW_NONDETERMINISTIC_ALGO") != "0",
        fill_uninitialized_memory=bool(applied.get("fill_uninitialized_memory")), stack_native=True,
        deterministic_kernels=full_policy().deterministic_kernels)  # taxbench's own workloads' kernels: not here
    return audit(native, "the command")


def _clear(run_dir: Path) -> None:
    """A run that did not end well in an earlier attempt starts again from nothing (inside its own folder)."""
    if run_dir.is_dir():
        shutil.rmtree(run_dir)


def _tail(path: Path, lines: int) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join("  | " + line for line in text[-lines:])
