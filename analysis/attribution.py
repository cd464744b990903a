"""Per-op attribution of the determinism tax: which ops grew between the baseline's and the deterministic arm's
profiles (taxbench.train.op_profile, stored as taxbench.rundir.op_table), and what share of the measured step-time
difference each growth explains."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import pandas as pd

from taxbench.design import PROFILE_REPLICA, run_name
from taxbench.rundir.op_table import OP_COLUMNS, OpTable
from taxbench.rundir.read import RecordError
from taxbench.rundir.records import op_table_file

# Growths below this fraction of the baseline step's total self time are left out of the list (see attribute).
NOISE_FLOOR_FRACTION = 0.001

SHARE_OF = "share_of"  # DataFrame.attrs key of attribute_arms' tables: what share_of_tax is a share of

ATTRIBUTION_COLUMNS = ("op", "baseline_us", "candidate_us", "delta_us", "share_of_tax", "calls_baseline",
                       "calls_candidate")


def attribute(baseline: OpTable, candidate: OpTable, step_delta_us: float | None = None, top: int | None = 10,
              noise_floor_us: float | None = None) -> pd.DataFrame:
    """The ops of `candidate` (the deterministic arm) against `baseline`, by growth of self time per step.

    Columns ATTRIBUTION_COLUMNS, times in microseconds per step, sorted by delta_us (candidate - baseline), largest
    growth first, at most `top` rows (None: all). An op seen in one arm only counts 0 time and 0 calls in the other,
    so a fixed-order replacement shows as a new op that grew and the fast op it replaced as one that shrank. Both
    tables are compared on their device's rows (kernels on CUDA, host ops on CPU).

    share_of_tax = delta_us / step_delta_us, where `step_delta_us` is the measured difference in step time (the tax
    in microseconds per step); without it, the sum of the positive deltas, so that the growths share 100% between
    them. It is summed over every op, before the noise floor drops any.

    Noise floor: a growth (or shrinkage) smaller than `noise_floor_us` is left out of the list. The default is 0.1%
    of the baseline step's total self time: below what a tax estimate resolves (+/-0.5% at best), and at the scale of
    what profiling itself moves (timestamps to the microsecond, about a microsecond of the profiler's own cost per
    recorded op). It does not filter preemption: on a loaded host an op whose thread loses the CPU is charged the
    whole time slice (milliseconds, measured here on a shared 2-core machine), so profile enough steps there.
    """
    if baseline.device != candidate.device:
        raise ValueError(f"cannot attribute a {candidate.device} profile against a {baseline.device} one")
    base, cand = baseline.on_device(), candidate.on_device()
    ops = base.index.union(cand.index)
    base, cand = base.reindex(ops, fill_value=0.0), cand.reindex(ops, fill_value=0.0)
    table = pd.DataFrame({
        "op": ops,
        "baseline_us": base["self_us_per_step"].to_numpy(),
        "candidate_us": cand["self_us_per_step"].to_numpy(),
        "calls_baseline": base["calls_per_step"].to_numpy(),
        "calls_candidate": cand["calls_per_step"].to_numpy(),
    })
    table["delta_us"] = table["candidate_us"] - table["baseline_us"]
    denominator = step_delta_us if step_delta_us is not None else float(table["delta_us"].clip(lower=0.0).sum())
    table["share_of_tax"] = table["delta_us"] / denominator if denominator else float("nan")
    if noise_floor_us is None:
        noise_floor_us = NOISE_FLOOR_FRACTION * float(base["self_us_per_step"].sum())
    table = table[table["delta_us"].abs() >= noise_floor_us]
    table = table.sort_values(["delta_us", "op"], ascending=[False, True], kind="stable")
    if top is not None:
        table = table.head(top)
    return table[list(ATTRIBUTION_COLUMNS)].reset_index(drop=True)


def mean_over_ranks(tables: Sequence[OpTable]) -> OpTable:
    """One table for a run: each op's time and calls per step averaged over the ranks' tables (an op missing on a
    rank counts 0 there). Tables that are already averages count with their number of ranks."""
    if not tables:
        raise ValueError("no op tables to average")
    devices, steps = {t.device for t in tables}, {t.steps for t in tables}
    if len(devices) > 1 or len(steps) > 1:
        raise ValueError(f"op tables to average must share device and steps; got devices {sorted(devices)}, "
                         f"steps {sorted(steps)}")
    ranks = sum(t.ranks for t in tables)
    weighted = pd.concat([_scaled(t.ops, t.ranks) for t in tables], ignore_index=True)
    summed = weighted.groupby(["op", "device"], as_index=False, sort=True)[["self_us_per_step", "calls_per_step"]].sum()
    summed[["self_us_per_step", "calls_per_step"]] /= ranks
    return OpTable(summed[list(OP_COLUMNS)], steps.pop(), devices.pop(), ranks)


def _scaled(ops: pd.DataFrame, factor: int) -> pd.DataFrame:
    scaled = ops.copy()
    scaled[["self_us_per_step", "calls_per_step"]] *= factor
    return scaled


def load_profile(root: Path, arm: str, world: int) -> tuple[OpTable | None, list[str]]:
    """An arm's op table (its <arm>-profile run), averaged over every rank; what keeps it from being read."""
    run_dir = root / run_name(arm, PROFILE_REPLICA)
    tables, problems = [], []
    for rank in range(world):
        try:
            tables.append(OpTable.read(op_table_file(run_dir, rank)))
        except RecordError as exc:
            problems.append(f"{run_dir.name}: {exc}")
    if problems:
        return None, problems
    try:
        return mean_over_ranks(tables), []
    except ValueError as exc:
        return None, [f"{run_dir.name}: {exc}"]


def attribute_arms(root: Path, step_deltas_us: Mapping[str, float | None], world: int,
                   top: int = 10) -> tuple[dict[str, pd.DataFrame], list[str]]:
    """Each arm's ops against the baseline's (arm -> the attribute() table), given each arm's measured step-time
    growth over the baseline; and the problems that left an arm out (missing or damaged op tables)."""
    baseline, problems = load_profile(root, "baseline", world)
    if baseline is None:
        return {}, problems
    tables = {}
    for arm, delta_us in step_deltas_us.items():
        candidate, found = load_profile(root, arm, world)
        problems += found
        if candidate is not None:
            # A step that did not measurably grow has no tax to share out: the ops then share their summed growth.
            grew = delta_us is not None and delta_us > 0
            table = attribute(baseline, candidate, delta_us if grew else None, top)
            table.attrs[SHARE_OF] = "the tax" if grew else "the summed growth"
            tables[arm] = table
    return tables, problems
