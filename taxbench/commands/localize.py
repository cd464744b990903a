"""`taxbench localize`: walk the tracing ladder automatically, from step metrics to the responsible op.

Rung 0 compares the two runs' step records (analysis.verdicts.compare_runs) and takes the first mismatching step s.
Then each rung is a replay: every rank rebuilds both runs' trainers from their manifests (same config, seed, policy
and, where the original run had one, the injected fault), starts from a saved checkpoint at or before s-1 when the
run still has one on every rank (else from step 0 via seeded init; the restart-replay replica is re-run through its
checkpoint/resume at experiment.resume_step), runs to s with the capture on at that rung for step s only, and the
two traces are diffed. The ladder goes deeper until a record is named:
  rung 1 (collectives, optimizer step, checkpoint load) -> rung 2 (module outputs) -> rung 3 (ATen ops), where a
  module origin narrows rung 3 to that module and an optimizer origin to the optimizer step.
Candidates are ordered causally across ranks (taxbench.tracing.diff): when every candidate of a rung may have received
its difference from a peer's ("candidates remain"), the ladder goes where that resolves: rung 2 after rung 1, rung 3
inside the innermost communicating modules after rung 2, every module after a narrowed rung 3.
If the replays diverge before s, s moves to the replays' first mismatch. If the replays do not diverge at all, the
divergence did not recur (a rare nondeterministic event) and that is reported. Replays of recipe runs run on this
machine, one process per rank of the original run (gloo on CPU, NCCL on CUDA). Replays of runs of `taxbench run --
COMMAND` run the recorded command again (launchers.command.replay_run), the probe capturing step s in every rank
(taxbench.probe.capture), the command ending once it is captured; they start from step 0, or from the command's own
save for a restart replay.
"""

from __future__ import annotations

import copy
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from taxbench.analysis.verdicts import compare_runs
from taxbench.checkpoint.store import RunCheckpoints
from taxbench.config.schema import load_config
from taxbench.launchers.command import replay_run
from taxbench.launchers.local import die_with_parent
from taxbench.launchers.worker import rank_process
from taxbench.parallel.distributed import free_port
from taxbench.rundir.probe_files import ProbeTrace
from taxbench.rundir.read import RecordError, load_run
from taxbench.rundir.run_manifest import load_manifest
from taxbench.tracing.diff import (
    CONTROL_FLOW,
    IDENTICAL,
    INCOMPLETE,
    MAX_LISTED,
    NOTHING_COMPARED,
    ORIGIN,
    OUTSIDE,
    UNRESOLVED,
    DiffReport,
    Finding,
    describe,
    diff_runs,
    innermost_modules,
)
from taxbench.train.trainer import RunSpec, Trainer

NO_DIVERGENCE = "no_divergence"
NAMED = "named"
NOT_REPRODUCED = "not_reproduced"
MAX_REPLAYS = 6


class LocalizeError(ValueError):
    """The runs cannot be localized as given; the message says why and what to do."""


@dataclass(frozen=True)
class RecordedRun:
    run_dir: Path
    name: str
    arm: str
    replica: str
    config: dict[str, Any]
    world_size: int
    command: bool = False  # a run of `taxbench run -- COMMAND`: replayed by running the command again

    @classmethod
    def load(cls, run_dir: Path) -> RecordedRun:
        manifest = load_manifest(run_dir)
        try:
            config = manifest.run_config
            world = int(manifest.layout_or_empty.get("world_size") or 0)
            if manifest.arm is None or manifest.replica is None:
                raise KeyError("arm" if manifest.arm is None else "replica")
            return cls(run_dir, manifest.run if manifest.run is not None else run_dir.name, manifest.arm,
                       str(manifest.replica), config, world, manifest.is_command_run)
        except RecordError as exc:  # the manifest lacks its config
            raise LocalizeError(f"{run_dir}/manifest.json lacks 'config'; localize needs a manifest written by "
                                "`python -m taxbench`") from exc
        except KeyError as exc:
            raise LocalizeError(f"{run_dir}/manifest.json lacks {exc}; localize needs a manifest written by "
                                "`python -m taxbench`") from exc

    def checkpoint_before(self, step: int) -> int:
        """The latest step k < `step` with a complete checkpoint (saved by every rank; 0 when there is none)."""
        return max((k for k in RunCheckpoints(self.run_dir, rank=0).complete() if k < step), default=0)


@dataclass(frozen=True)
class ReplayJob:
    """What every rank does for one run of one replay."""

    config: dict[str, Any]
    arm: str
    replica: str
    out_dir: str
    until_step: int
    checkpoint_step: int  # 0: start from seeded init
    checkpoint_dir: str | None
    restart_at: int  # 0: none; else checkpoint and resume in a fresh trainer here (restart-replay replica)


@dataclass
class LadderStep:
    rung: int
    step: int
    modules: list[str]
    verdict: str
    finding: Finding | None
    trace_a: str
    trace_b: str
    note: str = ""
    candidates: list[Finding] = field(default_factory=list)  # every origin candidate of the rung, with its role
    resolve: str = ""  # candidates remain: the capture that resolves them


@dataclass
class Localization:
    run_a: str
    run_b: str
    verdict: str
    first_mismatch: dict[str, Any] | None
    origin: Finding | None
    path: list[LadderStep] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _replay_config(spec: RecordedRun, rung: int, step: int, modules: tuple[str, ...], max_numel: int) -> dict[str, Any]:
    config = copy.deepcopy(spec.config)
    experiment = config.setdefault("experiment", {})
    experiment["trace"] = {"enabled": True, "rung": rung, "steps": [step], "ranks": [], "runs": [],
                           "modules": list(modules), "ops": [], "max_numel": max_numel}
    return config


def _job(spec: RecordedRun, out_dir: Path, rung: int, step: int, modules: tuple[str, ...], max_numel: int) -> ReplayJob:
    start = spec.checkpoint_before(step)
    resume_step = int(spec.config.get("experiment", {}).get("resume_step", 0))
    restart_at = resume_step if spec.replica == "resumed" and start < resume_step < step else 0
    return ReplayJob(_replay_config(spec, rung, step, modules, max_numel), spec.arm, spec.replica, str(out_dir),
                     step, start, str(spec.run_dir / "checkpoints") if start else None, restart_at)


def run_replay_rank(rank: int, world: int, jobs: list[ReplayJob], addr: str, port: int) -> None:
    """One rank of a replay: both runs, one after the other (like the experiment schedule)."""
    configs = [load_config(job.config) for job in jobs]
    with rank_process(configs, rank, world, rank, addr, port) as ctx:
        for job, cfg in zip(jobs, configs, strict=True):
            applies = cfg.experiment.fault.applies_to(job.arm, job.replica)
            out = Path(job.out_dir)

            def trainer(cfg: Any = cfg, out: Path = out, applies: bool = applies, job: ReplayJob = job) -> Trainer:
                fault = cfg.experiment.fault if applies else None
                return Trainer(RunSpec.of(cfg, job.arm, job.replica, cfg.arms[job.arm], out, fault), ctx)

            current = trainer()
            if job.checkpoint_step:
                assert job.checkpoint_dir is not None
                original = RunCheckpoints(Path(job.checkpoint_dir).parent, rank)
                current.load_checkpoint(original.require_intact(job.checkpoint_step))
            if job.restart_at:
                current.run_block(job.restart_at - current.step, 0)
                checkpoint = RunCheckpoints(out, rank).path(job.restart_at)
                current.save_checkpoint(checkpoint)
                current.close()
                current = trainer()
                current.load_checkpoint(checkpoint)
            current.run_block(job.until_step - current.step, 0)
            current.close()


def _spawned(rank: int, launcher_pid: int, world: int, jobs: list[ReplayJob], addr: str, port: int) -> None:
    die_with_parent(launcher_pid)
    run_replay_rank(rank, world, jobs, addr, port)


def replay(jobs: list[ReplayJob], world: int) -> None:
    import torch.multiprocessing as mp


    addr = "127.0.0.1"
    mp.start_processes(_spawned, args=(os.getpid(), world, jobs, addr, free_port(addr)), nprocs=world, join=True,
                       start_method="spawn")


def replay_both(spec_a: RecordedRun, spec_b: RecordedRun, where: Path, rung: int, step: int,
                modules: tuple[str, ...], max_numel: int) -> tuple[Path, Path]:
    """Replay both runs to `step` with that step captured at `rung`; the two replays' run folders."""
    if spec_a.command:
        trace = ProbeTrace(rung, [step], list(modules), [], max_numel)
        return replay_run(spec_a.run_dir, where / "a", trace), replay_run(spec_b.run_dir, where / "b", trace)
    dir_a, dir_b = where / "a", where / "b"
    replay([_job(spec_a, dir_a, rung, step, modules, max_numel),
            _job(spec_b, dir_b, rung, step, modules, max_numel)], spec_a.world_size)
    return dir_a, dir_b


def _first_mismatch(dir_a: Path, dir_b: Path, from_step: int = 0) -> Any:
    return compare_runs("localize", str(dir_a), load_run(dir_a), str(dir_b), load_run(dir_b), from_step).first_mismatch


def _check_comparable(a: RecordedRun, b: RecordedRun) -> None:
    if a.world_size != b.world_size:
        raise LocalizeError(f"{a.run_dir} ran on {a.world_size} ranks and {b.run_dir} on {b.world_size}; localize "
                            "replays both on the same ranks, so compare runs of the same world size")
    if a.world_size < 1:
        raise LocalizeError(f"{a.run_dir}/manifest.json has no layout.world_size; re-run with this taxbench")
    if a.command != b.command:
        command, recipe = (a, b) if a.command else (b, a)
        raise LocalizeError(f"{command.run_dir} is a run of `taxbench run -- COMMAND` and {recipe.run_dir} a recipe "
                            "run; localize replays two runs of the same kind")


def localize(run_a: Path, run_b: Path, work_dir: Path, max_numel: int = 0) -> Localization:
    spec_a, spec_b = RecordedRun.load(run_a), RecordedRun.load(run_b)
    _check_comparable(spec_a, spec_b)
    mismatch = _first_mismatch(run_a, run_b)
    result = Localization(str(run_a), str(run_b), NO_DIVERGENCE, asdict(mismatch) if mismatch else None, None)
    if mismatch is None:
        return result
    step = mismatch.step
    rung, modules = 1, ()
    tried: set[tuple[int, int, tuple[str, ...]]] = set()
    for attempt in range(1, MAX_REPLAYS + 1):
        tried.add((step, rung, modules))
        where = work_dir / f"replay{attempt}-step{step}-rung{rung}"
        dir_a, dir_b = replay_both(spec_a, spec_b, where, rung, step, modules, max_numel)
        report = diff_runs(dir_a, dir_b, steps=[step])
        ladder = LadderStep(rung, step, list(modules), report.verdict, report.primary, str(dir_a), str(dir_b),
                            candidates=report.candidates, resolve=report.resolve)
        result.path.append(ladder)
        replay_mismatch = _first_mismatch(dir_a, dir_b)
        if replay_mismatch is None:
            result.verdict = NOT_REPRODUCED
            result.notes.append(f"the replays agree bit for bit up to step {step}: the divergence did not recur "
                                "(a nondeterministic event that did not repeat); run localize again")
            return result
        if replay_mismatch.step < step:
            ladder.note = f"the replays diverge earlier, at step {replay_mismatch.step}: moving there"
            step, rung, modules = replay_mismatch.step, 1, ()
            continue
        following = _next(report, rung, modules)
        if following is None or (step, *following) in tried:
            result.origin = report.primary
            if report.verdict == ORIGIN:
                result.verdict = NAMED
            elif report.verdict == IDENTICAL:
                result.verdict = OUTSIDE
                result.notes.append(f"every captured record of step {step} agrees although the step records differ: "
                                    "the difference is made outside the captured region of the step (e.g. between "
                                    "steps, after the optimizer step)")
            else:
                result.verdict = report.verdict
            return result
        rung, modules = following
    result.verdict = result.path[-1].verdict
    result.notes.append(f"stopped after {MAX_REPLAYS} replays")
    return result


def _next(report: DiffReport, rung: int, modules: tuple[str, ...]) -> tuple[int, tuple[str, ...]] | None:
    """The next (rung, modules) to replay, or None when this report is the answer."""
    primary = report.primary
    if report.verdict == CONTROL_FLOW:
        return None
    if report.verdict == UNRESOLVED:  # peers that can explain each other: look inside what they communicate in
        inside = tuple(innermost_modules(report.candidates))
        if rung < 2 or (rung == 2 and not inside):
            return 2, ()
        if rung == 2:
            return 3, inside
        return (3, ()) if modules else None
    if report.verdict == ORIGIN and primary is not None:
        if primary.kind == "module" and rung < 3:
            return 3, (primary.scope,)
        if primary.kind == "optimizer" and rung < 3:
            return 3, ("optimizer",)
        if primary.kind == "pipeline" and primary.name.startswith("pipeline.send") and rung < 2:
            return 2, ()  # a stage computed different data: look at its modules
        return None
    # outside the capture (or identical at this step while the runs differ): widen
    if modules:
        return 3, ()
    return (rung + 1, ()) if rung < 3 else None


def render(result: Localization) -> str:
    lines = [f"localize {result.run_a} vs {result.run_b}"]
    mismatch = result.first_mismatch
    if mismatch is None:
        lines.append("rung 0: the step records agree bit for bit: nothing to localize")
        return "\n".join(lines)
    lines.append(f"rung 0: first mismatch at step {mismatch['step']} rank {mismatch['rank']} ({mismatch['metric']})")
    for ladder in result.path:
        scope = f" modules={ladder.modules}" if ladder.modules else ""
        found = describe(ladder.finding) if ladder.finding is not None else {
            OUTSIDE: "no origin among the captured records (all differences are downstream): go deeper",
            IDENTICAL: "every captured record agrees",
            UNRESOLVED: f"candidates remain, each explained by a peer's: resolve with {ladder.resolve}",
        }.get(ladder.verdict, ladder.verdict)
        lines.append(f"rung {ladder.rung} (step {ladder.step}{scope}): {found}" + (
            f" [{ladder.note}]" if ladder.note else ""))
        if len(ladder.candidates) > 1 or ladder.verdict == UNRESOLVED:
            lines.extend(f"  {c.role}: {describe(c)}" for c in ladder.candidates[:MAX_LISTED])
            if len(ladder.candidates) > MAX_LISTED:
                lines.append(f"  ... and {len(ladder.candidates) - MAX_LISTED} more (--json lists them all)")
    headline = {
        NAMED: "origin named",
        CONTROL_FLOW: "control-flow divergence (a record exists in one run only)",
        NOT_REPRODUCED: "not reproduced by the replay",
        NO_DIVERGENCE: "no divergence",
        INCOMPLETE: "no evidence: the replays' traces do not cover the same ranks and steps",
        NOTHING_COMPARED: "no evidence: no traced record exists in both replays",
        UNRESOLVED: "candidates remain: every candidate communicates with a peer whose earlier candidate can "
                    "explain it; none is named (see the last rung)",
    }.get(result.verdict, "origin outside the capture: no traced record produced the difference")
    lines.append(f"verdict: {headline}")
    if result.origin is not None:
        lines.append(f"origin: {describe(result.origin)}")
    lines.extend(f"note: {note}" for note in result.notes)
    return "\n".join(lines)
