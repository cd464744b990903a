"""The experiment design: which runs an experiment holds, which gates compare them, the knob arms of an ablation,
and the order the timed runs take in each round. Analysis, the report, the sweep table and the schedule all read it
here; nothing else names a run or a gate.

Runs. Every run is a folder <arm>-<replica>: the timed pair baseline-0 and deterministic-0; deterministic-1 (the
repeatability gate's second run), deterministic-resumed (restart replay: checkpointed at experiment.resume_step and
resumed) and baseline-1 (baseline sanity: what determinism buys). With experiment.ablation, knob arms and an
<arm>-profile run per timed arm (see below).

Per-knob ablation (experiment.ablation=true): what each determinism knob costs, and which ones determinism needs.
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
import random
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from taxbench.config.schema import ARM_NAMES, Device, PolicyConfig, TaxbenchConfig


# ------------------------------------------------------------------------------------------------------------ runs
@dataclass(frozen=True)
class RunRef:
    arm: str
    replica: str

    @property
    def name(self) -> str:
        return run_name(self.arm, self.replica)


# The runs of an experiment, each a folder <arm>-<replica> (see taxbench.schedule.experiment for what each is for).
TIMED = {arm: RunRef(arm, "0") for arm in ARM_NAMES}
REPEAT = RunRef("deterministic", "1")
RESUMED = RunRef("deterministic", "resumed")
BASELINE_REPEAT = RunRef("baseline", "1")
ALL_RUNS = (TIMED["baseline"], TIMED["deterministic"], REPEAT, RESUMED, BASELINE_REPEAT)
# Under experiment.interleave=policy the timed rounds train one model whose policy switches per block; the blocks of
# each arm are recorded as a run of their own, <arm>-timed (never gated: the trajectory mixes both policies).
SHARED_MODEL_REPLICA = "timed"
# The runs advanced together in interleaved rounds and timed, per experiment.interleave. The resumed run is never
# timed: its restart is part of what it tests.
INTERLEAVED = {
    "all": (TIMED["baseline"], TIMED["deterministic"], REPEAT, BASELINE_REPEAT),
    "pair": (TIMED["baseline"], TIMED["deterministic"]),
    "policy": (RunRef("baseline", SHARED_MODEL_REPLICA), RunRef("deterministic", SHARED_MODEL_REPLICA)),
}
# Models each mode holds in memory at once during the timed rounds (the runs after them hold one).
MODELS_HELD = {"all": 4, "pair": 2, "policy": 1}
PROFILE_REPLICA = "profile"  # <arm>-profile: an arm's op-profile run (experiment.ablation; never timed or gated)


def run_name(arm: str, replica: str) -> str:
    return f"{arm}-{replica}"


# ----------------------------------------------------------------------------------------------------------- gates
@dataclass(frozen=True)
class Gate:
    """A bitwise comparison of two runs' fingerprint streams. A strict gate decides "deterministic: yes/no"; the
    baseline's gate only reports what determinism buys."""

    name: str  # the key in summary.json, sweep.csv and wandb
    label: str  # the short column title of the sweep table
    reference: RunRef
    candidate: RunRef
    strict: bool
    after_resume: bool = False  # compared from experiment.resume_step on (steps before it are the same run)


REPEATABILITY = Gate("repeatability", "repeat", TIMED["deterministic"], REPEAT, strict=True)
RESTART_REPLAY = Gate("restart_replay", "replay", TIMED["deterministic"], RESUMED, strict=True, after_resume=True)
BASELINE_SANITY = Gate("baseline_sanity", "baseline", TIMED["baseline"], BASELINE_REPEAT, strict=False)
GATES = (REPEATABILITY, RESTART_REPLAY, BASELINE_SANITY)
GATED_RUNS = tuple(sorted({ref.name for gate in GATES for ref in (gate.reference, gate.candidate)}))
# Baseline equivalence (analysis.equivalence): deterministic-0's loss against the two baselines' band.
EQUIVALENCE_RUNS = (TIMED["baseline"].name, BASELINE_REPEAT.name, TIMED["deterministic"].name)
KNOB_NEEDED = "knob_needed"  # the comparison of a without_<knob> arm's two replicas


# ----------------------------------------------------------------------------------------------------------- knobs
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
    # Switched together: a Tree algorithm is deterministic only with its protocol and channel count pinned.
    Knob("nccl_algo", ("nccl_algo", "nccl_proto", "nccl_channels"), _CUDA,
         "NCCL_ALGO (with the protocol and channels it is pinned to) on the arm's own communicator"),
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


def knob_policies(plans: Sequence[KnobPlan]) -> dict[str, PolicyConfig]:
    """Arm name -> policy of every knob arm that runs."""
    policies = {}
    for plan in plans:
        if plan.with_run is not None:
            policies[plan.with_run.arm] = plan.with_policy
        for ref in plan.without_runs:
            policies[ref.arm] = plan.without_policy
    return policies


def timed_knob_runs(plans: Sequence[KnobPlan]) -> tuple[RunRef, ...]:
    return tuple(plan.with_run for plan in plans if plan.with_run is not None)


def repeated_knob_runs(plans: Sequence[KnobPlan]) -> tuple[RunRef, ...]:
    return tuple(ref for plan in plans for ref in plan.without_runs)


def knob_arm(direction: str, knob: str) -> str:
    """The arm name of a knob arm: with_<knob> or without_<knob>."""
    return f"{direction}_{knob}"


def knob_of(arm: str) -> tuple[str, str] | None:
    """(direction, knob name) of a knob arm's name; None for the pair's arms."""
    direction, _, name = arm.partition("_")
    return (direction, name) if direction in (WITH, WITHOUT) and name in KNOBS_BY_NAME else None


def knob_plans(cfg: TaxbenchConfig) -> list[KnobPlan]:
    return plan_ablation(cfg.arms, cfg.cluster.device) if cfg.experiment.ablation else []


@dataclass(frozen=True)
class ExperimentDesign:
    """The runs of one experiment and the policy of every arm, decided once from its config."""

    policies: Mapping[str, PolicyConfig]  # arm name -> policy: the pair's arms, then the knob arms
    interleaved: tuple[RunRef, ...]  # the timed runs, in the rounds together: experiment.interleave's, then knob arms
    shared_model: bool  # experiment.interleave=policy: the timed runs are the arms' blocks of one model
    timed_knob_runs: tuple[RunRef, ...]
    repeated_knob_runs: tuple[RunRef, ...]
    profiled: tuple[RunRef, ...]  # the ablation's op-profile runs, one per timed arm

    @property
    def runs(self) -> tuple[RunRef, ...]:
        """Every run that takes the experiment's steps: the pair's five, the shared model's timed runs, then the
        ablation's knob arms."""
        lanes = tuple(ref for ref in self.interleaved if ref.replica == SHARED_MODEL_REPLICA)
        return ALL_RUNS + lanes + self.timed_knob_runs + self.repeated_knob_runs


def design_of(cfg: TaxbenchConfig) -> ExperimentDesign:
    plans = knob_plans(cfg)  # the ablation's knobs (none without experiment.ablation)
    timed = timed_knob_runs(plans)
    profiled = ()
    if cfg.experiment.ablation:
        arms = ("baseline", "deterministic", *(ref.arm for ref in timed))
        profiled = tuple(RunRef(arm, PROFILE_REPLICA) for arm in arms)
    mode = cfg.experiment.interleave
    return ExperimentDesign({**cfg.arms, **knob_policies(plans)}, INTERLEAVED[mode] + timed, mode == "policy", timed,
                            repeated_knob_runs(plans), profiled)


def gate_run_steps(gate_steps: int, steps: int, rounds_steps: int) -> int:
    """Steps of a gate-only run (one not timed in the rounds): experiment.gate_steps (0: experiment.steps), never
    more than the timed rounds took (`rounds_steps`): a gate compares the steps both its runs hold, and a tax
    interval needs many more steps than a divergence needs to show (docs/cost.md)."""
    return min(gate_steps or steps, rounds_steps)


def run_steps(name: str, timed: Collection[str], rounds_steps: int, experiment: Mapping[str, Any]) -> int:
    """The steps run `name` takes in an experiment (config as a manifest records it) whose rounds took
    `rounds_steps`: the rounds' length for a run timed in them, gate_run_steps for every other. An experiment from
    before experiment.gate_steps ran every run as long as the rounds."""
    if name in timed or "gate_steps" not in experiment:
        return rounds_steps
    return gate_run_steps(int(experiment["gate_steps"]), int(experiment["steps"]), rounds_steps)


@dataclass(frozen=True)
class ExperimentSteps:
    """The steps an experiment takes, per kind of run, at `per_run` steps per timed run."""

    timed_runs: int  # runs timed in the interleaved rounds
    per_run: int  # steps of each timed run
    gate_runs: int  # runs after the rounds (gate-only and knob replicas), gate_run_steps each
    gate_steps: int
    profile_runs: int  # the ablation's op-profile runs
    profile_steps: int  # warmup and profiled steps of each
    warmup_steps: int  # of each timed run, left out of the tax

    @property
    def runs(self) -> int:
        return self.timed_runs + self.gate_runs + self.profile_runs

    @property
    def timed(self) -> int:
        return self.timed_runs * self.per_run

    @property
    def total(self) -> int:
        return self.timed + self.gate_runs * self.gate_steps + self.profile_runs * self.profile_steps

    @property
    def in_tax(self) -> int:
        """Timed steps after each run's fixed warmup: the ones the tax estimate is made of."""
        return self.timed_runs * max(self.per_run - self.warmup_steps, 0)


def experiment_steps(cfg: TaxbenchConfig, per_run: int | None = None,
                     design: ExperimentDesign | None = None) -> ExperimentSteps:
    """Steps of the whole experiment at `per_run` steps per timed run (default experiment.steps: with a precision
    target, the least it may take) and gate_run_steps per run after the rounds."""
    exp = cfg.experiment
    per_run = exp.steps if per_run is None else per_run
    design = design or design_of(cfg)
    timed = sum(ref in design.interleaved for ref in design.runs)
    return ExperimentSteps(timed, per_run, len(design.runs) - timed, gate_run_steps(exp.gate_steps, exp.steps, per_run),
                           len(design.profiled), exp.warmup_steps + exp.profile_steps, exp.warmup_steps)


def checkpoint_after(step: int, block_steps: int, every: int) -> bool:
    """Whether the runs commit a checkpoint after the block of `block_steps` steps ending at `step`: every
    experiment.checkpoint_every_steps (`every`) steps, 0 never. The first step after one is left out of the tax
    (taxbench.stats.tax): it runs measurably slower (5-30% on CPU), and with the default interval it is the same
    arm's every time (A B B A rounds), which biased the tax by about a point."""
    return every > 0 and step // every > (step - block_steps) // every


# ---------------------------------------------------------------------------------------------------- round orders
def round_orders(order_seed: int, runs: Sequence[RunRef], rounds: int) -> list[list[RunRef]]:
    """Each round's order of the interleaved runs.

    Two arms holding as many runs each: the arms follow one another as A B B A A B B A ... over the whole schedule,
    cut into rounds of every run once (A B B A with two runs per arm; A B, then B A with one). Every arm is then
    preceded by each arm equally often: a step runs measurably slower right after some other steps (after a planted
    busy wait, 3-6% here), and a shuffled order, which puts an arm more often after the other arm than after itself,
    turned that carryover into a bias. The seed picks which arm is A and which run of an arm takes which of its slots
    in each round. Any other set of runs (the ablation's knob arms beside the pair) gets a Williams design instead.
    """
    rng = random.Random(order_seed)
    by_arm: dict[str, list[RunRef]] = {}
    for ref in runs:
        by_arm.setdefault(ref.arm, []).append(ref)
    if len(by_arm) != 2 or len({len(refs) for refs in by_arm.values()}) != 1:
        return _williams_orders(rng, runs, rounds)
    first, second = rng.sample(sorted(by_arm), 2)
    size = len(runs)
    orders = []
    for r in range(rounds):
        pattern = [first if (r * size + i) % 4 in (0, 3) else second for i in range(size)]
        slots = {arm: rng.sample(refs, len(refs)) for arm, refs in by_arm.items()}
        orders.append([slots[arm].pop() for arm in pattern])
    return orders


def _williams_orders(rng: random.Random, runs: Sequence[RunRef], rounds: int) -> list[list[RunRef]]:
    """Rounds of a Williams design: over each cycle of n rounds (2n for an odd number n of runs) every run takes
    every position once and follows every other run equally often, so carryover from one run into the next lands on
    every run alike. The seed assigns the runs to the design's slots."""
    n = len(runs)
    first = [0]
    low, high = 1, n - 1
    for i in range(1, n):
        if i % 2:
            first.append(low)
            low += 1
        else:
            first.append(high)
            high -= 1
    cycle = [[(slot + r) % n for slot in first] for r in range(n)]
    if n % 2:
        cycle += [row[::-1] for row in cycle]
    slots = rng.sample(list(runs), n)
    return [[slots[i] for i in cycle[r % len(cycle)]] for r in range(rounds)]
