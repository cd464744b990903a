"""Reports people want to look at: one experiment, a sweep or a layouts folder, as HTML and markdown.

What each report says, as blocks of taxbench.analysis.document (which renders them to both formats and writes them),
in the words of taxbench.analysis.text; a presenter only, of the result the analysis returned.

    <experiment>/report/report.html, report.md, step_times.png
    <sweep>/report/report.html, report.md, tax_vs_gpus.png  (+ each point's own report, linked from the table)
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from taxbench import exit_codes
from taxbench.analysis.ablation import measured_first
from taxbench.analysis.attribution import SHARE_OF
from taxbench.analysis.document import REPORT_DIR, Block, Figure, Heading, Paragraph, Report, TableBlock, write_report
from taxbench.analysis.equivalence import (
    BAND_FACTOR,
    EQUIVALENT,
    NOISE_WINDOW,
    RELATIVE_FLOOR,
    Equivalence,
)
from taxbench.analysis.experiment import PASSED, WHOLE_RUNS, ExperimentAnalysis, ExperimentSummary
from taxbench.analysis.layouts import LayoutsAnalysis
from taxbench.analysis.plots import (
    equivalence_plot,
    step_time_plot,
    sweep_tax_plot,
    top_ops_plot,
    training_curves_plot,
)
from taxbench.analysis.stacks_matrix import HEADER, StacksSummary, failing
from taxbench.analysis.stacks_text import audits, matrix_rows, not_run_lines, problem_lines
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
    verdict_line,
    weights_text,
    world_label,
)
from taxbench.analysis.verdicts import INCOMPLETE, Verdict
from taxbench.design import BASELINE_REPEAT, EQUIVALENCE_RUNS, GATES, REPEAT, TIMED
from taxbench.redaction import redact
from taxbench.rundir.run_manifest import Manifest

STEP_TIME_PNG = "step_times.png"
TRAINING_PNG = "training.png"
EQUIVALENCE_PNG = "equivalence.png"
TOP_OPS_PNG = "top_ops.png"
SWEEP_PNG = "tax_vs_gpus.png"

# Manifest parts shown side by side, in this order; config.arms holds both policies in both manifests (identical),
# the per-arm policy is shown from `policy` instead.
MANIFEST_SECTIONS = ("policy", "policy_applied", "layout", "stack", "timing", "provenance", "config.recipe",
                     "config.cluster", "config.experiment", "config.arm_overrides")


def _value(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def flatten(value: Any, prefix: str = "") -> dict[str, str]:
    """Dotted keys to display strings; lists of scalars stay one value, lists of mappings are indexed."""
    if isinstance(value, dict):
        if not value:
            return {prefix: "{}"} if prefix else {}
        flat: dict[str, str] = {}
        for key, item in value.items():
            flat.update(flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return flat
    if isinstance(value, list) and any(isinstance(item, dict | list) for item in value):
        flat = {}
        for index, item in enumerate(value):
            flat.update(flatten(item, f"{prefix}[{index}]"))
        return flat
    if isinstance(value, list):
        return {prefix: ", ".join(_value(v) for v in value) or "[]"}
    return {prefix: _value(value)}


def manifest_comparison(baseline: Manifest, deterministic: Manifest) -> list[tuple[str, str, str, bool]]:
    """(key, baseline value, deterministic value, differs) over MANIFEST_SECTIONS of the two timed runs."""
    rows = []
    for section in MANIFEST_SECTIONS:
        left = flatten(redact(baseline.section(section)), section)
        right = flatten(redact(deterministic.section(section)), section)
        for key in list(dict.fromkeys([*left, *right])):
            a, b = left.get(key, "(absent)"), right.get(key, "(absent)")
            rows.append((key, a, b, a != b))
    return rows


def gate_rows(summary: ExperimentSummary) -> tuple[list[list[str]], list[bool]]:
    rows, failing = [], []
    for verdict, gate in zip(summary.verdicts, GATES, strict=True):
        rows.append(_gate_row(verdict, gate.strict))
        failing.append(not verdict.agree and (gate.strict or verdict.outcome == INCOMPLETE))
    return rows, failing


def _gate_row(verdict: Verdict, strict: bool) -> list[str]:
    scope = f"{verdict.compared_steps} steps" + (f" after step {verdict.from_step}" if verdict.from_step else "")
    runs = f"{verdict.reference} vs {verdict.candidate}"
    if verdict.agree:
        return [verdict.gate, runs, "bitwise identical", scope, "—", "—", "—"]
    if verdict.outcome == INCOMPLETE:
        return [verdict.gate, runs, "**INCOMPLETE** (runs lack records: see below)", scope, "—", "—", "—"]
    m = verdict.first_mismatch
    assert m is not None
    outcome = "**DIFFERS**" if strict else "differs (allowed: baseline is nondeterministic)"
    if verdict.problems:
        outcome += " (among the records both runs hold; the runs are incomplete)"
    return [verdict.gate, runs, outcome, scope, f"step {m.step}, rank {m.rank}, {m.metric}", _value(m.expected),
            _value(m.actual)]


def _verdict_paragraph(summary: ExperimentSummary) -> Paragraph:
    tone, line = verdict_line(summary)
    command = localize_command(summary)
    return Paragraph(f"**{line}**" + (f"; find the op: `{command}`" if command else ""), tone=tone)


def _evidence_blocks(summary: ExperimentSummary) -> list[Block]:
    """What makes the experiment incomplete, and what the injected fault did."""
    blocks: list[Block] = []
    if summary.problems:
        blocks.append(Heading("Incomplete records", level=3))
        rows = [[problem] for problem in summary.problems]
        blocks.append(TableBlock(["run, ranks: steps"], rows, [True] * len(rows)))
    if summary.nonfinite:
        blocks.append(Heading("Non-finite training", level=3))
        blocks.append(TableBlock(["run", "metric", "value", "first step", "rank", "records"],
                                 [[f.run, f.metric, f.value, str(f.step), str(f.rank), str(f.records)]
                                  for f in summary.nonfinite], [f.deterministic for f in summary.nonfinite]))
    for line in summary.faults:
        blocks.append(Paragraph(line, tone="warn" if summary.fault_fired else "bad"))
    return blocks


def _training_blocks(analysis: ExperimentAnalysis) -> list[Block]:
    """Throughput, MFU and memory per arm, what the tax costs, and the loss and grad-norm curves."""
    summary = analysis.summary
    blocks: list[Block] = [Heading("Training metrics")]
    unit = "device" if summary.device == "cuda" else "rank"
    rows = []
    for arm, metrics in summary.throughput.items():
        if metrics is None:
            continue
        rows.append([arm, si(metrics.tokens_per_s, "tok/s"), si(metrics.tokens_per_s_per_device, "tok/s"),
                     "n/a" if metrics.tflops_per_device is None else f"{metrics.tflops_per_device:.3g}",
                     pct_plain(metrics.mfu) if metrics.mfu is not None else "n/a",
                     mebibytes(metrics.peak_memory_bytes), pct_plain(metrics.data_share)])
    if rows:
        blocks.append(TableBlock(["arm", "tokens/s", f"tokens/s per {unit}", f"TFLOP/s per {unit}", "MFU",
                                  "peak memory", "data loading"], rows))
        cost = summary.cost
        hours = cost.get("device_hours_per_day")
        blocks.append(Paragraph(
            f"The tax costs {si(cost.get('tokens_per_s_lost'), 'tok/s')} and "
            f"{'n/a' if hours is None else f'{hours:.1f}'} {unit}-hours per day of training at "
            f"{summary.world_size} {unit}s. MFU needs a GPU with a known peak (cluster.peak_tflops); peak memory is "
            "the process's (all of its interleaved runs)."))
    if summary.cost_split is not None:
        split = summary.cost_split
        blocks.append(Paragraph(f"Where the wall clock went ({duration(split.wall_s)}, this launch): {split.line()}."))
        if split.startup_line() is not None:
            blocks.append(Paragraph(f"The startup's parts: {split.startup_line()}."))
    curves = (TIMED["baseline"], TIMED["deterministic"], REPEAT, BASELINE_REPEAT)
    names = [ref.name for ref in curves if not analysis.runs[ref.name].empty]
    if names:
        blocks.append(Figure(TRAINING_PNG, training_curves_plot({name: analysis.runs[name] for name in names}),
                             "loss and gradient norm per step"))
    return blocks


def _equivalence_rows(equivalence: Equivalence) -> list[list[str]]:
    values = equivalence.to_dict()
    return [
        ["compared steps", f"{values['n_steps']} (after step {values['from_step']})"],
        ["steps inside the band", f"{values['steps_inside']} ({pct_plain(values['statistic'])}; "
                                  f"{values['threshold']:.0%} needed)"],
        ["median / max |Δloss|", f"{values['median_deviation']:.4g} / {values['max_deviation']:.4g}"],
        ["median baseline gap", f"{values['median_baseline_gap']:.4g}"],
        ["median band half-width", f"{values['median_band']:.4g}"],
    ]


def _equivalence_blocks(analysis: ExperimentAnalysis) -> list[Block]:
    """Baseline equivalence: does the deterministic recipe train like the baseline, within the baseline's noise?"""
    equivalence = analysis.summary.equivalence
    tone = "good" if equivalence.verdict == EQUIVALENT else "warn"
    first, second, deterministic = EQUIVALENCE_RUNS
    blocks: list[Block] = [
        Heading("Baseline equivalence", level=3),
        Paragraph(f"**{equivalence.describe()}**", tone=tone),
        Paragraph(f"Statistical, not a bitwise gate: it changes neither the verdict nor the exit code. Per step, "
                  f"{deterministic}'s loss (mean over ranks) is compared with the center of {first} and {second}: "
                  f"when the baseline is nondeterministic, those two differ by run-to-run noise only. The band is "
                  f"{BAND_FACTOR:g}x their RMS gap over {NOISE_WINDOW} steps (at least {RELATIVE_FLOOR:.2%} of the "
                  f"loss); the curve is equivalent when at least {equivalence.threshold:.0%} of its steps lie inside "
                  "(Megatron-LM's determinism proposal, #5785: determinism must not change what the recipe learns)."),
    ]
    if equivalence.evaluated:
        blocks.append(TableBlock(["", "value"], _equivalence_rows(equivalence)))
        blocks.append(Figure(EQUIVALENCE_PNG, equivalence_plot(equivalence),
                             "deterministic loss curve over the baseline band, and its deviation per step"))
    return blocks


def _knob_blocks(analysis: ExperimentAnalysis) -> list[Block]:
    """The ablation's knob table: each knob's tax on its own and whether determinism needs it."""
    knobs = analysis.summary.ablation
    if not knobs:
        return []
    rows = [[knob.knob, knob.description, knob_cost(knob), knob_need(knob)] for knob in measured_first(knobs)]
    return [
        Heading("Per-knob ablation", level=3),
        Paragraph("Each knob on its own: the baseline with that knob set as the deterministic mode sets it, timed in "
                  "the same interleaved rounds (tax against the baseline runs). Needed: the deterministic mode "
                  "without that knob, run twice and compared bit for bit; \"yes\" when the two differ. A knob that "
                  "cannot act here gets no arm, and the table says why."),
        TableBlock(["knob", "what it switches", "tax on its own (CI)", "needed for determinism"], rows),
    ]


def _attribution_blocks(analysis: ExperimentAnalysis) -> list[Block]:
    """The ops whose self time grew most in the deterministic arm (and in each knob arm), from the profile runs."""
    tables = analysis.summary.attribution
    if not tables:
        return []
    blocks: list[Block] = [
        Heading("Top ops", level=3),
        Paragraph("Self time per step of every op, from torch.profiler in runs of their own (<arm>-profile: "
                  "warmed up, then profiled, never timed), the deterministic arm against the baseline. Share: the "
                  "op's growth over the measured step-time growth (over the summed growth where the step did not "
                  "measurably grow)."),
    ]
    for arm, ops in tables.items():
        if ops.empty:
            blocks.append(Paragraph(f"{arm}: no op changed above the profile's noise floor."))
            continue
        if arm == "deterministic":
            blocks.append(Figure(TOP_OPS_PNG, top_ops_plot(ops, arm), "ops whose self time changed most"))
        rows = [[row.op, f"{row.delta_us / 1e3:+.3f}", pct_plain(row.share_of_tax),
                 f"{row.calls_baseline:g} -> {row.calls_candidate:g}"] for row in ops.itertuples()]
        blocks.append(TableBlock(["op", "ms/step", f"share of {ops.attrs.get(SHARE_OF)}", "calls per step"], rows,
                                 collapsed="" if arm == "deterministic" else f"{arm}: top ops"))
    return blocks


# The subsections of "Where the tax goes", in order: each gives its blocks, a level-3 heading first.
TAX_BREAKDOWN: tuple[Callable[[ExperimentAnalysis], list[Block]], ...] = (
    _equivalence_blocks, _knob_blocks, _attribution_blocks)


def where_the_tax_goes(analysis: ExperimentAnalysis) -> list[Block]:
    blocks: list[Block] = [Heading("Where the tax goes")]
    for subsection in TAX_BREAKDOWN:
        blocks += subsection(analysis)
    return blocks


GATE_HEADER = ["gate", "runs", "verdict", "compared", "first mismatch", "reference value", "candidate value"]


def experiment_report(analysis: ExperimentAnalysis) -> Report:
    summary, tax = analysis.summary, analysis.summary.tax
    blocks: list[Block] = [
        Paragraph(f"recipe **{summary.recipe}** · {ranks(summary.world_size)} · device {summary.device} · "
                  f"results {summary.root} · generated {datetime.now(UTC):%Y-%m-%d %H:%M UTC}"),
        _verdict_paragraph(summary),
        # The gates right under the verdict: a failing gate's row (red) is on the first screen.
        Heading("Bitwise gates"),
        TableBlock(GATE_HEADER, *gate_rows(summary), highlight_class="bad"),
        *_evidence_blocks(summary),
        Heading("Determinism tax"),
        Paragraph(
            ("**CALIBRATION** (A/A pair: both arms on the baseline policy; not a determinism result). " if
             summary.calibration else "") +
            f"Tax **{headline(summary)}** (" + (
                f"paired t on log pair ratios, {tax.pairs} pairs of whole runs of the command alternated A B B A"
                if summary.interleave == WHOLE_RUNS else
                f"paired t on log round ratios, {tax.pairs} interleaved rounds of {tax.timed_runs} timed runs") +
            f" after a {tax.warmup_steps}-step warmup; {summary.steps} steps per timed run"
            + (f", {summary.gate_steps} per gate-only run" if summary.gate_steps not in (0, summary.steps) else "")
            + ", "
            f"stopped by {summary.stopped_by}). Hodges-Lehmann cross-check {pct(tax.hl_tax)} "
            f"({interval(tax.hl_low, tax.hl_high, tax.confidence)})." + (
                " Timed on one model whose policy switched per block (experiment.interleave=policy: "
                "baseline-timed, deterministic-timed); its communicators are the baseline's, so the cost of the "
                "deterministic NCCL settings (NCCL_ALGO, a pinned protocol and channels) is not in this tax."
                if summary.interleave == "policy" else ""),
            tone="warn" if tax.drifting or not summary.conclusive else "",
        ),
        TableBlock(
            ["arm", "median step (steady state)", "CV"],
            [["baseline", ms(tax.baseline_median_s, 3), pct_plain(tax.baseline_cv)],
             ["deterministic", ms(tax.deterministic_median_s, 3), pct_plain(tax.deterministic_cv)]],
        ),
    ]
    if tax.drifting:
        blocks.append(Paragraph("Step times were still drifting: MSER-5 wanted to cut half the series. Run more "
                                "steps (experiment.steps) before trusting this number.", tone="warn"))
    if math.isfinite(summary.rank_spread):
        blocks.append(Paragraph(f"Median step per rank: {ms(min(summary.rank_median_s), 3)} to "
                                f"{ms(max(summary.rank_median_s), 3)} (spread {pct_plain(summary.rank_spread)}); "
                                "the tax uses the slowest rank's time per step."))
    blocks.append(Figure(STEP_TIME_PNG, step_time_plot(analysis.step_times, tax, analysis.block_ratios),
                         "step time per arm with the warmup cut, and the per-block tax"))

    blocks += _training_blocks(analysis)
    blocks += where_the_tax_goes(analysis)

    blocks.append(Heading("Recipe and stack, side by side"))
    comparison = manifest_comparison(analysis.manifests[TIMED["baseline"].name],
                                     analysis.manifests[TIMED["deterministic"].name])
    differing = [row for row in comparison if row[3]]
    blocks.append(Paragraph(f"{len(differing)} of {len(comparison)} recorded settings differ between the arms "
                            "(highlighted). Only the execution policy may differ: anything else would make the tax "
                            "compare different work."))
    pair_header = ["setting", TIMED["baseline"].name, TIMED["deterministic"].name]
    blocks.append(TableBlock(pair_header, [list(r[:3]) for r in differing],
                             [True] * len(differing)))
    blocks.append(TableBlock(pair_header, [list(r[:3]) for r in comparison],
                             [r[3] for r in comparison], collapsed=f"all {len(comparison)} settings"))
    return Report(f"taxbench: {summary.experiment}", blocks)


def write_experiment_report(analysis: ExperimentAnalysis, out_dir: Path | None = None) -> Path | None:
    return write_report(experiment_report(analysis), out_dir or Path(analysis.summary.root) / REPORT_DIR)


def sweep_report(sweep: SweepAnalysis, point_reports: dict[str, Path] | None = None) -> Report:
    """The sweep table (one row per point) and tax vs GPU count; point_reports maps a point's path to its report."""
    point_reports = point_reports or {}
    out_dir = sweep.root / REPORT_DIR
    analysed = sweep.points[sweep.points["error"].fillna("") == ""]
    world = world_label(sweep.points)
    blocks: list[Block] = [_sweep_verdict(sweep, analysed.empty),
                           Paragraph(f"{len(sweep.points)} sweep points under {sweep.root} · generated "
                                     f"{datetime.now(UTC):%Y-%m-%d %H:%M UTC}")]
    if sweep.errors:
        blocks.append(Paragraph(f"{len(sweep.errors)} point(s) could not be analysed (listed in the table).",
                                tone="warn"))
    if not analysed.empty:
        blocks.append(Figure(SWEEP_PNG, sweep_tax_plot(analysed, world), f"determinism tax vs {world}"))
    header = ["experiment", "recipe", world, "tax", "CI", "HL", "baseline step", "deterministic step",
              *(gate.label for gate in GATES), "code"]
    rows, highlight, links = [], [], {}
    for index, row in enumerate(sweep.points.to_dict("records")):
        if row["error"]:
            rows.append([str(row["experiment"]), "", "", "", "", "", "", "", "not analysed: " + str(row["error"]),
                         "", "", ""])
            highlight.append(True)
            continue
        rows.append([str(row["experiment"]), str(row["recipe"]), str(row["world_size"]), pct(row["tax"]),
                     interval(row["low"], row["high"]), pct(row["hl_tax"]),
                     ms(row["baseline_median_s"], 3), ms(row["deterministic_median_s"], 3),
                     *(str(row[gate.name]) for gate in GATES), str(row["code"])])
        highlight.append(row["outcome"] != PASSED)
        target = point_reports.get(str(sweep.root / str(row["path"])))
        if target is not None:
            links[index, 0] = os.path.relpath(target.parent, out_dir)
    blocks += [Heading("Sweep points"), TableBlock(header, rows, highlight, links)]
    incomplete = sweep.points[sweep.points["outcome"] == INCOMPLETE]
    if not incomplete.empty:
        blocks += [Heading("Incomplete points", level=3),
                   TableBlock(["experiment", "what is missing"],
                              [[str(r["path"]), str(r["incomplete"])] for r in incomplete.to_dict("records")],
                              [True] * len(incomplete))]
    return Report(f"taxbench sweep: {sweep.root.name}", blocks)


def _sweep_verdict(sweep: SweepAnalysis, nothing_analysed: bool) -> Paragraph:
    if sweep.exit_code == exit_codes.OK and not nothing_analysed:
        return Paragraph("Every point reproduced bit for bit.", tone="good")
    if sweep.exit_code == exit_codes.NOT_DETERMINISTIC:
        return Paragraph("At least one point is **not** bitwise reproducible.", tone="bad")
    return Paragraph("At least one point is **incomplete** or was not analysed: no verdict for it (exit code 4).",
                     tone="bad")


def write_sweep_report(sweep: SweepAnalysis, point_reports: dict[str, Path] | None = None) -> Path | None:
    return write_report(sweep_report(sweep, point_reports), sweep.root / REPORT_DIR)


# --------------------------------------------------------------------------------------------------------- layouts
LAYOUTS_INTRO = (
    "One recipe under several parallel layouts, two runs of one policy per layout. **Repeatable** compares a "
    "layout's two runs bit for bit (every rank's fingerprints). Across layouts, where each rank fingerprints a "
    "different shard, the comparison uses what no layout changes: the weights at step 0 and at the last step by "
    "their layout-invariant digest, and per step the job's loss (mean of the ranks' losses, rounded to float32) and "
    "gradient norm, with their distance in float32 ulps. This is validation, not a gate: differences between "
    "layouts are findings (reduction order changes with the layout), and only a layout that is not repeatable on "
    "its own (exit 3) or missing evidence (exit 4) fails the command."
)


def layouts_report(analysis: LayoutsAnalysis) -> Report:
    summary = analysis.summary
    plan = summary.plan
    tone, line = summary.verdict()
    weights_tone, weights_line = initial_weights_line(summary)
    blocks: list[Block] = [
        Paragraph(f"recipe **{plan.recipe}** · {plan.world_size} ranks · policy {plan.arm} · {plan.steps} steps x 2 "
                  f"runs per layout · results {summary.root} · generated {datetime.now(UTC):%Y-%m-%d %H:%M UTC}"),
        Paragraph(line, tone=tone),
        Paragraph(weights_line, tone=weights_tone),
        Heading("Cross-layout validation"),
        Paragraph(LAYOUTS_INTRO),
        Heading("Layouts", level=3),
        TableBlock(["layout", "factors", "repeatable", "median step", "wall time"],
                   [[layout.name, layout.factors, repeatable_text(layout.repeatable), ms(layout.median_step_s, 3),
                     "n/a" if layout.seconds is None else f"{layout.seconds:.1f} s"] for layout in summary.layouts],
                   [not layout.repeatable.agree for layout in summary.layouts], highlight_class="bad"),
        Heading("Layout pairs", level=3),
        TableBlock(["pair", "step-0 weights", "first difference", "max loss ulp", "max grad-norm ulp",
                    "final weights"],
                   [[f"{pair.reference} vs {pair.candidate}", weights_text(pair.initial_weights_identical),
                     first_difference_text(pair), _value(pair.max_ulp("loss")), _value(pair.max_ulp("grad_norm")),
                     weights_text(pair.final_weights_identical)] for pair in summary.pairs],
                   [not pair.identical for pair in summary.pairs]),
    ]
    if summary.pairs:
        header = ["step"] + [f"{pair.reference} vs {pair.candidate}" for pair in summary.pairs]
        rows = [[str(step)] + [f"{_value(pair.loss_ulp[i])} / {_value(pair.grad_norm_ulp[i])}"
                               for pair in summary.pairs] for i, step in enumerate(summary.pairs[0].steps)]
        blocks += [Paragraph("Ulp distance per step, loss / grad norm (0: bitwise equal; -: a NaN or a missing "
                             "step)."), TableBlock(header, rows, collapsed=f"all {len(rows)} steps")]
    notes = [note for layout in summary.layouts for note in layout.notes]
    if notes:
        blocks += [Paragraph(note, tone="warn") for note in notes]
    if summary.problems:
        blocks += [Heading("Incomplete evidence", level=3),
                   TableBlock(["what is missing"], [[p] for p in summary.problems], [True] * len(summary.problems),
                              highlight_class="bad")]
    return Report(f"taxbench layouts: {Path(summary.root).name}", blocks)


def write_layouts_report(analysis: LayoutsAnalysis, out_dir: Path | None = None) -> Path | None:
    return write_report(layouts_report(analysis), out_dir or Path(analysis.summary.root) / REPORT_DIR)


# -------------------------------------------------------------------------------------------------- a stacks matrix
STACKS_INTRO = (
    "The same model size on each training stack, under two policies for the deterministic arm: the stack's **own "
    "switch** alone (`mode@arms.deterministic=stack_native`: taxbench applies none of its own policy and audits what "
    "it would add) and **taxbench's policy** (`mode@arms.deterministic=deterministic`). Each cell is one experiment "
    "(a baseline/deterministic pair with its three gates; its own report is linked). Tax is the deterministic arm's "
    "step time over the baseline's, with its interval. Cells that cannot run here are listed with the reason, never "
    "counted as failures."
)


def stacks_report(summary: StacksSummary, cell_reports: dict[str, Path] | None = None) -> Report:
    """The matrix as report blocks; cell_reports maps a cell's name to its experiment's report.html."""
    cell_reports = cell_reports or {}
    plan = summary.plan
    tone, line = summary.verdict()
    out_dir = Path(summary.root) / REPORT_DIR
    links = {(index, 0): os.path.relpath(cell_reports[c.cell.name].parent, out_dir)
             for index, c in enumerate(summary.cells) if c.cell.name in cell_reports}
    blocks: list[Block] = [
        Paragraph(f"{plan.family} recipes · {plan.world_size} ranks on {plan.device} · {plan.steps} steps per run · "
                  f"results {summary.root} · generated {datetime.now(UTC):%Y-%m-%d %H:%M UTC}"),
        Paragraph(line, tone=tone),
        *([Paragraph(f"Every stack that builds its model from the recipe's fields (taxbench, DeepSpeed, "
                     f"Megatron-Core) runs one shape: `{plan.shape}`; torchtitan's model is its flavor's own (its "
                     "parameter count is in the table).")] if plan.shape else []),
        Heading("Stacks and policies"),
        Paragraph(STACKS_INTRO),
        TableBlock(HEADER, matrix_rows(summary), [failing(c) for c in summary.cells], links, highlight_class="bad"),
    ]
    audited = audits(summary)
    if audited:
        blocks += [Heading("What taxbench's policy would add to each own switch", level=3),
                   TableBlock(["own switch", "taxbench's policy would add or change"],
                              [[switch, line] for switch, lines in audited.items() for line in lines])]
    not_run = not_run_lines(summary)
    if not_run:
        blocks += [Heading("Not run here", level=3), TableBlock(["cell and why"], [[n] for n in not_run])]
    problems = problem_lines(summary)
    if problems:
        blocks += [Heading("Incomplete evidence", level=3),
                   TableBlock(["what is missing"], [[p] for p in problems], [True] * len(problems),
                              highlight_class="bad")]
    return Report(f"taxbench stacks: {Path(summary.root).name}", blocks)


def write_stacks_report(summary: StacksSummary, cell_reports: dict[str, Path] | None = None) -> Path | None:
    return write_report(stacks_report(summary, cell_reports), Path(summary.root) / REPORT_DIR)
