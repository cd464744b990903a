"""Per-op profile of training steps: where each op's own time goes, per step, for per-op attribution of the tax.

`profile_steps` runs a trainer's block under torch.profiler and keeps key_averages' self time and call count of every
op, divided by the steps profiled. Self time (an op's time minus its children's) adds up to the step without counting
a parent and its children twice, so the growth of one op between two arms is its share of the tax
(taxbench.analysis.attribution). Shapes and stacks are not recorded, to keep the profiler's own cost per op small.

A table holds host rows (device "cpu": self CPU time of aten ops, autograd nodes and record_function ranges) and, on
CUDA, device rows (device "cuda": self device time of each kernel, memcpy and memset, by kernel name). Its `device` is
where a step's time is spent, "cpu" or "cuda": the rows attribution compares by default.

The profiled block is a real block of the run: its steps are recorded and advance the trainer like any other, and
their step times include the profiler's overhead. It profiles all of run_block, so the harness's work outside the
timed step (data loading, fingerprints) is in the table too, alike in both arms.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd

from taxbench.rundir.read import RecordError, read_json_object
from taxbench.rundir.records import write_text_atomically

if TYPE_CHECKING:
    from taxbench.train.trainer import Trainer

OP_TABLE_SCHEMA_VERSION = 1
OP_COLUMNS = ("op", "device", "self_us_per_step", "calls_per_step")
DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class OpTable:
    """Self time (microseconds) and calls per step of every op seen in `steps` profiled steps.

    `ops` has the columns OP_COLUMNS, one row per (op, device). `ranks` is how many ranks' tables were averaged into
    this one (taxbench.analysis.attribution.mean_over_ranks); 1 for a table profiled on one rank.
    """

    ops: pd.DataFrame
    steps: int
    device: str
    ranks: int = 1

    def __post_init__(self) -> None:
        if tuple(self.ops.columns) != OP_COLUMNS:
            raise ValueError(f"OpTable columns must be {OP_COLUMNS}, got {tuple(self.ops.columns)}")
        if self.device not in DEVICES:
            raise ValueError(f"OpTable device must be one of {DEVICES}, got {self.device!r}")
        if self.steps < 1 or self.ranks < 1:
            raise ValueError(f"OpTable needs steps >= 1 and ranks >= 1, got steps={self.steps}, ranks={self.ranks}")

    def on_device(self, device: str | None = None) -> pd.DataFrame:
        """The rows of `device` (default: the table's own device), indexed by op."""
        rows = self.ops[self.ops["device"] == (device or self.device)]
        return rows.set_index("op")[["self_us_per_step", "calls_per_step"]]

    def to_dict(self) -> dict:
        return {
            "schema_version": OP_TABLE_SCHEMA_VERSION,
            "steps": self.steps,
            "device": self.device,
            "ranks": self.ranks,
            "ops": self.ops.to_dict(orient="records"),
        }

    def write(self, path: Path) -> None:
        """Write the table as JSON, whole or not at all (raises RunWriteError naming the path)."""
        write_text_atomically(path, json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def read(cls, path: Path) -> OpTable:
        """The table written at `path`; a RecordError naming the path for a missing, damaged or foreign file."""
        stored = read_json_object(path, "op table")
        version = stored.get("schema_version")
        if version != OP_TABLE_SCHEMA_VERSION:
            raise RecordError(f"{path}: op table schema_version={version!r}, this taxbench reads "
                              f"{OP_TABLE_SCHEMA_VERSION}; analyse it with the taxbench version that wrote it")
        try:
            return cls(_ops_frame(stored["ops"]), int(stored["steps"]), str(stored["device"]), int(stored["ranks"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise RecordError(f"{path}: damaged op table ({type(exc).__name__}: {exc})") from exc


def _ops_frame(rows: list[dict]) -> pd.DataFrame:
    """Rows as written by OpTable.to_dict, checked field by field (a KeyError, TypeError or ValueError if not)."""
    if not isinstance(rows, list):
        raise TypeError("ops is not a list")
    checked = []
    for row in rows:
        values = (str(row["op"]), str(row["device"]), float(row["self_us_per_step"]), float(row["calls_per_step"]))
        if not all(math.isfinite(v) and v >= 0 for v in values[2:]):
            raise ValueError(f"op {values[0]!r}: times and calls must be finite and >= 0")
        checked.append(values)
    return pd.DataFrame(checked, columns=list(OP_COLUMNS)).astype(
        {"op": str, "device": str, "self_us_per_step": float, "calls_per_step": float})


def profile_ops(run: Callable[[], None], steps: int, device: str) -> OpTable:
    """Run `run` (which executes `steps` steps) under torch.profiler and return its ops' self time and calls per
    step. `device` is "cpu" or "cuda": on CUDA kernels are recorded too, by name, with their device time."""
    if device not in DEVICES:
        raise ValueError(f"cannot profile ops on device {device!r}; supported: {DEVICES}")
    if steps < 1:
        raise ValueError(f"profile at least one step, got {steps}")
    # Imported here: analysis reads op tables through this module and should not pay torch's 2 s import for it.
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    # Kineto (read when the profiler starts) would print a "USDT: profiler_start/stop" line per profiled block into
    # the progress display; a level the user set is kept.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    with profile(activities=activities, record_shapes=False, with_stack=False, profile_memory=False,
                 with_flops=False, with_modules=False) as profiler:
        run()
    rows = []
    for event in profiler.key_averages():
        if event.device_type == DeviceType.CPU:
            rows.append((event.key, "cpu", event.self_cpu_time_total, event.count))
        elif event.device_type == DeviceType.CUDA and not event.is_user_annotation:
            # A record_function range is mirrored on the GPU timeline as an annotation spanning its kernels: its
            # device time is theirs again.
            rows.append((event.key, "cuda", event.self_device_time_total, event.count))
    ops = pd.DataFrame(rows, columns=["op", "device", "self_us", "calls"])
    ops = ops.groupby(["op", "device"], as_index=False, sort=True)[["self_us", "calls"]].sum()
    table = pd.DataFrame({
        "op": ops["op"].astype(str),
        "device": ops["device"].astype(str),
        "self_us_per_step": ops["self_us"].astype(float) / steps,
        "calls_per_step": ops["calls"].astype(float) / steps,
    })
    return OpTable(table, steps, device)


def profile_steps(trainer: Trainer, steps: int, block: int, on_step: Callable[[], None] | None = None) -> OpTable:
    """Run `trainer.run_block(steps, block, on_step)` under torch.profiler: per-op self time and calls per step (see
    the module docstring for what the table covers)."""
    device = trainer.ctx.device.type
    return profile_ops(lambda: trainer.run_block(steps, block, on_step), steps, device)
