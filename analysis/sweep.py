"""Sweeps: a folder whose subfolders hold experiment directories (Hydra multirun, Slurm arrays, or hand-made).

An experiment directory is one holding `deterministic-0/manifest.json`. Each point's GPU count is its manifest's
`layout.world_size`. A point that cannot be analysed (a crashed or unfinished job) stays in the table with its error
instead of hiding the rest of the sweep. The sweep's exit code is the worst of its points' (a proven gate failure, 3,
before missing evidence, 4, before a pass); a point that could not be analysed counts as incomplete (4).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from taxbench import exit_codes
from taxbench.analysis.experiment import ExperimentAnalysis, ExperimentSummary
from taxbench.analysis.results import write_result
from taxbench.analysis.summary import analyse_experiment
from taxbench.design import GATES, TIMED
from taxbench.rundir.read import RecordError
from taxbench.rundir.records import MANIFEST
from taxbench.rundir.run_manifest import load_manifest

# Folders below the sweep root searched for experiments: <sweep>/<job>/<experiment>/ and one level more.
MAX_DEPTH = 3
SWEEP_FILE = "sweep.csv"


@dataclass(frozen=True)
class PointName:
    """How a sweep point is named: by the Hydra overrides in which it differs from the other points."""

    name: str  # e.g. "cpu_ranks=2"; without such overrides, the point's folder under the sweep root
    overrides: tuple[str, ...]  # the distinguishing overrides, short form ("cpu_ranks=2"); wandb tags


def point_names(root: Path, experiments: list[Path]) -> dict[Path, PointName]:
    """Each point's name from its manifest's Hydra overrides (provenance): only the overrides whose values differ
    between the points, with the key's last component unless two such keys share it."""
    overrides = {path: _launch_overrides(path) for path in experiments}
    keys: list[str] = []
    for assignments in overrides.values():
        keys += [key for key in assignments if key not in keys]
    varying = [key for key in keys if len({assignments.get(key) for assignments in overrides.values()}) > 1]
    last = [key.rsplit(".", 1)[-1] for key in varying]
    short = {key: tail if last.count(tail) == 1 else key for key, tail in zip(varying, last, strict=True)}
    names = {}
    for path, assignments in overrides.items():
        shown = tuple(f"{short[key]}={assignments[key]}" for key in varying if key in assignments)
        folder = str(path.relative_to(root)) if path.is_relative_to(root) else path.name
        names[path] = PointName(",".join(shown) if shown else folder, shown)
    return names


def _launch_overrides(experiment: Path) -> dict[str, str]:
    """key -> value of the `key=value` overrides the experiment was launched with (none when not recorded)."""
    try:
        recorded = load_manifest(experiment / TIMED["deterministic"].name).overrides
    except RecordError:
        return {}
    pairs = (str(item).split("=", 1) for item in recorded if "=" in str(item))
    return {key.lstrip("+~"): value for key, value in pairs}


def is_experiment(path: Path) -> bool:
    return (path / TIMED["deterministic"].name / MANIFEST).is_file()


def find_experiments(root: Path, max_depth: int = MAX_DEPTH) -> list[Path]:
    """Experiment directories under root (not root itself), sorted by path; no descent into an experiment."""

    def walk(folder: Path, depth: int) -> Iterator[Path]:
        if depth > max_depth:
            return
        try:
            children = sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
        except OSError:
            return
        for child in children:
            if is_experiment(child):
                yield child
            elif child.name not in ("wandb", "report"):
                yield from walk(child, depth + 1)

    return list(walk(root, 1))


@dataclass
class SweepAnalysis:
    root: Path
    points: pd.DataFrame  # one row per experiment, sorted by (recipe, world_size)
    summaries: list[ExperimentSummary] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)  # experiment path -> why it was not analysed

    @property
    def deterministic_ok(self) -> bool:
        return not self.errors and all(s.deterministic_ok for s in self.summaries)

    @property
    def exit_code(self) -> int:
        codes = [s.exit_code for s in self.summaries] + [exit_codes.INCOMPLETE] * len(self.errors)
        return exit_codes.combined(codes) if codes else exit_codes.INCOMPLETE


POINT_COLUMNS = ("point", "experiment", "path", "recipe", "device", "world_size", "tax", "low", "high", "hl_tax",
                 "half_width", "conclusive", "steps_needed", "pairs", "confidence", "baseline_median_s",
                 "deterministic_median_s", "deterministic_ok", "outcome", *(gate.name for gate in GATES), "incomplete",
                 "code", "error")


def point_row(summary: ExperimentSummary, root: Path, name: PointName) -> dict[str, object]:
    tax = summary.tax
    row: dict[str, object] = {
        "point": name.name,
        "experiment": summary.experiment,
        "path": str(Path(summary.root).relative_to(root)) if Path(summary.root).is_relative_to(root) else summary.root,
        "recipe": summary.recipe,
        "device": summary.device,
        "world_size": summary.world_size,
        "tax": tax.tax,
        "low": tax.low,
        "high": tax.high,
        "hl_tax": tax.hl_tax,
        "half_width": tax.half_width,
        "conclusive": summary.conclusive,
        "steps_needed": summary.steps_needed,
        "pairs": tax.pairs,
        "confidence": tax.confidence,
        "baseline_median_s": tax.baseline_median_s,
        "deterministic_median_s": tax.deterministic_median_s,
        "deterministic_ok": summary.deterministic_ok,
        "outcome": summary.outcome,
        "incomplete": "; ".join(summary.problems + [f.describe() for f in summary.nonfinite if f.deterministic]
                                + [f for f in summary.faults if summary.fault_fired is False]),
        "code": summary.code,
        "error": "",
    }
    for verdict in summary.verdicts:
        row[verdict.gate] = verdict.outcome
    return row


def analyse_sweep(
    root: Path, on_experiment: Callable[[ExperimentAnalysis, PointName], None] | None = None
) -> SweepAnalysis:
    """Analyse every experiment under root; on_experiment sees each full analysis and the point's name (e.g. to write
    its report) before its step records are dropped, so a large sweep never holds more than one experiment in
    memory."""
    experiments = find_experiments(root)
    if not experiments:
        raise RecordError(
            f"{root}: no experiment directories (folders with deterministic-0/{MANIFEST}) within {MAX_DEPTH} levels; "
            "pass an experiment directory or a sweep folder"
        )
    rows, summaries, errors = [], [], {}
    names = point_names(root, experiments)
    for path in experiments:
        try:
            analysis = analyse_experiment(path)
        except (RecordError, ValueError, KeyError, OSError) as exc:
            errors[str(path)] = f"{type(exc).__name__}: {exc}"
            rows.append({"point": names[path].name, "experiment": path.name, "path": str(path.relative_to(root)),
                         "outcome": "not analysed", "error": errors[str(path)]})
            continue
        if on_experiment is not None:
            on_experiment(analysis, names[path])
        summaries.append(analysis.summary)
        rows.append(point_row(analysis.summary, root, names[path]))
    points = pd.DataFrame(rows).reindex(columns=list(POINT_COLUMNS))
    points = points.sort_values(["recipe", "world_size", "path"], na_position="last", kind="stable")
    points = points.reset_index(drop=True)
    write_result(root / SWEEP_FILE, points.to_csv(index=False))
    return SweepAnalysis(root, points, summaries, errors)
