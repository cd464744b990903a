"""Structured config schema for taxbench (Hydra/OmegaConf) and the checks Hydra cannot express.

The schema is registered in Hydra's ConfigStore so that wrong types and unknown keys are rejected at compose time;
`validate` adds the cross-field rules (batch divisibility, parallel layout, value ranges) with messages that name the
key, the offending value and what would be accepted.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import math
import secrets
import typing
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from taxbench.config.command import CommandConfig
from taxbench.config.layout_rules import layout_problems


class ConfigError(ValueError):
    """A user-facing configuration problem; the message says what is wrong and how to fix it."""


class Precision(StrEnum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp8 = "fp8"  # bf16 autocast with float8 linears (torchao convert_to_float8_training); CUDA, compute capability 8.9+


class Device(StrEnum):
    cpu = "cpu"
    cuda = "cuda"


class Launcher(StrEnum):
    inprocess = "inprocess"
    local = "local"
    slurm = "slurm"
    torchrun = "torchrun"  # ranks started by torchrun, srun or a Kubernetes PyTorchJob; read from the environment


class DataParallel(StrEnum):
    ddp = "ddp"
    fsdp = "fsdp"


class ActivationCheckpointing(StrEnum):
    none = "none"
    full = "full"  # recompute each block's forward in its backward
    selective = "selective"  # keep matmul outputs, recompute the cheap ops between them


class ModelKind(StrEnum):
    dense = "dense"
    moe = "moe"
    custom = "custom"  # recipe.model.factory = {_target_: my_pkg.build, ...}
    titan = "titan"  # torchtitan's model, parallelize function and loss (taxbench[titan]); recipe.model.stack
    megatron = "megatron"  # Megatron-Core's GPTModel (taxbench[megatron], CUDA only); recipe.model.stack
    deepspeed = "deepspeed"  # taxbench's GPT (DeepSpeed's MoE layer) in DeepSpeed's engine (taxbench[deepspeed])


class DataKind(StrEnum):
    synthetic = "synthetic"
    shards = "shards"


class DataLoaderKind(StrEnum):
    auto = "auto"  # DALI on GPU ranks where installed, else torch
    torch = "torch"
    dali = "dali"


class FaultKind(StrEnum):
    flip_param_bit = "flip_param_bit"  # one parameter bit, between steps
    perturb_collective = "perturb_collective"  # one bit of a gradient all-reduce result
    nondeterministic_op = "nondeterministic_op"  # one bit of an ATen op's output inside a module


@dataclass
class ModelConfig:
    kind: ModelKind = ModelKind.dense
    # kind=custom: a Hydra node {_target_: my_pkg.build, ...kwargs} instantiated to an nn.Module (tokens -> logits)
    factory: dict[str, Any] = field(default_factory=dict)
    vocab_size: int = 256
    seq_len: int = 64
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 256
    n_experts: int = 0
    top_k: int = 0
    moe_d_ff: int = 0
    aux_loss_coef: float = 0.01
    n_shared_experts: int = 0  # MoE: always-active experts of width moe_d_ff each (DeepSeek/Nemotron style)
    # kind=titan|megatron|deepspeed: the foreign stack's own model selection and switches (taxbench.stacks.protocol)
    stack: dict[str, Any] = field(default_factory=dict)


@dataclass
class OptimizerConfig:
    lr: float = 3e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0


@dataclass
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    ep: int = 1
    data_parallel: DataParallel = DataParallel.ddp
    # pp>1: a torch.distributed.pipelining schedule (taxbench.config.layout_rules.PIPELINE_SCHEDULES: 1F1B, ...)
    pp_schedule: str = "1F1B"
    virtual_stages: int = 1  # pipeline stages per rank (Interleaved1F1B, InterleavedZeroBubble: >= 2; ZBV: 2)


@dataclass
class DataConfig:
    kind: DataKind = DataKind.synthetic
    path: str | None = None  # kind=shards: a folder built by `taxbench build-shards`
    seed: int = 1234
    loader: DataLoaderKind = DataLoaderKind.auto  # kind=shards
    num_workers: int = 0  # torch DataLoader workers / DALI threads; never changes the sample order
    verify_checksums: bool = False  # hash every shard against its index once before the ranks start


@dataclass
class RecipeConfig:
    name: str = MISSING
    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    micro_batch_size: int = 4
    global_batch_size: int = 8
    precision: Precision = Precision.fp32
    seed: int = 0
    # Recompute activations in the backward (per block, non-reentrant torch.utils.checkpoint, RNG replayed); the
    # plan's memory estimate reads the same setting.
    activation_checkpointing: ActivationCheckpointing = ActivationCheckpointing.none


@dataclass
class PolicyConfig:
    """Execution policy of one arm. Only these fields may differ between the two arms of a pair."""

    name: str = MISSING
    deterministic: bool = False
    cudnn_benchmark: bool = True
    allow_tf32: bool | None = True  # None: TF32 left as the process has it (a stack-native switch that leaves it)
    cublas_workspace_config: str | None = None
    nccl_algo: str | None = None
    # NCCL_PROTO and NCCL_MIN_NCHANNELS=NCCL_MAX_NCHANNELS=nccl_channels (null: NCCL chooses per message size). A Tree
    # all-reduce is deterministic only pinned to both (taxbench.config.policy; mode=deterministic_tree).
    nccl_proto: str | None = None
    nccl_channels: int | None = None
    nvte_allow_nondeterministic_algo: bool = True
    fill_uninitialized_memory: bool = False
    # Fast paths of custom kernels (e.g. MoE combine via index_put_(accumulate=True)) are used unless this is set.
    deterministic_kernels: bool = False
    # mode=stack_native: the arm is the training stack's own determinism switch and nothing else; the fields above
    # are then what that switch sets (filled in by taxbench.preflight from the stack), recorded and audited against
    # taxbench's full policy, not validated as taxbench's.
    stack_native: bool = False


@dataclass
class ClusterConfig:
    name: str = "local"
    launcher: Launcher = Launcher.local
    device: Device = Device.cpu
    cpu_ranks: int = 2  # world size when device=cpu (cluster=torchrun: 0 = the environment's WORLD_SIZE)
    gpus: int = 8  # world size when device=cuda (cluster=torchrun: 0 = the environment's WORLD_SIZE)
    gpus_per_node: int = 8
    nodes: int = 1
    threads_per_rank: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0 picks a free port
    # Peak dense TFLOP/s of one device for MFU; 0: taxbench.train.flops's table by GPU name (no MFU on CPU).
    peak_tflops: float = 0.0
    # The MFU a plan assumes (plan=true, the Slurm dry run) to turn the recipe's model FLOPs into wall clock and
    # GPU-hours: an assumption, printed as one; set it to what the recipe reaches on your cluster.
    planned_mfu: float = 0.35
    # Slurm (cluster=slurm)
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    time_min: int = 60
    setup: list[str] = field(default_factory=list)
    sbatch_args: dict[str, Any] = field(default_factory=dict)
    submitit_dir: str | None = None
    # cluster=slurm: validate everything, print the plan and the job, write the sbatch script, submit nothing.
    dry_run: bool = False


@dataclass
class FaultConfig:
    """Deliberate corruption of one run, to check that the gates catch it (harness self-test)."""

    enabled: bool = False
    arm: str = "deterministic"
    replica: int = 1
    step: int = 3
    rank: int = 0
    kind: FaultKind = FaultKind.flip_param_bit
    module: str | None = None  # nondeterministic_op: module path, e.g. "blocks.1.ffn"
    op: str | None = None  # nondeterministic_op: ATen op pattern, e.g. "aten.mm.default"
    # The bit flipped in the first element: 0, one ulp (as a changed summation order makes; rounding downstream may
    # absorb it), up to 31; e.g. 22, float32's highest mantissa bit, for a change that survives into every consumer.
    bit: int = 0

    def applies_to(self, arm: str, replica: str) -> bool:
        return self.enabled and self.arm == arm and str(self.replica) == replica


@dataclass
class TraceConfig:
    """Tracing-ladder capture of chosen steps; records go to <run>/trace/trace.rank<R>.jsonl (see taxbench.tracing).

    Traced steps run slower (fingerprints inside the timed step): keep `steps` narrow.
    """

    enabled: bool = False
    rung: int = 1  # 1: collectives, optimizer step, checkpoint load; 2: + module outputs; 3: + ATen ops
    steps: list[int] = field(default_factory=list)  # empty: every step
    ranks: list[int] = field(default_factory=list)  # empty: every rank
    runs: list[str] = field(default_factory=list)  # run names such as "deterministic-1"; empty: every run
    modules: list[str] = field(default_factory=list)  # fnmatch patterns on module paths (covers submodules)
    ops: list[str] = field(default_factory=list)  # fnmatch patterns on ATen op names, e.g. "aten.index_put_*"
    max_numel: int = 0  # larger tensors are recorded by shape only (no digest); 0: no limit


@dataclass
class ExperimentConfig:
    name: str = MISSING
    out_dir: str = "runs"
    steps: int = 60  # steps per arm and replica
    # Steps per interleaved block. One: CPU step times here switch between speed regimes every ~100 ms, and only
    # blocks shorter than that let both arms see the same regime (+/-1.3% against +/-5.7% with 6-step blocks, same
    # steps; benchmarks/calibration.py --block).
    block_steps: int = 1
    warmup_steps: int = 6  # fixed minimum warmup, checked by MSER-5
    # The restart-replay replica checkpoints here and resumes. 0: DEFAULT_RESUME_STEP, or half the gate runs' steps
    # where they are not longer than that (the loader sets the number, so a manifest holds the step that was used).
    resume_step: int = 0
    # Steps of each gate-only run (those not timed in the rounds: deterministic-resumed, and under interleave=pair or
    # policy the gates' other runs): a gate needs as many steps as divergence takes to show, not as many as a +/-0.5%
    # tax interval. 0: experiment.steps. Never more than the timed rounds took; the gates compare the steps both of
    # their runs hold.
    gate_steps: int = 0
    order_seed: int = 0  # seeds the randomized arm order per round
    # Continue an interrupted experiment in its existing folder (same config): finished runs are kept, unfinished ones
    # resume from their last complete checkpoint.
    continue_existing: bool = False
    confidence: float = 0.95
    # Preemption safety: a restarted experiment resumes from each run's newest checkpoint. The runs commit one at the
    # end of the first block after checkpoint_every_s seconds since their last (0: never), and/or at the end of the
    # block that reaches each multiple of checkpoint_every_steps steps (0: never); deterministic-resumed always
    # commits at resume_step. Commits fall between blocks, never inside a timed step.
    checkpoint_every_s: float = 600.0
    checkpoint_every_steps: int = 0
    # Which runs are timed: "all" interleaves baseline-0, deterministic-0, deterministic-1 and baseline-1 in rounds
    # (four models in memory at once); "pair" interleaves only the two *-0 runs (two models, half the timed steps);
    # "policy" trains one model whose policy switches per block (baseline-timed, deterministic-timed: one model in
    # memory; every gate run then runs whole, one after another).
    interleave: str = "all"
    # Stop at the precision asked for: with target_half_width > 0 (relative, e.g. 0.005) rounds are added after
    # `steps` until the tax interval's half-width reaches it, or until max_steps per run.
    target_half_width: float = 0.0
    max_steps: int = 0  # 0: 10 x steps
    # An interval wider than this (relative half-width), or one spanning zero, is reported as inconclusive.
    conclusive_half_width: float = 0.02
    # Calibration of the instrument: a known tax planted in every deterministic step (a timed wait on CPU, a spin
    # kernel on GPU, sized as this fraction of the arm's running median step), and an A/A pair (calibration=true:
    # both arms on the baseline policy) whose true tax is then exactly planted_tax. Never a determinism result.
    planted_tax: float = 0.0
    calibration: bool = False
    # Python's garbage collector off inside timed blocks and run between them (Megatron's --manual-gc).
    manual_gc: bool = True
    # Where the tax goes (taxbench.design): one timed arm per determinism knob (the baseline with that knob on),
    # two untimed replicas per knob left out of the deterministic policy (is it needed?), and torch.profiler op
    # tables of profile_steps steps per arm, taken after the rounds in runs of their own (<arm>-profile).
    ablation: bool = False
    profile_steps: int = 8
    fault: FaultConfig = field(default_factory=FaultConfig)
    trace: TraceConfig = field(default_factory=TraceConfig)


@dataclass
class ReportConfig:
    """What is written after an experiment: the HTML/markdown report and the wandb run."""

    html: bool = True  # report/report.html (self-contained) and report/report.md beside the runs
    wandb: bool = True  # needs the wandb extra; WANDB_MODE=offline unless the environment sets WANDB_MODE
    wandb_project: str = "taxbench"
    wandb_entity: str | None = None
    wandb_group: str | None = None  # default: the sweep folder's name under a Hydra multirun


@dataclass
class TaxbenchConfig:
    recipe: RecipeConfig = field(default_factory=RecipeConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    arms: dict[str, PolicyConfig] = field(default_factory=dict)
    # Per-arm changes to its copy of the recipe/cluster, e.g. `+arm_overrides.deterministic.recipe.micro_batch_size=2`.
    # The pair is refused unless they leave everything but the policy unchanged: this is how two existing recipes are
    # checked for comparability.
    arm_overrides: dict[str, dict[str, Any]] = field(default_factory=dict)
    experiment: ExperimentConfig = field(default_factory=ExperimentConfig)
    # plan=true: build the model on the meta device, print parameter count, per-GPU memory and layout validity for
    # cluster.gpus ranks, and exit without training (no GPU needed).
    plan: bool = False
    report: ReportConfig = field(default_factory=ReportConfig)
    # `taxbench run -- COMMAND`: the user's own training command as every run (taxbench.config.command); empty for
    # recipe experiments.
    run: CommandConfig = field(default_factory=CommandConfig)


ARM_NAMES = ("baseline", "deterministic")
@functools.cache
def launch_stamp() -> str:
    """`<date>-<time>-<random>` for default experiment names: the same for every config composed by one process (so
    the points of a multirun share it), and different for two launches started in the same second."""
    return f"{datetime.now():%Y%m%d-%H%M%S}-{secrets.token_hex(3)}"


def register_configs() -> None:
    if not OmegaConf.has_resolver("taxbench_stamp"):
        OmegaConf.register_new_resolver("taxbench_stamp", launch_stamp)
    cs = ConfigStore.instance()
    cs.store(name="taxbench_schema", node=TaxbenchConfig)
    # Kept out of the recipe/mode/cluster groups so that they are not listed as choices; a group file starts with
    # e.g. `defaults: [/schema/recipe@_here_]` so that its fields are typed and checked.
    cs.store(group="schema", name="recipe", node=RecipeConfig)
    cs.store(group="schema", name="policy", node=PolicyConfig)
    cs.store(group="schema", name="cluster", node=ClusterConfig)


def _schema_keys(schema: type, prefix: str = "") -> list[str]:
    """Every dotted key under a schema dataclass, nodes included ("recipe.model" and "recipe.model.kind")."""
    keys = []
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        key = f"{prefix}{f.name}"
        keys.append(key)
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            keys += _schema_keys(hint, f"{key}.")
        elif key == "arms":  # dict[str, PolicyConfig] keyed by arm
            for arm in ARM_NAMES:
                keys += [f"arms.{arm}", *_schema_keys(PolicyConfig, f"arms.{arm}.")]
    return keys


@functools.cache
def config_keys() -> tuple[str, ...]:
    return tuple(_schema_keys(TaxbenchConfig))


def unknown_key_message(key: str) -> str:
    """One line for a key the schema does not have, with the closest valid key when there is one."""
    close = difflib.get_close_matches(key, config_keys(), n=1, cutoff=0.8)
    hint = f"did you mean {close[0]}? " if close else ""
    return (f"{key} is not a config key; {hint}`python -m taxbench --cfg job` prints every valid key with its "
            "value")


def load_config(source: DictConfig | dict[str, Any]) -> TaxbenchConfig:
    """The one loader of the typed config: Hydra's composed config (resolved here) or a plain one (a manifest's
    `config`, a replay job's), merged onto the schema and returned as typed dataclasses. Every entry point goes
    through it: the experiment, the subcommands, torchrun's ranks, localize's replays.

    This also catches keys that Hydra's `+key=value` lets through (unknown fields of a structured node).
    """
    cfg = OmegaConf.to_container(source, resolve=True) if isinstance(source, DictConfig) else source
    try:
        merged = OmegaConf.merge(OmegaConf.structured(TaxbenchConfig), cfg)
        typed = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None)
        if isinstance(exc, ConfigKeyError | ConfigAttributeError) and key and str(exc).startswith("Key '"):
            raise ConfigError(unknown_key_message(key)) from exc
        first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        hint = "; `python -m taxbench --cfg job` prints every valid key with its value"
        raise ConfigError(f"{key + ': ' if key else ''}{first_line}{hint}") from exc
    assert isinstance(typed, TaxbenchConfig)
    if typed.experiment.resume_step == 0:
        typed.experiment.resume_step = default_resume_step(typed.experiment)
    if typed.experiment.calibration and "baseline" in typed.arms:
        # The A/A pair: the deterministic arm runs the baseline policy, so that its true tax is the planted one.
        typed.arms["deterministic"] = copy.deepcopy(typed.arms["baseline"])
    return typed


INTERLEAVE_MODES = ("all", "pair", "policy")
MAX_STEPS_FACTOR = 10  # experiment.max_steps=0 means this many times experiment.steps
# The most steps one run may take. The schedule draws every round's order before the first step (taxbench.design
# .round_orders: here about 30 us and 100 bytes a round, so 10^6 rounds take half a minute and 100 MB before anything
# is printed), and analysis holds every step's record of a run in memory. Far beyond that (10^20) the count does not
# even fit the int64 step columns of the records.
MAX_RUN_STEPS = 1_000_000


def max_steps(exp: ExperimentConfig) -> int:
    """The most steps a run may take: `steps`, or with a target half-width the cap on added rounds."""
    if exp.target_half_width <= 0:
        return exp.steps
    return exp.max_steps or MAX_STEPS_FACTOR * exp.steps


DEFAULT_RESUME_STEP = 20


def default_resume_step(exp: ExperimentConfig) -> int:
    """experiment.resume_step=0: step 20, or half the gate runs' steps when they are 20 or fewer."""
    steps = gate_steps(exp)
    return DEFAULT_RESUME_STEP if DEFAULT_RESUME_STEP < steps else max(steps // 2, 1)


def gate_steps(exp: ExperimentConfig) -> int:
    """The most steps a gate-only run takes: experiment.gate_steps (0: experiment.steps), never more than the timed
    rounds may take (taxbench.design.run_steps cuts it to what they did take)."""
    return min(exp.gate_steps or exp.steps, max_steps(exp))


def world_size(cluster: ClusterConfig) -> int:
    return cluster.gpus if cluster.device is Device.cuda else cluster.cpu_ranks


def world_size_key(cluster: ClusterConfig) -> str:
    """The key that sets world_size(cluster)."""
    return "cluster.gpus" if cluster.device is Device.cuda else "cluster.cpu_ranks"


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _check_run_length(exp: ExperimentConfig) -> None:
    """No run may take more than MAX_RUN_STEPS steps (why: at MAX_RUN_STEPS)."""
    lengths = [("experiment.steps", exp.steps, exp.steps), ("experiment.profile_steps", exp.profile_steps,
                                                            exp.warmup_steps + exp.profile_steps)]
    if exp.target_half_width > 0:
        shown = exp.max_steps or f"0 ({MAX_STEPS_FACTOR} x experiment.steps)"
        lengths.append(("experiment.max_steps", shown, max_steps(exp)))
    for key, value, run_steps in lengths:
        _require(run_steps <= MAX_RUN_STEPS,
                 f"{key}={value} makes a run of {run_steps} steps, more than the {MAX_RUN_STEPS} one run may take (the "
                 "schedule draws every round's order before the first step, and analysis holds every step's record "
                 f"in memory); use at most {MAX_RUN_STEPS} steps per run")


def _check_experiment_name(name: str) -> None:
    """The experiment folder is <out_dir>/<name>: one plain path component, never a way out of out_dir, and one line
    wherever it is printed or logged (no control character: a newline would split it)."""
    _require(
        bool(name) and name not in (".", "..") and "/" not in name and "\\" not in name and "\0" not in name,
        f"experiment.name={name!r} must be a plain folder name (no '/', not empty, '.' or '..'); it is created "
        "under experiment.out_dir, so choose the location with experiment.out_dir",
    )
    control = next((char for char in name if unicodedata.category(char) in ("Cc", "Zl", "Zp")), None)
    _require(control is None,
             f"experiment.name={name!r} holds the control character {control!r}; use a name of printable characters "
             "(letters, digits, '-', '_', '.')")


def _check_numbers(cfg: TaxbenchConfig) -> None:
    """NaN is no setting (it equals nothing, not even itself: two arms holding it would read as differing), and
    the optimizer's values must be finite and in their ranges."""
    for key, value in _leaves(dataclasses.asdict(cfg), ""):
        _require(not (isinstance(value, float) and math.isnan(value)), f"{key}=nan is not a number; give a value")
    optimizer, key = cfg.recipe.optimizer, "recipe.optimizer"
    for name, value in dataclasses.asdict(optimizer).items():
        _require(math.isfinite(value), f"{key}.{name}={value} must be a finite number")
    _require(optimizer.lr > 0, f"{key}.lr={optimizer.lr} must be > 0, e.g. 3e-4")
    for name in ("beta1", "beta2"):
        value = getattr(optimizer, name)
        _require(0 <= value < 1, f"{key}.{name}={value} must be in [0, 1), e.g. 0.9")
    _require(optimizer.eps > 0, f"{key}.eps={optimizer.eps} must be > 0, e.g. 1e-8")
    _require(optimizer.weight_decay >= 0, f"{key}.weight_decay={optimizer.weight_decay} must be >= 0")
    _require(optimizer.grad_clip >= 0, f"{key}.grad_clip={optimizer.grad_clip} must be >= 0 (0: no clipping)")


def _leaves(node: Any, path: str) -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every leaf of a config as plain containers."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _leaves(value, f"{path}.{key}" if path else str(key))
    elif isinstance(node, list | tuple):
        for index, value in enumerate(node):
            yield from _leaves(value, f"{path}[{index}]")
    else:
        yield path, node


def validate(cfg: TaxbenchConfig) -> None:
    """Cross-field rules; raises ConfigError naming the key, the value and the fix."""
    recipe, cluster, exp = cfg.recipe, cfg.cluster, cfg.experiment
    _require(
        sorted(cfg.arms) == sorted(ARM_NAMES),
        f"arms must be exactly {list(ARM_NAMES)}, got {sorted(cfg.arms)}; select policies with "
        "mode@arms.baseline=<mode> and mode@arms.deterministic=<mode>",
    )
    for key, value in (
        ("experiment.steps", exp.steps),
        ("experiment.block_steps", exp.block_steps),
        ("recipe.micro_batch_size", recipe.micro_batch_size),
        ("recipe.global_batch_size", recipe.global_batch_size),
        ("cluster.threads_per_rank", cluster.threads_per_rank),
        ("recipe.model.seq_len", recipe.model.seq_len),
        ("recipe.model.n_layers", recipe.model.n_layers),
        ("recipe.model.vocab_size", recipe.model.vocab_size),
        ("recipe.model.d_model", recipe.model.d_model),
        ("recipe.model.n_heads", recipe.model.n_heads),
        ("recipe.model.d_ff", recipe.model.d_ff),
    ):
        _require(value >= 1, f"{key}={value} must be >= 1")
    _check_run_length(exp)
    _check_experiment_name(exp.name)
    _check_numbers(cfg)
    _require(cluster.peak_tflops >= 0,
             f"cluster.peak_tflops={cluster.peak_tflops} must be >= 0 (0: from the GPU name; H100 bf16: 989)")
    _require(0 < cluster.planned_mfu <= 1,
             f"cluster.planned_mfu={cluster.planned_mfu} must be in (0, 1] (a fraction of the peak: 0.35 is 35% MFU)")
    _require(0 <= cluster.master_port <= 65535,
             f"cluster.master_port={cluster.master_port} must be a TCP port in [1, 65535], or 0 to pick a free one")
    _require(
        world_size(cluster) >= 1,
        f"world size must be >= 1 (cluster.cpu_ranks / cluster.gpus), got {world_size(cluster)}",
    )
    _require(
        exp.steps % exp.block_steps == 0,
        f"experiment.steps={exp.steps} is not a multiple of experiment.block_steps={exp.block_steps}; "
        f"use e.g. experiment.steps={exp.steps - exp.steps % exp.block_steps or exp.block_steps}",
    )
    _require(
        0 <= exp.warmup_steps < exp.steps,
        f"experiment.warmup_steps={exp.warmup_steps} must be in [0, experiment.steps={exp.steps})",
    )
    _require(
        1 <= exp.resume_step < exp.steps,
        f"experiment.resume_step={exp.resume_step} must be in [1, experiment.steps={exp.steps}) so that steps remain "
        f"after the resume to compare; e.g. experiment.resume_step={max(exp.steps // 2, 1)}",
    )
    _require(0 < exp.confidence < 1, f"experiment.confidence={exp.confidence} must be in (0, 1), e.g. 0.95")
    _require(exp.interleave in INTERLEAVE_MODES,
             f"experiment.interleave={exp.interleave!r} must be one of {list(INTERLEAVE_MODES)} (all: every run but "
             "the resumed one is timed; pair: only baseline-0 and deterministic-0, for recipes that fit two models; "
             "policy: one model whose policy switches per block, for recipes that fit one)")
    _require(not (exp.interleave == "policy" and exp.ablation),
             "experiment.interleave=policy with experiment.ablation=true: the knob arms are not timed on the shared "
             "model yet; use experiment.interleave=pair or all for an ablation")
    fixed_at_build = {ModelKind.megatron: "Megatron-Core's deterministic_mode is fixed when its GPTModel is built",
                      ModelKind.deepspeed: "DeepSpeed's deterministic_mode is fixed when its engine is built"}
    _require(not (exp.interleave == "policy" and recipe.model.kind in fixed_at_build),
             f"experiment.interleave=policy trains one model whose policy switches per block, but "
             f"{fixed_at_build.get(recipe.model.kind)}; use experiment.interleave=all or pair")
    _require(not (recipe.model.kind == ModelKind.megatron and cluster.device == Device.cpu),
             "recipe.model.kind=megatron needs a CUDA GPU (Megatron-Core's schedule, gradient buffers and norms are "
             "CUDA only) but cluster.device=cpu; run it with cluster.device=cuda on a GPU node or cluster=slurm, "
             "after pip install 'taxbench[megatron]'")
    _require(0 <= exp.planted_tax < 10,
             f"experiment.planted_tax={exp.planted_tax} must be in [0, 10) (a fraction: 0.02 plants a 2% tax)")
    _require(0 <= exp.target_half_width < 1,
             f"experiment.target_half_width={exp.target_half_width} must be in [0, 1) (relative: 0.005 is +/-0.5%; "
             "0 runs exactly experiment.steps)")
    _require(0 < exp.conclusive_half_width < 1,
             f"experiment.conclusive_half_width={exp.conclusive_half_width} must be in (0, 1), e.g. 0.02")
    _require(exp.max_steps >= 0, f"experiment.max_steps={exp.max_steps} must be >= 0 (0: {MAX_STEPS_FACTOR} x steps)")
    if exp.target_half_width > 0:
        cap = max_steps(exp)
        _require(cap >= exp.steps and cap % exp.block_steps == 0,
                 f"experiment.max_steps={exp.max_steps} must be >= experiment.steps={exp.steps} and a multiple of "
                 f"experiment.block_steps={exp.block_steps}")
    _require(
        recipe.model.d_model % recipe.model.n_heads == 0,
        f"recipe.model.d_model={recipe.model.d_model} is not divisible by recipe.model.n_heads={recipe.model.n_heads}",
    )
    _require(exp.profile_steps >= 1, f"experiment.profile_steps={exp.profile_steps} must be >= 1")
    _require(not (exp.ablation and exp.calibration),
             "experiment.ablation=true with experiment.calibration=true: an A/A pair has no knob that differs; "
             "drop one of them")
    _require(exp.checkpoint_every_steps >= 0,
             f"experiment.checkpoint_every_steps={exp.checkpoint_every_steps} must be >= 0 (0: no checkpoints)")
    _require(exp.checkpoint_every_s >= 0,
             f"experiment.checkpoint_every_s={exp.checkpoint_every_s} must be >= 0 (0: no checkpoints by time)")
    _require(exp.gate_steps >= 0, f"experiment.gate_steps={exp.gate_steps} must be >= 0 (0: experiment.steps)")
    _require(exp.resume_step < gate_steps(exp),
             f"experiment.resume_step={exp.resume_step} must be below experiment.gate_steps={gate_steps(exp)} so that "
             "the restart-replay gate has steps after the resume to compare")
    ws = world_size(cluster)
    problems = layout_problems(recipe, ws, world_size_key(cluster))
    _require(not problems, "; ".join(problems))
    _require(recipe.data.num_workers >= 0, f"recipe.data.num_workers={recipe.data.num_workers} must be >= 0")
    fault = exp.fault
    if fault.enabled:
        _require(fault.arm in ARM_NAMES, f"experiment.fault.arm={fault.arm!r} must be one of {list(ARM_NAMES)}")
        _require(1 <= fault.step <= exp.steps, f"experiment.fault.step={fault.step} must be in [1, {exp.steps}]")
        _require(fault.step <= gate_steps(exp),
                 f"experiment.fault.step={fault.step} is past the gates' experiment.gate_steps={gate_steps(exp)}: no "
                 "gate would compare it; plant it earlier or raise experiment.gate_steps")
        _require(0 <= fault.rank < ws, f"experiment.fault.rank={fault.rank} must be in [0, {ws})")
        _require(fault.replica in (0, 1), f"experiment.fault.replica={fault.replica} must be 0 or 1")
        _require(0 <= fault.bit <= 31, f"experiment.fault.bit={fault.bit} must be in [0, 31] (0: the lowest bit)")
        _require(
            fault.kind != "perturb_collective" or ws >= 2,
            "experiment.fault.kind=perturb_collective needs world size >= 2 (a gradient all-reduce to perturb)",
        )
        _require(
            fault.kind != "nondeterministic_op" or bool(fault.module and fault.op),
            "experiment.fault.kind=nondeterministic_op needs experiment.fault.module (e.g. blocks.1.ffn) and "
            "experiment.fault.op (e.g. aten.mm.default)",
        )
    trace = exp.trace
    if trace.enabled:
        _require(trace.rung in (1, 2, 3), f"experiment.trace.rung={trace.rung} must be 1, 2 or 3")
        _require(all(1 <= s <= exp.steps for s in trace.steps),
                 f"experiment.trace.steps={list(trace.steps)} must lie in [1, {exp.steps}]")
        _require(all(0 <= r < ws for r in trace.ranks),
                 f"experiment.trace.ranks={list(trace.ranks)} must lie in [0, {ws})")
        _require(trace.max_numel >= 0, f"experiment.trace.max_numel={trace.max_numel} must be >= 0 (0: no limit)")
