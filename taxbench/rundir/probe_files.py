"""The files of a run of `taxbench run -- COMMAND` beside its step records, one typed model and one reader/writer each.

- `probe.json` (ProbeSettings): written by the launcher before the command starts; the probe in every process of the
  command reads it (its path is in TAXBENCH_PROBE). A replay of `taxbench localize` adds a capture (ProbeTrace).
- `probe/loaded.<host>.<pid>`: one empty file per process in which the probe activated (torch was imported): the
  proof that it loaded, even where no process stepped an optimizer.
- `probe/rank<R>.json` (RankFacts): what a rank that stepped an optimizer knows: its place in the world, its host and
  devices, the policy as torch reports it, its optimizers, where a resumed process started. Written at the rank's
  first step and again when it closes.
- `steps.rank<R>.jsonl`: the same step records as the trainer writes (taxbench.rundir.records), plus `flags`, the
  live determinism flags of the step, and `skipped` (taxbench.rundir.step_record.SKIPPED).
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from taxbench.rundir.records import write_text_atomically

PROBE_ENV = "TAXBENCH_PROBE"  # the path of the run's probe.json
PROBE_SETTINGS = "probe.json"
PROBE_DIR = "probe"
FORMAT = 1


class ProbeFileError(ValueError):
    """A probe file that is missing, damaged or of another format."""


@dataclass(frozen=True)
class ProbeTrace:
    """The tracing ladder's capture in a replay of the command (taxbench.tracing.capture.CaptureScope's fields)."""

    rung: int
    steps: list[int]
    modules: list[str] = field(default_factory=list)
    ops: list[str] = field(default_factory=list)
    max_numel: int = 0
    stop_after: bool = True  # the command ends once the last traced step is captured (a replay needs no more)
    resumed_from: int = 0  # a resumed process: the step it starts after, before its optimizer's count is known


@dataclass(frozen=True)
class ProbeSettings:
    run_dir: str
    arm: str
    replica: str
    block: int  # the pair this run belongs to (its records' block)
    policy: dict[str, Any] | None  # taxbench's policy whose torch flags the probe applies (None: the flags as given)
    fingerprint_every: int = 1  # digest every Nth step (0: none; the gated runs digest every step)
    resume: bool = False  # a resumed process: steps are the optimizer's own step count, records past it dropped
    trace: ProbeTrace | None = None
    format: int = FORMAT

    def write(self) -> Path:
        path = Path(self.run_dir) / PROBE_SETTINGS
        write_text_atomically(path, json.dumps(asdict(self), indent=2))
        return path


def read_probe_settings(path: Path) -> ProbeSettings:
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
        if stored.get("format") != FORMAT:
            raise ProbeFileError(f"{path}: probe settings of format {stored.get('format')!r}, expected {FORMAT}")
        trace = stored.pop("trace", None)
        return ProbeSettings(**stored, trace=None if trace is None else ProbeTrace(**trace))
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        raise ProbeFileError(f"{path}: not readable probe settings ({exc})") from exc


@dataclass(frozen=True)
class RankFacts:
    rank: int
    world_size: int
    local_rank: int
    hostname: str
    pid: int
    device: str  # "cpu" or "cuda:<i>"
    software: dict[str, Any]  # torch, CUDA, NCCL, cuDNN versions; GPU name
    policy_applied: dict[str, Any]  # the determinism flags and environment as torch reports them at the first step
    optimizers: list[str]  # the classes whose steps this rank recorded (outermost calls)
    resumed_from: int | None = None  # a resumed process: the optimizer's own step count it started after
    steps: int = 0  # steps recorded when last written
    format: int = FORMAT

    def write(self, run_dir: Path) -> None:
        folder = run_dir / PROBE_DIR
        folder.mkdir(parents=True, exist_ok=True)
        write_text_atomically(folder / f"rank{self.rank}.json", json.dumps(asdict(self), indent=2))


def read_rank_facts(run_dir: Path) -> list[RankFacts]:
    """Every rank's facts, by rank (ProbeFileError for a damaged one)."""
    found = []
    for path in sorted((run_dir / PROBE_DIR).glob("rank*.json")):
        try:
            stored = json.loads(path.read_text(encoding="utf-8"))
            if stored.get("format") != FORMAT:
                raise ProbeFileError(f"{path}: rank facts of format {stored.get('format')!r}, expected {FORMAT}")
            found.append(RankFacts(**stored))
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            raise ProbeFileError(f"{path}: not readable rank facts ({exc})") from exc
    return sorted(found, key=lambda facts: facts.rank)


def mark_loaded(run_dir: Path) -> None:
    """Leave this process's proof that the probe activated in it."""
    folder = run_dir / PROBE_DIR
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"loaded.{socket.gethostname()}.{os.getpid()}").touch()


def loaded_processes(run_dir: Path) -> int:
    return len(list((run_dir / PROBE_DIR).glob("loaded.*")))


@dataclass(frozen=True)
class LiveFlags:
    """The determinism flags a step ran under, as torch reports them (recorded with every step as `flags`)."""

    deterministic: bool
    cudnn_deterministic: bool
    cudnn_benchmark: bool
    tf32: bool  # matmul or cuDNN TF32
    fill_uninitialized_memory: bool

    def text(self) -> str:
        return " ".join(f"{name}={int(value)}" for name, value in asdict(self).items())

    @classmethod
    def parse(cls, text: str) -> LiveFlags:
        values = dict(part.split("=", 1) for part in text.split())
        return cls(**{name: values[name] == "1" for name in cls.__dataclass_fields__})


# What each flag is called where a refusal names it, and what taxbench's policy wants of it.
FLAG_NAMES = {
    "deterministic": "torch.use_deterministic_algorithms",
    "cudnn_deterministic": "torch.backends.cudnn.deterministic",
    "cudnn_benchmark": "torch.backends.cudnn.benchmark",
    "tf32": "TF32 (torch.backends.cuda.matmul.allow_tf32 / cudnn.allow_tf32)",
    "fill_uninitialized_memory": "torch.utils.deterministic.fill_uninitialized_memory",
}


def expected_flags(policy: dict[str, Any]) -> dict[str, bool]:
    """The live flags a policy applies (taxbench.runtime.determinism.apply_flags; TF32 only where it sets it)."""
    wanted = {"deterministic": bool(policy["deterministic"]), "cudnn_deterministic": bool(policy["deterministic"]),
              "cudnn_benchmark": bool(policy["cudnn_benchmark"]),
              "fill_uninitialized_memory": bool(policy["fill_uninitialized_memory"])}
    if policy.get("allow_tf32") is not None:
        wanted["tf32"] = bool(policy["allow_tf32"])
    return wanted
