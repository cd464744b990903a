"""Load step records of run directories into pandas, rejecting other schema versions."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from taxbench.records import MANIFEST, SCHEMA_VERSION


class RecordError(ValueError):
    """A run directory or record file that cannot be analysed; the message names the file."""


def _read_stream(path: Path) -> list[dict]:
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if number == len(lines) and not text.endswith("\n"):
                break  # torn final record of a crashed run: everything before it stands
            raise RecordError(f"{path}:{number}: not a JSON record ({exc.msg})") from exc
        version = record.get("schema_version")
        if version != SCHEMA_VERSION:
            raise RecordError(
                f"{path}:{number}: schema_version={version!r}, this taxbench reads {SCHEMA_VERSION}; analyse it with "
                "the taxbench version that wrote it"
            )
        records.append(record)
    return records


def load_run(run_dir: Path) -> pd.DataFrame:
    """All ranks' step records of one run, sorted by (step, rank)."""
    files = sorted(run_dir.glob("steps.rank*.jsonl"))
    if not files:
        raise RecordError(f"{run_dir}: no steps.rank<R>.jsonl files; is this a taxbench run directory?")
    records = [r for f in files for r in _read_stream(f)]
    if not records:
        raise RecordError(f"{run_dir}: the step record files are empty")
    frame = pd.DataFrame.from_records(records)
    return frame.sort_values(["step", "rank"], kind="stable").reset_index(drop=True)


def load_manifest(run_dir: Path) -> dict:
    path = run_dir / MANIFEST
    if not path.exists():
        raise RecordError(f"{path}: missing manifest")
    manifest = json.loads(path.read_text(encoding="utf-8"))
    if manifest.get("schema_version") != SCHEMA_VERSION:
        raise RecordError(f"{path}: schema_version={manifest.get('schema_version')!r}, expected {SCHEMA_VERSION}")
    return manifest


def step_times(frame: pd.DataFrame) -> pd.DataFrame:
    """Per-step time of the whole job (the slowest rank) with its block, sorted by step."""
    grouped = frame.groupby("step", sort=True).agg(time_s=("time_s", "max"), block=("block", "first"))
    return grouped.reset_index()
