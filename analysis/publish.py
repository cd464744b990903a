"""After an experiment or for `taxbench report`: analyse, write the HTML/markdown report, log to wandb, print a summary.

A folder holding deterministic-0/ is one experiment, a folder holding layouts.json the output of `taxbench layouts`
(taxbench.analysis.layouts); any other folder is treated as a sweep of the experiments below it (see
taxbench.analysis.sweep).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from taxbench.analysis.layouts import analyse_layouts, is_layouts_folder, render_layouts
from taxbench.analysis.report import REPORT_DIR, write_experiment_report, write_layouts_report, write_sweep_report
from taxbench.analysis.summary import ExperimentAnalysis, analyse_experiment, render
from taxbench.analysis.sweep import PointName, analyse_sweep, is_experiment, render_sweep
from taxbench.analysis.wandb_log import WandbUnavailable, import_wandb, log_experiment, log_layouts, log_sweep
from taxbench.config.schema import ReportConfig
from taxbench.diagnostics import logger

log = logger(__name__)


@dataclass(frozen=True)
class Published:
    deterministic_ok: bool  # both strict gates have positive evidence of agreement (every point, for a sweep)
    report: Path | None  # report.html, when written
    wandb_runs: tuple[Path, ...]  # local wandb run folders
    # taxbench.exit_codes: OK, NOT_DETERMINISTIC (a strict gate failed) or INCOMPLETE (missing evidence); a sweep's
    # is the worst of its points', an unanalysable point counting as incomplete
    exit_code: int


def _say_wandb(runs: list[Path], console: Console | None) -> None:
    if runs:
        offline = " offline (upload with `wandb sync <run folder>`)" if runs[-1].name.startswith("offline-") else ""
        many = f" ({len(runs)} runs)" if len(runs) > 1 else ""
        # The path on a line of its own, never folded, so that it can be copied (also from a piped log).
        shown = console or Console()
        shown.print(f"wandb{offline}{many}:", soft_wrap=True)
        shown.print(escape(str(runs[-1])), soft_wrap=True)


def _wandb(strict: bool, log_to_wandb: Callable[..., Path], *args: object) -> Path | None:
    """Run one wandb logging call. After an experiment (strict=False) a wandb problem is a warning: the results and
    the report are already on disk. When the user asked for wandb explicitly (strict=True) it is an error."""
    try:
        return log_to_wandb(*args)
    except Exception as exc:  # wandb raises many types (UsageError, CommError, ...); none may cost the results
        if strict:
            raise
        log.warning("wandb logging failed (%s: %s); the report and results are on disk", type(exc).__name__, exc)
    return None


def publish(root: Path, settings: ReportConfig, group: str | None = None, strict_wandb: bool = False,
            console: Console | None = None) -> Published:
    root = root.resolve()
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such directory; pass an experiment directory or a sweep folder")
    if settings.wandb:
        try:
            import_wandb()  # decide before the analysis, and warn once rather than once per sweep point
        except WandbUnavailable as exc:
            if strict_wandb:
                raise
            log.warning("wandb logging skipped: %s", exc)
            settings = replace(settings, wandb=False)
    if is_layouts_folder(root):
        return _publish_layouts(root, settings, group, strict_wandb, console)
    return (_publish_experiment if is_experiment(root) else _publish_sweep)(root, settings, group, strict_wandb,
                                                                            console)


def _publish_layouts(root: Path, settings: ReportConfig, group: str | None, strict_wandb: bool,
                     console: Console | None) -> Published:
    analysis = analyse_layouts(root)
    html = write_layouts_report(analysis) if settings.html else None
    runs = []
    if settings.wandb and (run := _wandb(strict_wandb, log_layouts, analysis, settings, group)):
        runs.append(run)
    render_layouts(analysis.summary, console, html)
    _say_wandb(runs, console)
    summary = analysis.summary
    return Published(not summary.not_repeatable and not summary.problems, html, tuple(runs), summary.exit_code)


def _publish_experiment(root: Path, settings: ReportConfig, group: str | None, strict_wandb: bool,
                        console: Console | None) -> Published:
    analysis = analyse_experiment(root)
    html = write_experiment_report(analysis) if settings.html else None
    runs = []
    if settings.wandb and (run := _wandb(strict_wandb, log_experiment, analysis, settings,
                                         html.parent if html else None, group)):
        runs.append(run)
    render(analysis.summary, console, html)
    _say_wandb(runs, console)
    return Published(analysis.summary.deterministic_ok, html, tuple(runs), analysis.summary.exit_code)


def _publish_sweep(root: Path, settings: ReportConfig, group: str | None, strict_wandb: bool,
                   console: Console | None) -> Published:
    point_reports: dict[str, Path] = {}
    runs: list[Path] = []
    group = settings.wandb_group or group or root.name

    def each(analysis: ExperimentAnalysis, point: PointName) -> None:
        html = write_experiment_report(analysis) if settings.html else None
        if html is not None:
            point_reports[analysis.summary.root] = html
        if settings.wandb and (run := _wandb(strict_wandb, log_experiment, analysis, settings,
                                             html.parent if html else None, group, point)):
            runs.append(run)

    sweep = analyse_sweep(root, each)
    html = write_sweep_report(sweep, point_reports) if settings.html else None
    if settings.wandb and (run := _wandb(strict_wandb, log_sweep, sweep, settings, html.parent if html else None)):
        runs.append(run)
    render_sweep(sweep, console, html)
    _say_wandb(runs, console)
    return Published(sweep.deterministic_ok, html, tuple(runs), sweep.exit_code)


def report(
    root: Path, settings: ReportConfig | None = None, group: str | None = None, strict_wandb: bool = False
) -> int:
    """Analyse an experiment (or a sweep folder), write its report and wandb run per settings, print the summary.

    Without settings (`taxbench analyse`): no wandb, and report/ is rewritten where it exists, so that it never
    contradicts the summary.json that the analysis has just rewritten."""
    settings = settings or ReportConfig(html=(root / REPORT_DIR).exists(), wandb=False)
    return publish(root, settings, group=group, strict_wandb=strict_wandb).exit_code
