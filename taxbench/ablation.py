"""Per-knob ablation (experiment.ablation=true): what each determinism knob costs, and which ones determinism needs.

Each knob arm is one of the pair's policies with one knob switched, so it differs from its pair arm in the policy
only (a knob arm has no recipe or cluster of its own: every trainer builds from the one recipe):
- with_<knob>: the baseline policy with that knob set as the deterministic policy sets it. Timed in the interleaved
  rounds beside the pair; its tax is measured against the baseline runs.
- without_<knob> (leave one out): the deterministic policy with that knob set back to the baseline's value. Two
  replicas run whole after the rounds and are compared bit for bit: when they differ, determinism needs the knob.
A knob that does nothing on this device (TF32 on CPU), that both policies set alike, or that only acts together with
another knob, gets no arm in that direction: the table says why instead of reporting noise as a measurement.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from taxbench.config import Device, PolicyConfig
from taxbench.records import RunRef

MEASURED = "measured"
WITH, WITHOUT = "with", "without"


@dataclass(frozen=True)
class Knob:
    name: str
    fields: tuple[str, ...]  # PolicyConfig fields the knob switches together
    devices: frozenset[Device]  # where the knob changes anything
    description: str
    acts_with: str | None = None  # a PolicyConfig field that must be true for this knob to act at all


_ALL = frozenset(Device)
_CUDA = frozenset({Device.cuda})
KNOBS = (
    Knob("deterministic_algorithms", ("deterministic",), _ALL,
         "torch.use_deterministic_algorithms (and cuDNN deterministic)"),
    Knob("deterministic_kernels", ("deterministic_kernels",), _ALL,
         "taxbench's fixed-order kernels for the MoE hot spots (combine, dispatch, top-k)"),
    Knob("tf32_off", ("allow_tf32",), _CUDA, "TF32 off for matmuls and cuDNN"),
    Knob("cudnn_benchmark_off", ("cudnn_benchmark",), _CUDA, "cuDNN autotuning off"),
    Knob("nccl_ring", ("nccl_algo",), _CUDA, "NCCL_ALGO on the arm's own communicator"),
    Knob("fill_uninitialized_memory", ("fill_uninitialized_memory",), _ALL,
         "fill uninitialized memory (acts only under deterministic algorithms)", acts_with="deterministic"),
)

KNOBS_BY_NAME = {knob.name: knob for knob in KNOBS}


@dataclass(frozen=True)
class KnobPlan:
    knob: Knob
    with_status: str  # MEASURED, or why there is no with_<knob> arm
    without_status: str  # MEASURED, or why there is no without_<knob> arm
    with_policy: PolicyConfig
    without_policy: PolicyConfig

    @property
    def with_run(self) -> RunRef | None:
        return RunRef(knob_arm(WITH, self.knob.name), "0") if self.with_status == MEASURED else None

    @property
    def without_runs(self) -> tuple[RunRef, ...]:
        if self.without_status != MEASURED:
            return ()
        return tuple(RunRef(knob_arm(WITHOUT, self.knob.name), replica) for replica in ("0", "1"))


def _switched(policy: PolicyConfig, source: PolicyConfig, knob: Knob, name: str) -> PolicyConfig:
    return dataclasses.replace(policy, name=name, **{f: getattr(source, f) for f in knob.fields})


def _status(knob: Knob, base: PolicyConfig, other: PolicyConfig, arm: PolicyConfig, device: Device) -> str:
    """Whether switching `knob` from `base` to `other` can change anything; `arm` is the policy that results."""
    if all(getattr(base, f) == getattr(other, f) for f in knob.fields):
        return "same in both policies"
    if device not in knob.devices:
        return f"no-op on {device.value}"
    if knob.acts_with is not None and not getattr(arm, knob.acts_with):
        return f"no-op alone (acts only with {knob.acts_with}=true)"
    return MEASURED


def plan_ablation(arms: Mapping[str, PolicyConfig], device: Device) -> list[KnobPlan]:
    """Every knob's arms for this pair of policies on this device (KNOBS order)."""
    baseline, deterministic = arms["baseline"], arms["deterministic"]
    plans = []
    for knob in KNOBS:
        with_policy = _switched(baseline, deterministic, knob, f"{baseline.name}+{knob.name}")
        without_policy = _switched(deterministic, baseline, knob, f"{deterministic.name}-{knob.name}")
        plans.append(KnobPlan(
            knob,
            _status(knob, baseline, deterministic, with_policy, device),
            _status(knob, deterministic, baseline, without_policy, device),
            with_policy,
            without_policy,
        ))
    return plans


def knob_policies(plans: list[KnobPlan]) -> dict[str, PolicyConfig]:
    """Arm name -> policy of every knob arm that runs."""
    policies = {}
    for plan in plans:
        if plan.with_run is not None:
            policies[plan.with_run.arm] = plan.with_policy
        for ref in plan.without_runs:
            policies[ref.arm] = plan.without_policy
    return policies


def timed_knob_runs(plans: list[KnobPlan]) -> tuple[RunRef, ...]:
    return tuple(plan.with_run for plan in plans if plan.with_run is not None)


def repeated_knob_runs(plans: list[KnobPlan]) -> tuple[RunRef, ...]:
    return tuple(ref for plan in plans for ref in plan.without_runs)


def knob_arm(direction: str, knob: str) -> str:
    """The arm name of a knob arm: with_<knob> or without_<knob>."""
    return f"{direction}_{knob}"


def knob_of(arm: str) -> tuple[str, str] | None:
    """(direction, knob name) of a knob arm's name; None for the pair's arms."""
    direction, _, name = arm.partition("_")
    return (direction, name) if direction in (WITH, WITHOUT) and name in KNOBS_BY_NAME else None
