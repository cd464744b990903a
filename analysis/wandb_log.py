"""Weights & Biases logging of an experiment (one run) or a sweep (a group: one run per point plus a summary run).

wandb is an optional extra, imported only here and only when logging is asked for. WANDB_MODE defaults to offline,
so nothing needs a network or an API key; set WANDB_MODE=online (and log in) to upload, or `wandb sync` an offline
run later. Runs are written under the experiment (or sweep) folder: `<root>/wandb/offline-run-*`.

Nothing secret is logged: the config goes through taxbench.redaction, and wandb's own metadata capture (command
line, git remote, code, requirements, system stats) is switched off because a command line or a remote URL can
carry a token.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType
from typing import Any

from taxbench.analysis.records import step_times
from taxbench.analysis.report import GATE_HEADER, STEP_TIME_PNG, SWEEP_PNG, gate_rows
from taxbench.analysis.summary import ExperimentAnalysis, verdict_line
from taxbench.analysis.sweep import SweepAnalysis
from taxbench.analysis.tax import block_ratios
from taxbench.config import ReportConfig
from taxbench.redaction import redact

INSTALL_HINT = "pip install 'taxbench[wandb]'"
ARMS = ("baseline", "deterministic")


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


def _init(wandb: ModuleType, settings: ReportConfig, root: Path, name: str, job_type: str, group: str | None,
          config: dict[str, Any]) -> Any:
    return wandb.init(
        project=settings.wandb_project,
        entity=settings.wandb_entity,
        group=settings.wandb_group or group,
        job_type=job_type,
        name=name,
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
    manifest = analysis.manifests["deterministic-0"]
    return {
        "experiment": analysis.summary.experiment,
        "recipe": manifest["config"]["recipe"],
        "experiment_settings": manifest["config"]["experiment"],
        "cluster": manifest["config"]["cluster"],
        "arms": {arm: analysis.manifests[f"{arm}-0"]["policy"] for arm in ARMS},
        "policy_applied": {arm: analysis.manifests[f"{arm}-0"]["policy_applied"] for arm in ARMS},
        "layout": manifest["layout"],
        "stack": manifest["stack"],
        "world_size": analysis.summary.world_size,
        "device": analysis.summary.device,
    }


def log_experiment(analysis: ExperimentAnalysis, settings: ReportConfig, report_dir: Path | None = None,
                   group: str | None = None) -> Path:
    """One wandb run: per-step times of both timed runs, per-block tax, the tax, the gates; returns the run folder."""
    wandb = import_wandb()
    summary, tax = analysis.summary, analysis.summary.tax
    root = Path(summary.root)
    run = _init(wandb, settings, root, summary.experiment, "experiment", group, _experiment_config(analysis))
    try:
        run.define_metric("step")
        run.define_metric("step_time/*", step_metric="step")
        run.define_metric("block")
        run.define_metric("block_tax/*", step_metric="block")
        times = {arm: step_times(analysis.runs[f"{arm}-0"]).set_index("step")["time_s"] for arm in ARMS}
        for step in sorted(set(times["baseline"].index) | set(times["deterministic"].index)):
            row: dict[str, Any] = {"step": int(step)}
            for arm, series in times.items():
                if step in series.index:
                    row[f"step_time/{arm}_s"] = float(series[step])
            run.log(row)
        ratios = block_ratios(analysis.timed["baseline"], analysis.timed["deterministic"], tax.warmup_steps)
        for block, ratio in ratios["ratio"].items():
            run.log({"block": int(block), "block_tax/ratio": float(ratio)})
        values: dict[str, Any] = {f"tax/{key}": value for key, value in tax.to_dict().items()}
        values["deterministic_ok"] = summary.deterministic_ok
        values["outcome"] = summary.outcome
        values["verdict"] = verdict_line(summary)[1]
        values["exit_code"] = summary.exit_code
        values["incomplete"] = "\n".join(summary.problems)
        values["fault"] = "\n".join(summary.faults)
        values["steps_needed"] = summary.steps_needed
        values["headline"] = summary.headline()
        values["conclusive"] = summary.conclusive
        values["planted_tax"] = summary.planted_tax
        values["calibration"] = summary.calibration
        for verdict in summary.verdicts:
            m = verdict.first_mismatch
            values[f"gate/{verdict.gate}/outcome"] = verdict.outcome
            values[f"gate/{verdict.gate}/agree"] = verdict.agree
            values[f"gate/{verdict.gate}/compared_steps"] = verdict.compared_steps
            values[f"gate/{verdict.gate}/first_mismatch"] = (
                "" if m is None else f"step {m.step}, rank {m.rank}, {m.metric}")
        rows, _ = gate_rows(summary)
        media: dict[str, Any] = {"gates": wandb.Table(columns=GATE_HEADER, data=rows)}
        if report_dir is not None and (report_dir / STEP_TIME_PNG).is_file():
            media["plots/step_times"] = wandb.Image(str(report_dir / STEP_TIME_PNG))
        run.log(media)
        run.summary.update(values)
        run_dir = Path(run.dir).parent
    finally:
        run.finish()
    return run_dir


def log_sweep(sweep: SweepAnalysis, settings: ReportConfig, report_dir: Path | None = None) -> Path:
    """The sweep's summary run in group <sweep folder>: a wandb.Table of all points and tax vs GPU count."""
    wandb = import_wandb()
    points = sweep.points
    group = settings.wandb_group or sweep.root.name
    run = _init(wandb, settings, sweep.root, f"{sweep.root.name}-summary", "sweep", group,
                {"sweep": str(sweep.root.name), "points": len(points)})
    try:
        run.define_metric("world_size")
        run.define_metric("sweep/*", step_metric="world_size")
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
