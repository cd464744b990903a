"""Weights & Biases logging of an experiment (one run) or a sweep (a group: one run per point plus a summary run).

wandb is an optional extra, imported only here and only when logging is asked for. WANDB_MODE defaults to offline,
so nothing needs a network or an API key; set WANDB_MODE=online (and log in) to upload, or `wandb sync` an offline
run later. Runs are written under the experiment (or sweep) folder: `<root>/wandb/offline-run-*`.

One folder is one wandb run: its id is derived from the folder, and logging it again (`taxbench report --wandb`)
replaces the local run folder it wrote before, so a later `wandb sync` uploads each experiment once. Online, the
second log resumes the same run (resume="allow").

The run summary holds results only (tax, interval, verdicts, outcome, throughput); per-step and per-block series are
defined with summary="none", so their last sample does not pose as a result. `_runtime`, `_step` and `_timestamp` are
wandb's own bookkeeping (written by wandb-core; `_runtime` is how long the logging took, not the experiment).

Nothing secret is logged: the config goes through taxbench.redaction, and wandb's own metadata capture (command
line, git remote, code, requirements, system stats) is switched off because a command line or a remote URL can
carry a token.
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
from pathlib import Path
from types import ModuleType
from typing import Any

from taxbench.analysis.cost import PARTS
from taxbench.analysis.equivalence import Equivalence
from taxbench.analysis.experiment import ARMS, ExperimentAnalysis, ExperimentSummary
from taxbench.analysis.layouts import LayoutsAnalysis
from taxbench.analysis.report import EQUIVALENCE_PNG, STEP_TIME_PNG, SWEEP_PNG
from taxbench.analysis.results import finite_or_none
from taxbench.analysis.stacks_matrix import StacksSummary
from taxbench.analysis.stacks_text import matrix_rows
from taxbench.analysis.sweep import PointName, SweepAnalysis
from taxbench.analysis.text import (
    first_difference_text,
    headline,
    repeatable_text,
    verdict_line,
    weights_text,
)
from taxbench.config.schema import ReportConfig
from taxbench.design import GATES, TIMED
from taxbench.redaction import redact

INSTALL_HINT = "pip install 'taxbench[wandb]'"
# Series logged per step (x axis "step") and per block (x axis "block"), one panel per metric with both arms.
STEP_SERIES = ("step_time/*", "loss/*", "grad_norm/*", "tokens_per_s/*")
BLOCK_SERIES = ("block_tax/*",)
GATE_COLUMNS = ["gate", "strict", "outcome", "agree", "reference", "candidate", "compared_steps", "from_step",
                "mismatch_step", "mismatch_rank", "mismatch_metric", "reference_value", "candidate_value"]
# Baseline equivalence: its results in the run summary, and one typed row per compared step in a table.
EQUIVALENCE_RESULTS = ("verdict", "equivalent", "statistic", "threshold", "n_steps", "steps_inside", "basis",
                       "from_step", "max_deviation", "median_deviation", "median_band", "median_baseline_gap",
                       "nonfinite_steps")
EQUIVALENCE_COLUMNS = ["step", "baseline_0", "baseline_1", "deterministic", "center", "band", "deviation", "inside"]
MAX_TAG_LENGTH = 64  # wandb refuses longer tags


class WandbUnavailable(RuntimeError):
    """wandb logging was asked for but the wandb package is not installed."""


def import_wandb() -> ModuleType:
    try:
        import wandb
    except ImportError as exc:
        raise WandbUnavailable(
            f"wandb logging needs the wandb package: {INSTALL_HINT}, or turn it off with report.wandb=false"
        ) from exc
    return wandb


def wandb_mode() -> str:
    """offline unless the user chose a mode with WANDB_MODE (online, offline, disabled).

    Passed to wandb.init explicitly: wandb reads the environment once per process, so setting WANDB_MODE around a
    call would not reach a second run in the same process.
    """
    return os.environ.get("WANDB_MODE") or "offline"


def run_id(root: Path, kind: str) -> str:
    """The wandb run id of the experiment or sweep folder `root`: the same every time it is logged."""
    return hashlib.sha256(f"taxbench:{kind}:{root.resolve()}".encode()).hexdigest()[:16]


def _drop_earlier_logs(root: Path, wandb_id: str) -> None:
    """Remove the local run folders (offline-run-<time>-<id>, run-<time>-<id>) of earlier logs of this run: a later
    `wandb sync` of the wandb folder would upload each of them again."""
    for folder in (root / "wandb").glob(f"*run-*-{wandb_id}"):
        if folder.is_dir() and not folder.is_symlink():
            shutil.rmtree(folder)


def _init(wandb: ModuleType, settings: ReportConfig, root: Path, kind: str, name: str, group: str | None,
          config: dict[str, Any], tags: tuple[str, ...] = ()) -> Any:
    wandb_id = run_id(root, kind)
    _drop_earlier_logs(root, wandb_id)
    return wandb.init(
        project=settings.wandb_project,
        entity=settings.wandb_entity,
        group=settings.wandb_group or group,
        job_type=kind,
        name=name,
        id=wandb_id,
        resume="allow",
        tags=[tag[:MAX_TAG_LENGTH] for tag in tags],
        mode=wandb_mode(),
        dir=str(root),
        config=redact(config),
        reinit="create_new",
        settings=wandb.Settings(
            silent=True, console="off", save_code=False, disable_code=True, disable_git=True, x_disable_meta=True,
            x_disable_stats=True, x_save_requirements=False,
        ),
    )


def _experiment_config(analysis: ExperimentAnalysis) -> dict[str, Any]:
    manifest = analysis.manifests[TIMED["deterministic"].name]
    return {
        "experiment": analysis.summary.experiment,
        "recipe": manifest.recipe,
        "experiment_settings": manifest.experiment_config,
        "cluster": manifest.cluster,
        "arms": {arm: analysis.manifests[f"{arm}-0"].policy for arm in ARMS},
        "policy_applied": {arm: analysis.manifests[f"{arm}-0"].policy_applied for arm in ARMS},
        "layout": manifest.layout,
        "stack": manifest.stack,
        "world_size": analysis.summary.world_size,
        "device": analysis.summary.device,
    }


def _step_rows(analysis: ExperimentAnalysis) -> list[dict[str, Any]]:
    series = analysis.step_series
    rows = []
    for step in sorted(set().union(*(frame.index for frame in series.values()))):
        row: dict[str, Any] = {"step": int(step)}
        for arm, frame in series.items():
            if step not in frame.index:
                continue
            for metric, value in frame.loc[step].items():
                if value is not None and math.isfinite(float(value)):
                    key = "step_time/{arm}_s" if metric == "step_time" else f"{metric}/{{arm}}"
                    row[key.format(arm=arm)] = float(value)
        rows.append(row)
    return rows


def gate_table_rows(summary: ExperimentSummary) -> list[list[Any]]:
    """The gates as typed rows (GATE_COLUMNS): bools, ints and strings, None where a gate has no mismatch."""
    rows = []
    for verdict, gate in zip(summary.verdicts, GATES, strict=True):
        m = verdict.first_mismatch
        rows.append([verdict.gate, gate.strict, verdict.outcome, verdict.agree, verdict.reference, verdict.candidate,
                     verdict.compared_steps, verdict.from_step, None if m is None else m.step,
                     None if m is None else m.rank, None if m is None else m.metric,
                     None if m is None else m.expected, None if m is None else m.actual])
    return rows


def equivalence_table_rows(equivalence: Equivalence) -> list[list[Any]]:
    """Per compared step (EQUIVALENCE_COLUMNS): an int step, float losses (None where not finite), a bool."""
    columns = (equivalence.baseline_0, equivalence.baseline_1, equivalence.deterministic, equivalence.center,
               equivalence.band, equivalence.deviation)
    return [[int(step), *(finite_or_none(float(column[i])) for column in columns), bool(equivalence.inside[i])]
            for i, step in enumerate(equivalence.steps)]


KNOB_COLUMNS = ["knob", "description", "cost_status", "tax", "low", "high", "needed_status", "needed"]


def knob_table_rows(summary: ExperimentSummary) -> list[list[Any]]:
    """The ablation's knobs as typed rows (KNOB_COLUMNS): floats (None: not measured), a bool or None for needed."""
    rows = []
    for knob in summary.ablation:
        tax = knob.tax
        numbers = [None, None, None] if tax is None else [finite_or_none(v) for v in (tax.tax, tax.low, tax.high)]
        rows.append([knob.knob, knob.description, knob.cost_status, *numbers, knob.needed_status, knob.needed])
    return rows


def summary_values(summary: ExperimentSummary) -> dict[str, Any]:
    """The results of an experiment as wandb summary keys: tax and interval, verdicts, outcome, throughput."""
    values: dict[str, Any] = {f"tax/{key}": value for key, value in summary.tax.to_dict().items()}
    values["deterministic_ok"] = summary.deterministic_ok
    values["outcome"] = summary.outcome
    values["verdict"] = verdict_line(summary)[1]
    values["headline"] = headline(summary)
    values["conclusive"] = summary.conclusive
    values["planted_tax"] = summary.planted_tax
    values["calibration"] = summary.calibration
    values["exit_code"] = summary.exit_code
    values["incomplete"] = "\n".join(summary.problems)
    values["nonfinite"] = "\n".join(f.describe() for f in summary.nonfinite)
    values["diverged"] = summary.diverged
    values["fault"] = "\n".join(summary.faults)
    values["steps_needed"] = summary.steps_needed
    for verdict in summary.verdicts:
        m = verdict.first_mismatch
        values[f"gate/{verdict.gate}/outcome"] = verdict.outcome
        values[f"gate/{verdict.gate}/agree"] = verdict.agree
        values[f"gate/{verdict.gate}/compared_steps"] = verdict.compared_steps
        values[f"gate/{verdict.gate}/first_mismatch"] = (
            "" if m is None else f"step {m.step}, rank {m.rank}, {m.metric}")
    equivalence = summary.equivalence.to_dict()
    values.update({f"equivalence/{key}": equivalence[key] for key in EQUIVALENCE_RESULTS})
    values["equivalence/max_deviation_missing"] = equivalence["max_deviation_missing"] or ""  # why it is NaN
    for knob in summary.ablation:
        if knob.tax is not None:
            values[f"knob/{knob.knob}/tax"] = finite_or_none(knob.tax.tax)
        values[f"knob/{knob.knob}/needed"] = knob.needed
    # Throughput (tokens/s, MFU, memory) and what the tax costs.
    for arm, measured in summary.throughput.items():
        if measured is not None:
            values.update({f"throughput/{arm}/{key}": value for key, value in measured.to_dict().items()})
    for key, value in summary.cost.items():
        values[f"cost/{key}"] = value
    if summary.cost_split is not None:  # where the launch's wall clock went, as shares
        values["wall_clock/seconds"] = summary.cost_split.wall_s
        values.update({f"wall_clock/{part}": summary.cost_split.share(part) for part in PARTS})
    return values


def log_experiment(analysis: ExperimentAnalysis, settings: ReportConfig, report_dir: Path | None = None,
                   group: str | None = None, point: PointName | None = None) -> Path:
    """One wandb run: per-step times, loss, grad norm and tokens/s of both timed runs, the per-block tax, the tax and
    the gates; a sweep point is named and tagged by its overrides. Returns the run folder."""
    wandb = import_wandb()
    summary = analysis.summary
    root = Path(summary.root)
    run = _init(wandb, settings, root, "experiment", point.name if point else summary.experiment, group,
                _experiment_config(analysis), point.overrides if point else ())
    try:
        run.define_metric("step", summary="none")
        run.define_metric("block", summary="none")
        for pattern in STEP_SERIES:
            run.define_metric(pattern, step_metric="step", summary="none")
        for pattern in BLOCK_SERIES:
            run.define_metric(pattern, step_metric="block", summary="none")
        for row in _step_rows(analysis):
            run.log(row)
        ratios = analysis.block_ratios
        for block, ratio in ratios["ratio"].items():
            run.log({"block": int(block), "block_tax/ratio": float(ratio)})
        media: dict[str, Any] = {"gates": wandb.Table(columns=GATE_COLUMNS, data=gate_table_rows(summary))}
        if report_dir is not None and (report_dir / STEP_TIME_PNG).is_file():
            media["plots/step_times"] = wandb.Image(str(report_dir / STEP_TIME_PNG))
        if summary.equivalence.evaluated:  # (an earlier report's plot may still lie in report_dir otherwise)
            media["equivalence"] = wandb.Table(columns=EQUIVALENCE_COLUMNS,
                                               data=equivalence_table_rows(summary.equivalence))
            if report_dir is not None and (report_dir / EQUIVALENCE_PNG).is_file():
                media["plots/equivalence"] = wandb.Image(str(report_dir / EQUIVALENCE_PNG))
        if summary.ablation:
            media["knobs"] = wandb.Table(columns=KNOB_COLUMNS, data=knob_table_rows(summary))
        for arm, ops in summary.attribution.items():
            media[f"top_ops/{arm}"] = wandb.Table(dataframe=ops)
        run.log(media)
        run.summary.update(summary_values(summary))
        run_dir = Path(run.dir).parent
    finally:
        run.finish()
    return run_dir


def log_sweep(sweep: SweepAnalysis, settings: ReportConfig, report_dir: Path | None = None) -> Path:
    """The sweep's summary run in group <sweep folder>: a wandb.Table of all points and tax vs GPU count."""
    wandb = import_wandb()
    points = sweep.points
    group = settings.wandb_group or sweep.root.name
    run = _init(wandb, settings, sweep.root, "sweep", f"{sweep.root.name}-summary", group,
                {"sweep": str(sweep.root.name), "points": len(points)})
    try:
        run.define_metric("world_size", summary="none")
        run.define_metric("sweep/*", step_metric="world_size", summary="none")
        analysed = points[points["error"].fillna("") == ""].sort_values("world_size")
        for row in analysed.to_dict("records"):
            run.log({"world_size": int(row["world_size"]), "sweep/tax": float(row["tax"]),
                     "sweep/tax_low": float(row["low"]), "sweep/tax_high": float(row["high"])})
        table = points.astype(object).where(points.notna(), None)
        media: dict[str, Any] = {"sweep": wandb.Table(dataframe=table)}
        if report_dir is not None and (report_dir / SWEEP_PNG).is_file():
            media["plots/tax_vs_gpus"] = wandb.Image(str(report_dir / SWEEP_PNG))
        run.log(media)
        run.summary.update({"deterministic_ok": sweep.deterministic_ok, "exit_code": sweep.exit_code,
                            "points": len(points), "errors": len(sweep.errors),
                            "incomplete": int((points["outcome"] == "incomplete").sum())})
        run_dir = Path(run.dir).parent
    finally:
        run.finish()
    return run_dir


LAYOUT_COLUMNS = ["layout", "pp", "tp", "dp", "ep", "data_parallel", "repeatable", "outcome", "median_step_s",
                  "wall_s"]
LAYOUT_PAIR_COLUMNS = ["reference", "candidate", "step0_weights", "first_difference_step", "first_difference_metric",
                       "first_difference", "max_loss_ulp", "max_grad_norm_ulp", "final_weights"]
LAYOUT_ULP_COLUMNS = ["step", "reference", "candidate", "loss_ulp", "grad_norm_ulp"]


def log_layouts(analysis: LayoutsAnalysis, settings: ReportConfig, group: str | None = None) -> Path:
    """One wandb run for a `taxbench layouts` folder: a table of layouts, one of layout pairs, one of per-step ulps,
    and the verdict in the summary. Returns the run folder."""
    wandb = import_wandb()
    summary = analysis.summary
    plan = summary.plan
    root = Path(summary.root)
    run = _init(wandb, settings, root, "layouts", root.name, group,
                {"recipe": plan.recipe, "arm": plan.arm, "steps": plan.steps, "world_size": plan.world_size,
                 "layouts": plan.layouts}, ("layouts",))
    try:
        layouts = [[layout.name, *(layout.layout.get(key) for key in ("pp", "tp", "dp", "ep", "data_parallel")),
                    repeatable_text(layout.repeatable), layout.repeatable.outcome,
                    finite_or_none(layout.median_step_s), layout.seconds] for layout in summary.layouts]
        pairs = [[pair.reference, pair.candidate, weights_text(pair.initial_weights_identical),
                  None if pair.first_difference is None else pair.first_difference[0],
                  None if pair.first_difference is None else pair.first_difference[1],
                  first_difference_text(pair), pair.max_ulp("loss"), pair.max_ulp("grad_norm"),
                  weights_text(pair.final_weights_identical)] for pair in summary.pairs]
        ulps = [[step, pair.reference, pair.candidate, loss, norm] for pair in summary.pairs
                for step, loss, norm in zip(pair.steps, pair.loss_ulp, pair.grad_norm_ulp, strict=True)]
        run.define_metric("step", summary="none")
        for metric in ("loss/*", "grad_norm/*"):
            run.define_metric(metric, step_metric="step", summary="none")
        for step, values in analysis.step_values().iterrows():
            run.log({"step": int(step), **{key: float(v) for key, v in values.items() if math.isfinite(v)}})
        run.log({"layouts": wandb.Table(columns=LAYOUT_COLUMNS, data=layouts),
                 "layout_pairs": wandb.Table(columns=LAYOUT_PAIR_COLUMNS, data=pairs),
                 "layout_ulps": wandb.Table(columns=LAYOUT_ULP_COLUMNS, data=ulps)})
        run.summary.update({"verdict": summary.verdict()[1], "exit_code": summary.exit_code,
                            "initial_weights_identical": summary.initial_weights_identical,
                            "not_repeatable": ", ".join(summary.not_repeatable),
                            "incomplete": "\n".join(summary.problems)})
        run_dir = Path(run.dir).parent
    finally:
        run.finish()
    return run_dir


# HEADER's columns (the words), then the tax as numbers
STACK_COLUMNS = ["cell", "stack", "recipe", "parameters", "deterministic_arm", "tax_text",
                 *(gate.name for gate in GATES), "outcome", "tax", "tax_low", "tax_high", "half_width", "conclusive",
                 "reason"]


def log_stacks(summary: StacksSummary, settings: ReportConfig, group: str | None = None) -> Path:
    """One wandb run for a `taxbench stacks` folder: the matrix as a table (the words the console shows, and the
    tax and its interval as numbers) and the verdict in the summary. Returns the run folder."""
    wandb = import_wandb()
    plan = summary.plan
    root = Path(summary.root)
    run = _init(wandb, settings, root, "stacks", root.name, group,
                {"family": plan.family, "steps": plan.steps, "world_size": plan.world_size, "device": plan.device,
                 "cells": [cell.name for cell in plan.cells]}, ("stacks",))
    try:
        rows = []
        for cell, words in zip(summary.cells, matrix_rows(summary), strict=True):
            tax = cell.summary.tax if cell.summary else None
            numbers = [None] * 4 if tax is None else [finite_or_none(tax.tax), finite_or_none(tax.low),
                                                      finite_or_none(tax.high), finite_or_none(tax.half_width)]
            rows.append([cell.cell.name, *words, cell.outcome, *numbers,
                         None if cell.summary is None else cell.summary.conclusive, cell.cell.reason])
        run.log({"stacks": wandb.Table(columns=STACK_COLUMNS, data=rows)})
        run.summary.update({"verdict": summary.verdict()[1], "exit_code": summary.exit_code,
                            "cells_run": len(summary.ran), "cells": len(summary.cells)})
        run_dir = Path(run.dir).parent
    finally:
        run.finish()
    return run_dir
