"""The run-directory contract: step records (append-only JSONL per rank) and the manifest.

`<out>/<experiment>/<arm>-<replica>/manifest.json` and `steps.rank<R>.jsonl`, one JSON object per step. Every line
is flushed when written, so a crash loses at most the record being written; a resumed run first drops records past
its checkpoint so nothing is duplicated. Readers reject any other schema_version.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from taxbench.config import ARM_NAMES
from taxbench.redaction import redact

SCHEMA_VERSION = 1

# Fingerprinted metrics in the order they are produced within a step; the first mismatch is reported in this order.
METRICS = ("loss_bits", "grads", "grad_norm_bits", "params", "optim")

MANIFEST = "manifest.json"


@dataclass(frozen=True)
class RunRef:
    arm: str
    replica: str

    @property
    def name(self) -> str:
        return run_name(self.arm, self.replica)


# The runs of an experiment, each a folder <arm>-<replica> (see taxbench.experiment for what each is for).
TIMED = {arm: RunRef(arm, "0") for arm in ARM_NAMES}
REPEAT = RunRef("deterministic", "1")
RESUMED = RunRef("deterministic", "resumed")
BASELINE_REPEAT = RunRef("baseline", "1")
ALL_RUNS = (TIMED["baseline"], TIMED["deterministic"], REPEAT, RESUMED, BASELINE_REPEAT)


def steps_file(run_dir: Path, rank: int) -> Path:
    return run_dir / f"steps.rank{rank}.jsonl"


def run_name(arm: str, replica: str) -> str:
    return f"{arm}-{replica}"


class StepWriter:
    """Appends one record per step to this rank's stream, flushing each line."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = path.open("a", encoding="utf-8")

    def truncate_after(self, step: int) -> None:
        """Drop records past `step` (written after the checkpoint a resume starts from)."""
        self._file.close()
        truncate_jsonl_after(self.path, step)
        self._file = self.path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps({"schema_version": SCHEMA_VERSION, **record}, separators=(",", ":")) + "\n")
        self._file.flush()

    def sync(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        if not self._file.closed:
            self.sync()
            self._file.close()


def truncate_jsonl_after(path: Path, step: int) -> None:
    """Atomically keep only the records of a JSONL stream whose "step" is <= `step` (and drop a torn last line)."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn last line from a crash
        if record.get("step", 0) <= step:
            kept.append(line)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(k + "\n" for k in kept), encoding="utf-8")
    os.replace(tmp, path)


def write_manifest(run_dir: Path, manifest: dict[str, Any]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / (MANIFEST + ".tmp")
    text = json.dumps({"schema_version": SCHEMA_VERSION, **redact(manifest)}, indent=2, default=str)
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, run_dir / MANIFEST)
