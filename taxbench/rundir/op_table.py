"""A per-op profile table on disk (ops.rank<R>.json): self time and calls per step of every op, as
taxbench.train.op_profile measures them and taxbench.analysis.attribution compares them. Torch-free."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from taxbench.rundir.json_object import RecordError, UnreadableRecords, read_json_object
from taxbench.rundir.records import write_text_atomically

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
            raise UnreadableRecords(f"{path}: damaged op table ({type(exc).__name__}: {exc})") from exc


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
