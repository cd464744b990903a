"""The knob table of an ablation experiment (experiment.ablation=true; see taxbench.design for the arms).

Per knob: its tax (the with_<knob> arm against the baseline runs, the same estimator and interval as the pair's
tax) and whether determinism needs it (its without_<knob> replicas compared bit for bit: if they differ, it is
needed). A knob without an arm says why (no-op on this device, set alike by both policies, acts only with another
knob). Missing or incomplete knob runs leave that knob's numbers open and count as incomplete evidence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from taxbench.analysis.verdicts import DIFFERS, IDENTICAL, Verdict, compare_runs
from taxbench.config.schema import load_config
from taxbench.design import KNOB_NEEDED, knob_plans, run_steps
from taxbench.rundir.read import RecordError, load_checked_run
from taxbench.rundir.run_manifest import load_manifest
from taxbench.stats.tax import Checkpoints, TaxEstimate, estimate_tax, no_estimate


@dataclass
class KnobResult:
    knob: str
    description: str
    cost_status: str  # "measured", or why the knob has no with_<knob> arm
    needed_status: str  # "measured", or why the knob has no without_<knob> replicas
    tax: TaxEstimate | None = None
    repeat: Verdict | None = None  # without_<knob>-0 against without_<knob>-1
    problems: list[str] = field(default_factory=list)

    @property
    def needed(self) -> bool | None:
        """True: without the knob the deterministic recipe is not repeatable; None: not known."""
        if self.repeat is None or self.repeat.outcome not in (IDENTICAL, DIFFERS):
            return None
        return self.repeat.outcome == DIFFERS

    def to_dict(self) -> dict[str, Any]:
        return {
            "knob": self.knob,
            "description": self.description,
            "cost_status": self.cost_status,
            "needed_status": self.needed_status,
            "tax": None if self.tax is None else self.tax.to_dict(),
            "needed": self.needed,
            "repeat": None if self.repeat is None else self.repeat.to_dict(),
            "problems": self.problems,
        }


def _load(root: Path, name: str, steps: int, config: dict[str, Any]) -> tuple[pd.DataFrame | None, list[str]]:
    run_dir = root / name
    try:
        return load_checked_run(run_dir, load_manifest(run_dir), steps, config)
    except RecordError as exc:
        return None, [str(exc)]


def _knob_tax(baselines: list[pd.DataFrame], frame: pd.DataFrame, experiment: dict[str, Any],
              checkpoints: Checkpoints) -> TaxEstimate:
    try:
        return estimate_tax(baselines, [frame], experiment["warmup_steps"], experiment["confidence"], checkpoints)
    except ValueError:
        return no_estimate(experiment["confidence"], experiment["warmup_steps"])


def analyse_ablation(root: Path, config: dict[str, Any], baselines: list[pd.DataFrame],
                     steps: int, checkpoints: Checkpoints) -> list[KnobResult]:
    """Every knob's row (empty unless the experiment ran with experiment.ablation=true): `steps` are the timed
    rounds' (a with_<knob> arm's); a without_<knob> replica is gate-only (taxbench.design.run_steps)."""
    experiment = config["experiment"]
    if not experiment.get("ablation"):
        return []
    results = []
    for plan in knob_plans(load_config(config)):
        result = KnobResult(plan.knob.name, plan.knob.description, plan.with_status, plan.without_status)
        if plan.with_run is not None:
            frame, problems = _load(root, plan.with_run.name, steps, config)
            result.problems += problems
            if frame is not None and not problems:
                result.tax = _knob_tax(baselines, frame, experiment, checkpoints)
        if plan.without_runs:
            gate = run_steps(plan.without_runs[0].name, (), steps, experiment)
            (first, first_problems), (second, second_problems) = (_load(root, ref.name, gate, config)
                                                                  for ref in plan.without_runs)
            result.problems += first_problems + second_problems
            if first is not None and second is not None:
                a, b = (ref.name for ref in plan.without_runs)
                result.repeat = compare_runs(KNOB_NEEDED, a, first, b, second, 0,
                                             tuple(first_problems + second_problems))
        results.append(result)
    return results


def measured_first(results: list[KnobResult]) -> list[KnobResult]:
    """Knobs with a tax first, costliest first; then the rest in KNOBS order."""
    def cost(result: KnobResult) -> float:
        return result.tax.tax if result.tax is not None and math.isfinite(result.tax.tax) else -math.inf

    return sorted(results, key=cost, reverse=True)
