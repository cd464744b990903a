"""The console: an experiment's, a sweep's and a layouts folder's results as compact rich tables.

A presenter only: it prints the result the analysis returned (taxbench.analysis.experiment, .sweep, .layouts) in the
words of taxbench.analysis.text, coloured by tone. Paths and commands go on lines of their own, never folded, so that
they can be copied (also from a piped log).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
from rich.console import Console, ConsoleOptions
from rich.markup import escape
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from taxbench.analysis.ablation import KnobResult, measured_first
from taxbench.analysis.attribution import SHARE_OF
from taxbench.analysis.equivalence import EQUIVALENT, Equivalence
from taxbench.analysis.experiment import WHOLE_RUNS, ExperimentSummary
from taxbench.analysis.layouts import SUMMARY_FILE as LAYOUTS_SUMMARY_FILE
from taxbench.analysis.layouts import LayoutsSummary
from taxbench.analysis.stacks_matrix import CellResult, StacksSummary
from taxbench.analysis.stacks_text import audits, not_run_lines, parameters_text, problem_lines, tax_text
from taxbench.analysis.summary import SUMMARY_FILE
from taxbench.analysis.sweep import SweepAnalysis
from taxbench.analysis.text import (
    duration,
    first_difference_text,
    headline,
    initial_weights_line,
    interval,
    knob_cost,
    knob_need,
    localize_command,
    mebibytes,
    ms,
    pct,
    pct_plain,
    ranks,
    repeatable_text,
    si,
    ulp_text,
    verdict_line,
    weights_text,
    world_label,
)
from taxbench.analysis.verdicts import IDENTICAL, INCOMPLETE, Verdict
from taxbench.design import GATES, MEASURED
from taxbench.rundir.stop_file import TARGET

TONE_COLOURS = {"good": "green", "bad": "red", "warn": "yellow"}  # a line's tone (taxbench.analysis.text) as colour
SHOWN_PROBLEMS = 3  # console lines of incompleteness; summary.json and the report hold them all


# Where a line of words may break: after a phrase's ": " or "; ", or before its " (" (never after a comma: "step 5,
# rank 1, params" is one place).
_PHRASE_BREAK = re.compile(r"(?<=[:;]) |(?<=\S) (?=\()")


def phrase_lines(text: str, width: int) -> list[str]:
    """`text` in lines of at most `width` columns, broken only between its phrases; a phrase longer than a line is
    a line of its own (the table folds it)."""
    lines: list[str] = []
    for phrase in _PHRASE_BREAK.split(text):
        if lines and len(lines[-1]) + 1 + len(phrase) <= width:
            lines[-1] += " " + phrase
        else:
            lines.append(phrase)
    return lines


class Phrases:
    """A line of words (the verdict, the tax) that a table cell breaks between its phrases, never inside one, at
    whatever width the terminal gives it."""

    def __init__(self, text: str, style: str = "") -> None:
        self.text, self.style = text, style

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> Iterator[Text]:
        yield Text("\n".join(phrase_lines(self.text, options.max_width)), style=self.style, overflow="fold")

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        longest = max(len(phrase) for phrase in _PHRASE_BREAK.split(self.text))
        return Measurement(min(longest, options.max_width), min(len(self.text), options.max_width))


# ------------------------------------------------------------------------------------------------------ an experiment
def gate_outcome(verdict: Verdict, strict: bool) -> str:
    """One line per gate: the verdict, and where a failing gate first differs."""
    if verdict.agree:
        after = f" after step {verdict.from_step}" if verdict.from_step else ""
        return f"[green]bitwise identical[/green] ({verdict.compared_steps} steps{after})"
    if verdict.outcome == INCOMPLETE:
        label = "[red]INCOMPLETE[/red]" if strict else "[yellow]incomplete[/yellow]"
        agreed = (f"the {verdict.compared_steps} steps both runs hold agree" if verdict.compared_steps else
                  "no step to compare")
        return f"{label} (see incomplete); {agreed}"
    m = verdict.first_mismatch
    assert m is not None
    label = "[red]DIFFERS[/red]" if strict else "[yellow]differs[/yellow]"
    where = f"{label} first at step {m.step}, rank {m.rank}, {m.metric}"
    return where + (" (among the records both runs hold)" if verdict.problems else "")


SHOWN_KNOBS = 3  # the console's costliest knobs; summary.json and the report hold every knob


def knob_rows(knobs: list[KnobResult]) -> list[tuple[str, str]]:
    """The console's ablation rows: the costliest measured knobs, then the knobs that got no arm, in one line."""
    measured = [k for k in measured_first(knobs) if k.cost_status == MEASURED]
    rows = []
    if measured:
        lines = [f"{k.knob}: {knob_cost(k)}; needed: {knob_need(k)}" for k in measured[:SHOWN_KNOBS]]
        if len(measured) > SHOWN_KNOBS:
            lines.append(f"... {len(measured) - SHOWN_KNOBS} more in {SUMMARY_FILE}")
        rows.append(("knobs", "\n".join(lines)))
    idle = [f"{k.knob} ({k.cost_status})" for k in knobs if k.cost_status != MEASURED]
    if idle:
        rows.append(("knobs not run", "; ".join(idle)))
    return rows


def top_ops_lines(ops: pd.DataFrame, shown: int = SHOWN_KNOBS) -> str:
    """The ops whose self time grew most in an arm, one per line: growth per step, share of the tax, calls."""
    grown = ops[ops["delta_us"] > 0].head(shown)
    if grown.empty:
        return "no op grew above the profile's noise floor"
    return "\n".join(
        f"{row.op} {row.delta_us / 1e3:+.2f} ms/step ({pct_plain(row.share_of_tax)} of {ops.attrs.get(SHARE_OF)}; "
        f"calls {row.calls_baseline:g} -> {row.calls_candidate:g})" for row in grown.itertuples())


def equivalence_outcome(equivalence: Equivalence) -> str:
    """The equivalence line, coloured like a non-strict gate (it never decides the outcome)."""
    colour = "green" if equivalence.verdict == EQUIVALENT else "yellow"
    verdict, _, rest = equivalence.describe().partition(":")
    return f"[{colour}]{escape(verdict)}[/{colour}]{escape(':' + rest) if rest else ''}"


def _shown_problems(problems: list[str]) -> str:
    lines = [escape(p) for p in problems[:SHOWN_PROBLEMS]]
    if len(problems) > SHOWN_PROBLEMS:
        lines.append(f"... {len(problems) - SHOWN_PROBLEMS} more in {SUMMARY_FILE}")
    return "\n".join(lines)


def render(summary: ExperimentSummary, console: Console | None = None, report_path: Path | None = None) -> None:
    """The final console summary: one compact table that fits an 80-column terminal."""
    console = console or Console()
    tax = summary.tax
    # The header above the table, broken between its parts (never inside one) where the terminal is narrow.
    parts = [f"{summary.experiment}  {summary.recipe}", ranks(summary.world_size), summary.device]
    if summary.calibration:
        parts.append("CALIBRATION (A/A: both arms baseline; not a determinism result)")
    for i, line in enumerate(_parts_in_lines(parts, console.width)):
        shown = escape(line)
        if i == 0:
            shown = shown.replace(escape(summary.experiment), f"[bold]{escape(summary.experiment)}[/bold]", 1)
        console.print(shown.replace("CALIBRATION (", "[bold yellow]CALIBRATION (").replace(
            "determinism result)", "determinism result)[/bold yellow]"), soft_wrap=True)
    table = Table(box=None, show_header=False, pad_edge=False, padding=(0, 1))
    table.add_column(style="bold", no_wrap=True)
    table.add_column(overflow="fold")
    tone, line = verdict_line(summary)
    table.add_row("verdict", Phrases(line, f"bold {TONE_COLOURS[tone]}"))
    table.add_row("tax", Phrases(headline(summary), "bold" if summary.conclusive else "yellow"))
    spread = f"; ranks spread {pct_plain(summary.rank_spread)}" if math.isfinite(summary.rank_spread) else ""
    table.add_row("step time", f"baseline {ms(tax.baseline_median_s)} (CV {pct_plain(tax.baseline_cv)})  "
                               f"deterministic {ms(tax.deterministic_median_s)} "
                               f"(CV {pct_plain(tax.deterministic_cv)}){spread}")
    for verdict, gate in zip(summary.verdicts, GATES, strict=True):
        table.add_row(verdict.gate, gate_outcome(verdict, gate.strict))
    table.add_row("equivalence", equivalence_outcome(summary.equivalence))
    for label, line in knob_rows(summary.ablation):
        table.add_row(label, escape(line))
    if "deterministic" in summary.attribution:
        table.add_row("top ops", escape(top_ops_lines(summary.attribution["deterministic"])))
    if summary.problems:
        table.add_row("[red]incomplete[/red]", _shown_problems(summary.problems))
    if summary.nonfinite:
        colour = "red" if summary.diverged else "yellow"
        table.add_row(f"[{colour}]non-finite[/{colour}]", _shown_problems([f.describe() for f in summary.nonfinite]))
    for line in summary.faults:
        table.add_row("fault", escape(line) if summary.fault_fired else f"[red]{escape(line)}[/red]")
    if tax.drifting:
        table.add_row("[yellow]warning[/yellow]", "step times still drifting (MSER-5 hit its cap); run more steps")
    rounds = "pairs of whole runs" if summary.interleave == WHOLE_RUNS else f"rounds x {tax.timed_runs} runs"
    sample = f"{tax.pairs} {rounds}, {tax.warmup_steps} warmup, {summary.steps} steps/run"
    if summary.gate_steps and summary.gate_steps != summary.steps:
        sample += f" (gate-only runs {summary.gate_steps})"
    if summary.stopped_by == TARGET:
        sample += f", stopped at +/-{pct_plain(summary.target_half_width)}"
    elif summary.target_half_width:
        cap = "run.max_pairs" if summary.interleave == WHOLE_RUNS else "the step cap"
        sample += f", stopped by {cap} before +/-{pct_plain(summary.target_half_width)}"
    table.add_row("sample", sample)
    base, det = summary.throughput["baseline"], summary.throughput["deterministic"]
    if base is not None and det is not None:
        unit = "device" if summary.device == "cuda" else "rank"
        mfu = (f"MFU {pct_plain(base.mfu)} / {pct_plain(det.mfu)}" if base.mfu is not None else
               "MFU n/a on CPU" if summary.device == "cpu" else "MFU n/a (set cluster.peak_tflops)")
        table.add_row("throughput", f"{si(base.tokens_per_s, 'tok/s')} / {si(det.tokens_per_s, 'tok/s')} "
                                    f"(baseline / deterministic; {si(det.tokens_per_s_per_device, 'tok/s')} per "
                                    f"{unit}); {mfu}; peak memory {mebibytes(det.peak_memory_bytes)}; data "
                                    f"{pct_plain(det.data_share)} of a step")
    if math.isfinite(summary.fingerprint_s) and tax.baseline_median_s > 0:
        share = summary.fingerprint_s / tax.baseline_median_s
        table.add_row("gates' cost", f"fingerprints {ms(summary.fingerprint_s)}/step ({pct_plain(share)} of a baseline "
                                     "step), outside the timed step")
    if summary.cost_split is not None:
        table.add_row("wall clock", f"{duration(summary.cost_split.wall_s)}: {summary.cost_split.line()}")
    console.print(table)
    # Paths and commands on lines of their own, never folded, so that they can be copied (also from a piped log).
    command = localize_command(summary)
    if command is not None:
        console.print(f"[bold]localize[/bold]         {escape(command)}", soft_wrap=True)
    console.print(f"[bold]results[/bold]          {escape(summary.root)}", soft_wrap=True)
    if report_path is not None:
        console.print(f"[bold]report[/bold]           {escape(str(report_path))}", soft_wrap=True)


def _parts_in_lines(parts: list[str], width: int) -> list[str]:
    """`parts` joined by " | " in lines of at most `width` columns, each part whole (a longer one on its own line)."""
    lines: list[str] = []
    for part in parts:
        if lines and len(lines[-1]) + 3 + len(part) <= width:
            lines[-1] += " | " + part
        else:
            lines.append(part)
    return lines


# ------------------------------------------------------------------------------------------------------------- a sweep
def _gate_mark(outcome: str, strict: bool) -> str:
    if outcome == IDENTICAL:
        return "[green]✓[/green]"
    if outcome == INCOMPLETE:
        return "[red]?[/red]" if strict else "[yellow]?[/yellow]"
    return "[red]✗[/red]" if strict else "[yellow]~[/yellow]"


def render_sweep(sweep: SweepAnalysis, console: Console | None = None, report_path: Path | None = None) -> None:
    """Compact console table: one line per sweep point."""
    console = console or Console()
    table = Table(title=f"[bold]sweep[/bold] {sweep.root}", title_justify="left", show_edge=False, pad_edge=False)
    # Points that share recipe and world size (a sweep of modes, e.g. the two NCCL policies) are told apart by name.
    named = bool(sweep.points.duplicated(["recipe", "world_size"], keep=False).any())
    for column, justify in ((("point", "left"),) if named else ()) + (
            ("recipe", "left"), (world_label(sweep.points), "right"), ("tax", "right"), ("CI", "right"),
            ("gates", "left")):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    for row in sweep.points.to_dict("records"):
        point = (escape(str(row["point"])),) if named else ()
        if row["error"]:
            table.add_row(*point, str(row["experiment"]), "", "", "",
                          f"[red]not analysed[/red]: {escape(row['error'][:60])}")
            continue
        gates = " ".join(_gate_mark(str(row[gate.name]), gate.strict) + gate.label for gate in GATES)
        table.add_row(*point, str(row["recipe"]), str(row["world_size"]), pct(row["tax"]),
                      escape(interval(row["low"], row["high"])), gates)
    console.print(table)
    incomplete = sweep.points[sweep.points["outcome"] == INCOMPLETE]
    for row in incomplete.to_dict("records"):
        console.print(f"[red]incomplete[/red] {escape(str(row['path']))}: {escape(str(row['incomplete'])[:300])}")
    if report_path is not None:
        console.print(f"report: {report_path}")


# ---------------------------------------------------------------------------------------------------- a layouts folder
def render_layouts(summary: LayoutsSummary, console: Console | None = None, report: Path | None = None) -> None:
    console = console or Console()
    plan = summary.plan
    tone, line = summary.verdict()
    colour = TONE_COLOURS
    console.print(f"[bold]{escape(Path(summary.root).name)}[/bold]  {escape(plan.recipe)} | {plan.world_size} ranks "
                  f"| {plan.arm} policy | {plan.steps} steps x 2 runs per layout")
    console.print(f"[bold {colour[tone]}]{escape(line)}[/bold {colour[tone]}]")
    weights_tone, weights_line = initial_weights_line(summary)
    console.print(f"[{colour[weights_tone]}]{escape(weights_line)}[/{colour[weights_tone]}]")
    layouts = Table(title="layouts", title_justify="left", box=None, padding=(0, 1))
    for column in ("layout", "factors", "repeatable", "median step", "wall"):
        layouts.add_column(column)
    for layout in summary.layouts:
        wall = duration(layout.seconds) if layout.seconds is not None else "n/a"
        layouts.add_row(layout.name, escape(layout.factors), escape(repeatable_text(layout.repeatable)),
                        ms(layout.median_step_s), wall)
    console.print(layouts)
    pairs = Table(title="layout pairs (replica 0 of each; float32 ulps, largest @ its step; every step in "
                        f"{LAYOUTS_SUMMARY_FILE} and the report)", title_justify="left", box=None, padding=(0, 1))
    for column in ("pair", "step 0", "first diff", "loss", "grad norm", "final"):
        pairs.add_column(column, overflow="fold")
    for pair in summary.pairs:
        pairs.add_row(f"{pair.reference} / {pair.candidate}", weights_text(pair.initial_weights_identical),
                      first_difference_text(pair), ulp_text(pair.loss_ulp, pair.steps),
                      ulp_text(pair.grad_norm_ulp, pair.steps), weights_text(pair.final_weights_identical))
    console.print(pairs)
    for note in [n for layout in summary.layouts for n in layout.notes]:
        console.print(f"[yellow]note[/yellow] {escape(note)}")
    for problem in summary.problems[:5]:
        console.print(f"[red]incomplete[/red] {escape(problem)}", soft_wrap=True)
    console.print(f"[bold]results[/bold]  {escape(summary.root)}", soft_wrap=True)
    if report is not None:
        console.print(f"[bold]report[/bold]   {escape(str(report))}", soft_wrap=True)


# -------------------------------------------------------------------------------------------------- a stacks matrix
def _mark(verdict: Verdict | None, strict: bool) -> str:
    return "" if verdict is None else _gate_mark(verdict.outcome, strict)


GATES_LEGEND = ("gates: repeatability, restart replay, baseline sanity (✓ identical, ✗ differs, ~ baseline runs "
                "differ, ? incomplete)")


def console_tax(cell: CellResult) -> str:
    """tax_text, shorter: one decimal, the interval's two ends in brackets, and a trailing * for an inconclusive
    interval."""
    tax = cell.summary.tax if cell.summary else None
    if tax is None or not math.isfinite(tax.tax) or not math.isfinite(tax.half_width):
        return tax_text(cell)
    return (f"{tax.tax * 100:+.1f}% [{tax.low * 100:+.1f}, {tax.high * 100:+.1f}]"
            + ("" if cell.summary.conclusive else "*"))


def console_rows(summary: StacksSummary) -> list[list[str]]:
    """The table as the console shows it, narrow enough for 80 columns: the three gates as marks in one column."""
    return [[escape(c.cell.stack), escape(c.cell.recipe), parameters_text(c.cell.parameters),
             "own" if c.cell.policy == "stack_native" else "taxbench", escape(console_tax(c)),
             " ".join(_mark(c.verdict(gate.name), gate.strict) for gate in GATES)] for c in summary.cells]


def render_stacks(summary: StacksSummary, console: Console | None = None, report: Path | None = None) -> None:
    console = console or Console()
    plan = summary.plan
    tone, line = summary.verdict()
    colour = {"good": "green", "bad": "red", "warn": "yellow"}[tone]
    console.print(f"[bold]{escape(Path(summary.root).name)}[/bold]  stacks matrix | {plan.family} recipes | "
                  f"{plan.world_size} ranks on {plan.device} | {plan.steps} steps per run")
    if plan.shape:
        console.print(f"shape    {escape(plan.shape)} (torchtitan: its flavor's own)", soft_wrap=True)
    console.print(f"[bold {colour}]{escape(line)}[/bold {colour}]")
    # One space between columns and none at the edges: a recipe's name and a tax with its interval stay one phrase
    # each within 80 columns.
    table = Table(box=None, padding=(0, 1), pad_edge=False, collapse_padding=True)
    for column in ("stack", "recipe", "params", "arm", "tax", "gates"):
        table.add_column(column, overflow="fold", no_wrap=column in ("recipe", "tax"))
    for cell, row in zip(summary.cells, console_rows(summary), strict=True):
        table.add_row(*row, style="dim" if not cell.ran else None)
    console.print(table)
    console.print(GATES_LEGEND, soft_wrap=True)
    if any(c.summary is not None and not c.summary.conclusive for c in summary.cells):
        console.print(escape("tax [its 95% interval, low to high]; * inconclusive (wide, or spans zero): more steps "
                             "narrow it"),
                      soft_wrap=True)
    for switch, lines in audits(summary).items():
        console.print(f"[bold]audit[/bold]   {escape(switch)}: taxbench's policy would add or change", soft_wrap=True)
        for line in lines:
            console.print(f"        - {escape(line)}", soft_wrap=True)
    for note in not_run_lines(summary):
        console.print(f"[yellow]not run[/yellow] {escape(note)}", soft_wrap=True)
    for problem in problem_lines(summary)[:5]:
        console.print(f"[red]incomplete[/red] {escape(problem)}", soft_wrap=True)
    console.print(f"[bold]results[/bold]  {escape(summary.root)}", soft_wrap=True)
    if report is not None:
        console.print(f"[bold]report[/bold]   {escape(str(report))}", soft_wrap=True)
