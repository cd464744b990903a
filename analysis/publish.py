"""After an experiment or for `taxbench report`: analyse, write the HTML/markdown report, log to wandb, print a summary.

A folder holding deterministic-0/ (or a run folder or summary.json of one) is one experiment, a folder holding
layouts.json the output of `taxbench layouts` (taxbench.analysis.layouts), a folder holding stacks.json the output of
`taxbench stacks` (taxbench.analysis.stacks_matrix), a folder a taxbench multirun created and
marked (taxbench.rundir.experiment_folder.SWEEP_MARKER) a sweep of the experiments below it (taxbench.analysis.sweep).
Any other folder is refused (exit 2) naming what it holds: a reading command acts on what it was pointed at, never on
experiments it happens to find below a shared folder.

The reading commands (`analyse`, `report`: `read_and_report`) write only inside the folder they were pointed at, and
nothing in a folder a live launch holds (taxbench.rundir.write_scope). When the analysis of an experiment is refused,
the verdict an older analysis left there (summary.json, report/) is withdrawn (`withdraw_verdict`), so that nothing in
the folder says "passed" any more.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from html import escape as html_escape
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from taxbench.analysis.console import render, render_layouts, render_stacks, render_sweep
from taxbench.analysis.document import HTML_FILE, MARKDOWN_FILE, REPORT_DIR
from taxbench.analysis.experiment import ExperimentAnalysis
from taxbench.analysis.layouts import analyse_layouts
from taxbench.analysis.report import (
    write_experiment_report,
    write_layouts_report,
    write_stacks_report,
    write_sweep_report,
)
from taxbench.analysis.results import may_write_result, write_result
from taxbench.analysis.stacks_matrix import analyse_stacks
from taxbench.analysis.summary import SUMMARY_FILE, analyse_experiment
from taxbench.analysis.sweep import MAX_DEPTH, PointName, analyse_sweep, find_experiments, is_experiment
from taxbench.analysis.wandb_log import (
    WandbUnavailable,
    import_wandb,
    log_experiment,
    log_layouts,
    log_stacks,
    log_sweep,
)
from taxbench.config.schema import ReportConfig
from taxbench.design import ALL_RUNS, TIMED
from taxbench.diagnostics import logger
from taxbench.rundir.experiment_folder import LOCK_FILE, SWEEP_MARKER, Holder, held_by, is_marked_sweep
from taxbench.rundir.json_object import ResultWriteError
from taxbench.rundir.plans import is_layouts_folder, is_stacks_folder
from taxbench.rundir.read import RecordError, leave_mirrors
from taxbench.rundir.records import MANIFEST
from taxbench.rundir.write_scope import reading

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
    # Analysing and reporting is where mirrors are asked for (reading alone writes none): the records are read
    # columnar from here on, by this analysis and every later one (none in a folder a live launch holds).
    if is_layouts_folder(root):
        leave_mirrors(root)
        return _publish_layouts(root, settings, group, strict_wandb, console)
    if is_stacks_folder(root):
        leave_mirrors(root)
        return _publish_stacks(root, settings, group, strict_wandb, console)
    if is_experiment(root) or looks_like_experiment(root):
        try:
            leave_mirrors(root)
            return _publish_experiment(root, settings, group, strict_wandb, console)
        except ResultWriteError:
            raise  # analysed, but a result could not be written: the summary.json it wrote holds the verdict
        except RecordError as exc:
            withdraw_verdict(root, exc)
            raise
    if is_marked_sweep(root):
        leave_mirrors(root)
        return _publish_sweep(root, settings, group, strict_wandb, console)
    raise RecordError(not_an_experiment(root))


def looks_like_experiment(root: Path) -> bool:
    """A folder holding a run folder or a summary of an experiment (its deterministic-0 manifest may be gone: the
    analysis then refuses it, and withdraws the verdict it holds)."""
    return (root / SUMMARY_FILE).exists() or any((root / ref.name).is_dir() for ref in ALL_RUNS)


def not_an_experiment(root: Path) -> str:
    """Why `root` is refused: what was found there, and how to name an experiment instead."""
    manifest = f"{TIMED['deterministic'].name}/{MANIFEST}"
    why = (f"{root} is neither an experiment folder (it has no {manifest}) nor a sweep folder that a taxbench "
           f"multirun created ({SWEEP_MARKER})")
    if (root / MANIFEST).exists():
        return (f"{root} is one run of an experiment, not the experiment; name the experiment: taxbench report "
                f"{root.parent}")
    found = find_experiments(root)
    if found:
        shown = ", ".join(str(path.relative_to(root)) for path in found[:3])
        more = f" and {len(found) - 3} more" if len(found) > 3 else ""
        return (f"{why}; found {len(found)} experiment folder{'s' if len(found) > 1 else ''} below it ({shown}{more}), "
                f"each analysed on its own: taxbench report {found[0]}")
    try:
        entries = sum(1 for _ in root.iterdir())
    except OSError:
        entries = 0
    return (f"{why}; it holds {entries} entr{'y' if entries == 1 else 'ies'} and no experiment within {MAX_DEPTH} "
            "levels; name an experiment folder: <experiment.out_dir>/<experiment.name>")


WITHDRAWN = "withdrawn"


def withdraw_verdict(root: Path, refusal: RecordError) -> None:
    """The experiment's analysis was refused: replace an older summary.json and report that state a verdict with a
    notice that names the refusal, so that the folder no longer says "passed" (nothing is written in a folder a live
    launch holds)."""
    why = f"the analysis was refused (exit {refusal.exit_code}): {refusal}"
    if not may_write_result(root / SUMMARY_FILE):
        return  # a live launch holds the folder: it writes the verdict when it has finished
    notices = {root / SUMMARY_FILE: json.dumps({"outcome": WITHDRAWN, "exit_code": refusal.exit_code,
                                                "deterministic_ok": False, "withdrawn": why}, indent=2),
               root / REPORT_DIR / MARKDOWN_FILE: f"# Report withdrawn\n\n{why}\n",
               root / REPORT_DIR / HTML_FILE: (f"<!doctype html><title>Report withdrawn</title><h1>Report withdrawn"
                                               f"</h1><p>{html_escape(why)}</p>\n")}
    withdrawn = []
    for path, notice in notices.items():
        if path.is_file():
            try:
                write_result(path, notice)
            except ResultWriteError as exc:  # the refusal is what the user needs to hear about; this comes second
                log.warning("%s", exc)
                continue
            withdrawn.append(str(path.relative_to(root)))
    if withdrawn:
        log.warning("%s: the earlier verdict in %s is withdrawn (marked so): it no longer holds", root,
                    ", ".join(withdrawn))


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


def _publish_stacks(root: Path, settings: ReportConfig, group: str | None, strict_wandb: bool,
                    console: Console | None) -> Published:
    cell_reports: dict[str, Path] = {}

    def each(analysis: ExperimentAnalysis) -> None:
        html = write_experiment_report(analysis) if settings.html and analysis.summary.running is None else None
        if html is not None:
            cell_reports[Path(analysis.summary.root).name] = html

    summary = analyse_stacks(root, each)
    html = write_stacks_report(summary, cell_reports) if settings.html else None
    runs = []
    if settings.wandb and (run := _wandb(strict_wandb, log_stacks, summary, settings, group)):
        runs.append(run)
    render_stacks(summary, console, html)
    _say_wandb(runs, console)
    return Published(summary.deterministic_ok, html, tuple(runs), summary.exit_code)


def _publish_experiment(root: Path, settings: ReportConfig, group: str | None, strict_wandb: bool,
                        console: Console | None) -> Published:
    analysis = analyse_experiment(root)
    # A running experiment's report would not be written (its folder is read-only to a reader), and its runs that
    # have not started have no manifest to build one from.
    html = write_experiment_report(analysis) if settings.html and analysis.summary.running is None else None
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
        html = write_experiment_report(analysis) if settings.html and analysis.summary.running is None else None
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


def held_folders(root: Path) -> dict[Path, Holder]:
    """`root`, and for a marked sweep the points below it, where a live launch holds the folder right now, each with
    who holds it (no other folder's lock is looked at)."""
    depths = range(MAX_DEPTH + 1) if is_marked_sweep(root) else range(1)
    locks = [path for depth in depths for path in root.glob("/".join(["*"] * depth + [LOCK_FILE]))]
    holders = {lock.parent: held_by(lock.parent) for lock in locks}
    return {folder: holder for folder, holder in holders.items() if holder is not None}


def read_and_report(root: Path, settings: ReportConfig | None = None, strict_wandb: bool = False) -> int:
    """`taxbench analyse` / `taxbench report`: report() writing only inside `root`, and nothing in a folder a live
    launch holds (that one is analysed read-only, with a line saying so). Never call it from a launching process:
    probing a lock this process holds would release it (taxbench.rundir.experiment_folder.held_by)."""
    if not root.is_dir():
        return report(root, settings, strict_wandb=strict_wandb)  # publish says what is wrong with it
    held = held_folders(root)
    for folder, holder in held.items():
        log.warning("%s is running: %s still writes to it; analysed read-only (nothing is written there: no %s, %s "
                    "or mirrors); analyse it again when the launch has finished", folder, holder.describe(),
                    SUMMARY_FILE, REPORT_DIR)
    if held and settings is not None and settings.wandb:
        log.warning("wandb logging skipped: a launch still writes to %s", next(iter(held)))
        settings = replace(settings, wandb=False)
    with reading(root, {folder: holder.who() for folder, holder in held.items()}):
        return report(root, settings, strict_wandb=strict_wandb)
