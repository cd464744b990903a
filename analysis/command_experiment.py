"""The results of a `taxbench run -- COMMAND` experiment: whole runs of the user's command, in the result model of a
recipe experiment (taxbench.analysis.experiment), so that every presenter reads it alike.

What differs from a recipe experiment:
- the tax comes from whole-run pairs (baseline-<p>, deterministic-<p>): per pair the ratio of the runs' steady-state
  median step times, the interval across pairs (taxbench.stats.tax.estimate_pairs_tax);
- every run's length is what the command took (stop.json records it, from baseline-0): each run must hold that
  many steps on every rank;
- the restart replay compares from the step the command's own resume started after (the optimizer's own step count,
  recorded in deterministic-resumed's manifest); without run.restart.* the gate is "not run", never a pass;
- a deterministic arm under taxbench's policy whose command turned a flag off (recorded with each step) is no
  evidence: a named problem, so the outcome is incomplete (exit 4);
- the command's own gradient norm and tokens are not observed (the records hold none);
- a step the stack skipped (a loss scaler's overflow) is recorded as skipped, and the gates compare that mark
  (taxbench.analysis.verdicts).
"""

from __future__ import annotations

import math
import time
from functools import cached_property
from pathlib import Path
from typing import Any

import pandas as pd

from taxbench.analysis.cost import cost_split
from taxbench.analysis.divergence import nonfinite_runs
from taxbench.analysis.equivalence import baseline_equivalence
from taxbench.analysis.experiment import (
    ARMS,
    GATE_FIELDS,
    TIMED_FIELDS,
    WHOLE_RUNS,
    ExperimentAnalysis,
    ExperimentSummary,
    code_of,
    experiment_settings,
    rank_medians,
)
from taxbench.analysis.verdicts import Verdict, compare_runs
from taxbench.design import EQUIVALENCE_RUNS, GATES, RESUMED
from taxbench.rundir.cost_file import read_cost
from taxbench.rundir.probe_files import FLAG_NAMES, LiveFlags, expected_flags
from taxbench.rundir.read import RecordError, load_checked_run
from taxbench.rundir.records import MANIFEST
from taxbench.rundir.run_manifest import Manifest, load_manifest
from taxbench.rundir.step_record import FINGERPRINT_S, FLAGS, GRAD_NORM, RANK, SKIPPED, STEP
from taxbench.rundir.stop_file import STOP_FILE, read_stop
from taxbench.stats.tax import estimate_pairs_tax, no_estimate, pair_ratios, steps_for_half_width

NOT_RUN = ("not run: the command's own save and resume were not given (run.restart.save_args and "
           "run.restart.resume_args, with {checkpoint}); without them nothing shows that a resumed run replays "
           "the uninterrupted one")
UNOBSERVED = (GRAD_NORM,)  # a command's own clipping norm: never recorded by the probe


def command_run_of(root: Path) -> str | None:
    """The first run of `root` with a manifest when it is a `taxbench run -- COMMAND` experiment; None otherwise
    (a recipe experiment, or a folder whose manifests cannot say: the recipe analysis reports what is wrong)."""
    for name in _run_names(2):
        if (root / name / MANIFEST).is_file():
            try:
                manifest = load_manifest(root / name)
            except RecordError:
                return None
            return name if manifest.is_command_run else None
    return None


class CommandAnalysis(ExperimentAnalysis):
    @cached_property
    def block_ratios(self) -> pd.DataFrame:
        """Per whole-run pair: the runs' median step times after the warmup and their ratio (for the plots)."""
        pairs = list(zip(self.timed["baseline"], self.timed["deterministic"], strict=True))
        return pair_ratios(pairs, self.summary.tax.warmup_steps)


def _run_names(pairs: int) -> list[str]:
    return [f"{arm}-{pair}" for pair in range(pairs) for arm in ARMS]


def flag_problems(run: str, manifest: Manifest, frame: pd.DataFrame) -> list[str]:
    """A run under taxbench's policy whose command turned a flag off (or on) is no evidence: the first step and rank
    where a live flag differs from the policy's."""
    policy = manifest.policy or {}
    if manifest.arm != "deterministic" or manifest.stack_native or FLAGS not in frame or frame.empty:
        return []
    wanted = expected_flags(policy)
    ordered = frame.sort_values([STEP, RANK], kind="stable")
    for step, rank, text in zip(ordered[STEP], ordered[RANK], ordered[FLAGS], strict=True):
        if not isinstance(text, str):
            return [f"{run}: step {int(step)}, rank {int(rank)} records no live flags; was it written by the probe?"]
        live = LiveFlags.parse(text)
        for flag, value in wanted.items():
            if getattr(live, flag) != value:
                return [f"{run}: the command turned the policy {'off' if value else 'on'} at step {int(step)}, rank "
                        f"{int(rank)}: {FLAG_NAMES[flag]} was {'on' if getattr(live, flag) else 'off'} where the "
                        "arm's policy sets it {}; the arm is no evidence of determinism".format('on' if value else
                                                                                                'off')]
    return []


def _load(root: Path, name: str, steps: int, config: dict[str, Any], fields: tuple[str, ...]
          ) -> tuple[Manifest | None, pd.DataFrame, list[str]]:
    manifest_path = root / name / MANIFEST
    if not manifest_path.exists():
        return None, pd.DataFrame(columns=[STEP, RANK]), [f"{name}: the run never ended well (no {manifest_path})"]
    manifest = load_manifest(root / name)
    frame, problems = load_checked_run(root / name, manifest, steps, config, (*fields, FLAGS, SKIPPED))
    if manifest.fingerprint_every != 1:
        # a timing-only pair (past the two gated ones) digests sampled steps, or none, by design: no gate reads it
        problems = [line for line in problems if "without a fingerprint" not in line]
    problems += flag_problems(name, manifest, frame)
    return manifest, frame.drop(columns=[FLAGS], errors="ignore"), problems


def _restart_verdict(runs: dict[str, pd.DataFrame], problems: dict[str, list[str]],
                     restarted: bool, resumed_from: int) -> Verdict:
    gate = next(g for g in GATES if g.after_resume)
    reference, candidate = gate.reference.name, gate.candidate.name
    if not restarted:
        return Verdict(gate.name, reference, candidate, False, 0, None, 0, (NOT_RUN,))
    return compare_runs(gate.name, reference, runs[reference], candidate, runs[candidate], resumed_from,
                        tuple(problems[reference] + problems[candidate]))


def compute_command_experiment(root: Path, first: str) -> CommandAnalysis:
    began = time.perf_counter()
    manifest = load_manifest(root / first)
    config = manifest.run_config
    experiment = manifest.experiment_config
    settings = experiment_settings(config, root / first)
    stop = read_stop(root)
    stop_problems = [] if stop is not None else [
        f"{root / STOP_FILE}: missing or damaged: the runs never all ended; continue the experiment "
        "(experiment.continue_existing=true)"]
    steps = stop.steps if stop is not None else 0
    pairs = (stop.pairs if stop is not None and stop.pairs else 2)
    timed_names = _run_names(pairs)
    restarted = bool(config["run"]["restart"]["save_args"])
    names = timed_names + ([RESUMED.name] if restarted else [])
    loaded = {name: _load(root, name, steps, config, TIMED_FIELDS if name in timed_names else GATE_FIELDS)
              for name in names}
    manifests = {name: found for name, (found, _, _) in loaded.items() if found is not None}
    runs = {name: frame for name, (_, frame, _) in loaded.items()}
    problems = {name: found for name, (_, _, found) in loaded.items()}
    resumed_from = 0
    if restarted and RESUMED.name in manifests:
        resumed_from = manifests[RESUMED.name].resumed_from
    timed = {arm: [runs[f"{arm}-{pair}"] for pair in range(pairs)] for arm in ARMS}
    try:
        tax = estimate_pairs_tax(list(zip(timed["baseline"], timed["deterministic"], strict=True)),
                                 settings.warmup_steps, settings.confidence)
    except (ValueError, KeyError):  # too few records for a tax: the problems say why
        tax = no_estimate(settings.confidence, settings.warmup_steps)
    verdicts = []
    for gate in GATES:
        if gate.after_resume:
            verdicts.append(_restart_verdict(runs, problems, restarted, resumed_from))
            continue
        reference, candidate = gate.reference.name, gate.candidate.name
        verdicts.append(compare_runs(gate.name, reference, runs[reference], candidate, runs[candidate], 0,
                                     tuple(problems[reference] + problems[candidate])))
    observed = {name: _taken(frame).drop(columns=[c for c in UNOBSERVED if c in frame], errors="ignore")
                for name, frame in runs.items()}
    equivalence_problems = stop_problems + [line for name in EQUIVALENCE_RUNS for line in problems.get(name, [])]
    world = manifest.world_size
    summary = ExperimentSummary(
        experiment=root.name,
        root=str(root),
        recipe=f"command: {' '.join(manifest.command_argv)}",
        world_size=world,
        device=str(manifest.device),
        tax=tax,
        verdicts=verdicts,
        steps_needed=steps_for_half_width(tax),
        time_needed_s=math.nan,
        steps=steps,
        stopped_by=stop.stopped_by if stop is not None else "unknown",
        target_half_width=settings.target_half_width,
        conclusive_half_width=settings.conclusive_half_width,
        planted_tax=0.0,
        calibration=False,
        rank_median_s=rank_medians(timed, tax.warmup_steps) if tax.pairs else [],
        throughput={arm: None for arm in ARMS},
        code=code_of(manifest),
        cost={},
        equivalence=baseline_equivalence(observed, int(experiment["warmup_steps"]), equivalence_problems),
        problems=(stop_problems + [line for name in names for line in problems[name]]
                  + ([] if restarted else [f"restart_replay: {NOT_RUN}"])),
        fingerprint_s=_median(runs, FINGERPRINT_S),
        interleave=WHOLE_RUNS,
        nonfinite=nonfinite_runs(observed),
        gate_steps=steps,
    )
    summary.cost_split = cost_split(read_cost(root), runs, set(timed_names), time.perf_counter() - began)
    return CommandAnalysis(summary, runs, timed, manifests)


def _taken(frame: pd.DataFrame) -> pd.DataFrame:
    """The steps the stack took: a skipped step's loss is the overflow its scaler caught (an inf or NaN that never
    reached the parameters), so it is neither divergence nor a point of the loss curve."""
    if SKIPPED not in frame:
        return frame
    return frame[~frame[SKIPPED].fillna(False).astype(bool)]


def _median(runs: dict[str, pd.DataFrame], column: str) -> float:
    values = [frame[column].dropna() for frame in runs.values() if column in frame]
    values = [v for v in values if not v.empty]
    return float(pd.concat(values).median()) if values else math.nan

