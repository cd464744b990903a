"""Plan a recipe for a GPU cluster without running it: build the model on the meta device, count its parameters, check
the parallel layout for `cluster.gpus` ranks and estimate per-GPU memory.

    python -m taxbench +recipe=moe_1t cluster.gpus=2432 plan=true

Memory is estimated as the recipe's stack holds state (ModelState): taxbench's trainer keeps fp32 parameters (bf16
recipes compute under autocast), fp32 gradients and AdamW's two fp32 moments, i.e. 4 + 4 + 8 bytes per parameter held
by a rank. Megatron-Core with its distributed optimizer (recipe.model.stack.use_distributed_optimizer=true) keeps the
model's parameters (bf16 with recipe.model.stack.params_dtype=bf16, else fp32) and fp32 gradient buffers whole on every
data-parallel rank, and shards the optimizer's state (the fp32 main parameters of bf16 ones, and AdamW's two moments)
over the parameter's data-parallel group, dp for dense parameters and edp for experts: 6 + 12/d bytes per parameter
(bf16) or 8 + 8/d (fp32) against 18 or 16 without it, Megatron's own table (docs: distributed optimizer).

A rank holds its pipeline stage's layers; attention and dense/shared MLP matrices are split over tp, routed experts
over ep; FSDP also shards everything over data parallel (experts over dp/ep). Activations are per-token counts of the
tensors the backward keeps, for the micro-batches a 1F1B pipeline schedule keeps in flight on that stage
(pp - stage), with flash attention (no seq^2 term) and no sequence parallelism, for each
`recipe.activation_checkpointing` (taxbench.parallel.recompute):

- none: everything autograd saves in each layer;
- full: each layer's input, plus the rest of one layer's activations while its backward recomputes them;
- selective: each layer's input and the outputs of its matmul-like ops (qkv, attention, output projection, router,
  expert and shared-expert up/down projections: what the selective policy keeps), plus the rest of one layer's
  activations while its backward recomputes them.

The headline is the recipe's setting; the other two are shown beside it so that a user sees what recompute buys. The
heaviest stage is reported. Not counted: the CUDA context, communication buffers and FSDP's gathered layer weights.

The experiment holds experiment.interleave's models at once in its timed rounds; where they do not fit a GPU, the plan
names the schedule that does (one model at a time). And it costs the whole experiment as configured: runs, steps,
wall clock at an assumed MFU, GPU-hours and the timed share (taxbench.parallel.gpu_hours).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from taxbench.config.layout_rules import layout_problems
from taxbench.config.schema import (
    ActivationCheckpointing,
    ConfigError,
    DataParallel,
    ModelConfig,
    ModelKind,
    ParallelConfig,
    Precision,
    RecipeConfig,
    TaxbenchConfig,
    max_steps,
)
from taxbench.config.shape import ParallelShape
from taxbench.design import MODELS_HELD, ExperimentSteps
from taxbench.parallel.gpu_hours import GpuHours, gpu_hours, render_gpu_hours
from taxbench.parallel.layout import expert_modules, tensor_parallel_plan
from taxbench.workloads import build_model

GIB = 1024**3
GPU_MEMORY = {"80 GB H100": 80e9, "141 GB H200": 141e9}  # bytes, as the vendors count them
RECOMPUTE_MODES = (ActivationCheckpointing.none, ActivationCheckpointing.selective, ActivationCheckpointing.full)


@dataclass(frozen=True)
class ModelState:
    """Bytes per parameter of what a rank keeps between steps: weights and gradients on every rank that holds the
    parameter, optimizer state (with the fp32 main copy of low-precision weights) divided over its data-parallel group
    when `sharded` (Megatron's distributed optimizer)."""

    weights: int
    grads: int
    optimizer: int
    sharded: bool
    description: str

    def per_param(self, shards: int) -> float:
        """Bytes per parameter with the optimizer state over `shards` data-parallel ranks (Megatron's 6 + 12/d)."""
        return self.weights + self.grads + self.optimizer / (shards if self.sharded else 1)


def model_state(recipe: RecipeConfig) -> ModelState:
    """How the recipe's stack keeps parameters, gradients and optimizer state (see the module docstring)."""
    stack = recipe.model.stack if str(recipe.model.kind) == ModelKind.megatron.value else {}
    distributed = bool(stack.get("use_distributed_optimizer", False))
    bf16 = stack.get("params_dtype") == "bf16"
    if bf16:  # the fp32 main parameters are the optimizer's, beside the moments (Megatron's Float16 optimizers)
        weights, optimizer, held = 2, 12, "bf16 weights, fp32 grads, fp32 main params and AdamW moments"
    else:
        weights, optimizer, held = 4, 8, "fp32 weights and grads, AdamW fp32 moments"
    if distributed:
        formula = f"{weights + 4} + {optimizer}/d"
        return ModelState(weights, 4, optimizer, True, f"{held}; Megatron's distributed optimizer shards the "
                          f"optimizer state over each parameter's data-parallel group (dp dense, edp experts): "
                          f"{formula} bytes per parameter")
    return ModelState(weights, 4, optimizer, False, f"{held}: {weights + 4 + optimizer} bytes per parameter")


@dataclass
class StageMemory:
    stage: int
    recompute: ActivationCheckpointing  # the activation recompute these activations assume
    params: float  # parameters held by one rank of this stage (after tp/ep and, with FSDP, dp sharding)
    weights: float
    grads: float
    optimizer: float
    activations: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations

    def held(self, models: int) -> float:
        """Bytes with `models` models in memory at once: each keeps its weights, grads and optimizer state; only the
        one training holds activations."""
        return models * (self.weights + self.grads + self.optimizer) + self.activations


@dataclass(frozen=True)
class LayerActivations:
    """Elements per token of one transformer layer that its backward needs."""

    saved: float  # everything autograd keeps without recompute
    matmul_outputs: float  # outputs of the matmul-like ops, which selective recompute keeps
    layer_input: float  # the block's input, which full and selective recompute keep

    def kept(self, mode: ActivationCheckpointing) -> float:
        """Elements per token a layer keeps from its forward to its backward under `mode`."""
        if mode is ActivationCheckpointing.none:
            return self.saved
        if mode is ActivationCheckpointing.selective:
            return self.layer_input + self.matmul_outputs
        return self.layer_input

    def working_set(self, mode: ActivationCheckpointing) -> float:
        """Elements per token that the recompute of one layer adds, during its backward, to what the layer keeps."""
        return 0.0 if mode is ActivationCheckpointing.none else max(self.saved - self.kept(mode), 0.0)


@dataclass
class Plan:
    recipe: str
    gpus: int
    total_params: int
    active_params: int
    params_by_kind: dict[str, int]
    problems: list[str]
    layout: dict[str, int | str] = field(default_factory=dict)
    activation_checkpointing: ActivationCheckpointing = ActivationCheckpointing.none  # the recipe's
    # Heaviest stage under the recipe's activation recompute; None when the layout is invalid.
    memory: StageMemory | None = None
    # Heaviest stage under each recompute mode (the recipe's included), to show what recompute buys.
    memory_by_mode: dict[ActivationCheckpointing, StageMemory] = field(default_factory=dict)
    # Every stage under the recipe's activation recompute, in stage order (what one rank of each stage holds).
    stages: list[StageMemory] = field(default_factory=list)
    interleave: str = "all"  # the experiment's experiment.interleave: how many models its timed rounds hold
    state: ModelState | None = None  # how the stack keeps parameters, gradients and optimizer state
    one_model_alternative: str = ""  # the one-model schedule this recipe can run, where interleave's models do not fit
    hours: GpuHours | None = None  # the experiment's device time; None when the layout is invalid
    cfg: TaxbenchConfig | None = None

    @property
    def valid(self) -> bool:
        return not self.problems


def _param_kinds(model: nn.Module) -> tuple[dict[str, str], set[str]]:
    """name -> 'experts' | 'embeddings' | 'dense', and the names that tensor parallelism splits."""
    expert_ids = {id(p) for m in expert_modules(model) for p in (m.w_up, m.w_down)}
    kinds = {}
    for name, param in model.named_parameters():
        top = name.split(".")[0]
        kinds[name] = "experts" if id(param) in expert_ids else "dense" if top == "blocks" else "embeddings"
    try:
        prefixes = tuple(f"{key}." for key in tensor_parallel_plan(model))
    except ConfigError:
        prefixes = ()
    return kinds, {name for name in kinds if name.startswith(prefixes)}


def _stage_of(name: str, layers_per_stage: int, pp: int) -> int:
    parts = name.split(".")
    if parts[0] == "blocks" and len(parts) > 1 and parts[1].isdigit():
        return min(int(parts[1]) // layers_per_stage, pp - 1)
    return 0 if parts[0] in ("embed", "pos") else pp - 1


def _layer_activations(recipe: RecipeConfig) -> LayerActivations:
    m, tp = recipe.model, recipe.parallel.tp
    d = m.d_model
    attention = 2 * d + 3 * d / tp + d / tp + d  # norm in/out, qkv, attention out, residual
    attention_matmuls = 3 * d / tp + d / tp + d  # qkv, fused attention, output projection (its all-reduced output)
    if m.n_experts:
        ff = m.moe_d_ff or m.d_ff
        routed = m.top_k * (d + 2 * ff + d)  # dispatched tokens, up and gelu outputs, expert outputs
        shared = m.n_shared_experts * 2 * ff / tp
        ffn = 2 * d + 2 * m.n_experts + routed + shared  # norm in/out, fp32 router probabilities
        # router logits, expert up and down outputs per routed copy, shared up and down
        ffn_matmuls = m.n_experts + m.top_k * (ff + d) + (m.n_shared_experts * ff / tp + d if m.n_shared_experts else 0)
    else:
        ffn = 2 * d + 2 * m.d_ff / tp
        ffn_matmuls = m.d_ff / tp + d  # up and down projections
    return LayerActivations(saved=attention + ffn, matmul_outputs=attention_matmuls + ffn_matmuls, layer_input=d)


def _one_model_schedule(cfg: TaxbenchConfig) -> str:
    """How this recipe's experiment runs with one model in memory at a time."""
    kind = cfg.recipe.model.kind
    if kind in (ModelKind.megatron, ModelKind.deepspeed):  # experiment.interleave=policy is refused for them
        stack = "Megatron-Core's deterministic_mode" if kind == ModelKind.megatron else "DeepSpeed's deterministic_mode"
        return (f"whole runs alternated A B B A, one model at a time, as `taxbench run -- COMMAND` runs the stack's "
                f"own trainer (experiment.interleave=policy is refused here: {stack} is fixed when the model is built)")
    return "experiment.interleave=policy (one model whose policy switches per block)"


def _rank_share(shape: tuple[int, ...], experts: bool, tp_split: bool, par: ParallelConfig, dp: int,
                fsdp: bool) -> float:
    """Elements of one parameter that the heaviest rank of its stage holds: experts sliced over ep, tensor-parallel
    matrices split over tp, and with FSDP2 dim 0 cut into as many chunks as shards, torch.chunk-style (ceil), so the
    first ranks hold ceil(rows / shards) rows: 32 experts over 19 ranks are 2 per rank, not 32/19."""
    rows = shape[0] if shape else 1
    rest = math.prod(shape[1:]) / (par.tp if tp_split else 1)
    if experts:
        rows //= par.ep
    if fsdp:
        rows = math.ceil(rows / (dp // par.ep if experts else dp))
    return rows * rest


def planned_model(model: ModelConfig) -> ModelConfig:
    """The model whose parameters (and FLOPs) are counted: for Megatron-Core's GPTModel, taxbench's GPT of the same
    fields (MoE when it has experts), which holds the same matrices: fused qkv and output projection, a GELU MLP or
    the router, the experts and shared experts without biases (the Megatron MoE recipes' add_bias_linear=false),
    layer norms, untied embeddings and head. Megatron's GPTModel does not need the GPU to build, but the planner
    imports no training stack. DeepSpeed's model is taxbench's GPT, its MoE layer counted as taxbench's MoE of the
    same fields (DeepSpeed's gate does not run on the meta device)."""
    if str(model.kind) not in (ModelKind.megatron.value, ModelKind.deepspeed.value):
        return model
    return replace(model, kind=ModelKind.moe if model.n_experts else ModelKind.dense, stack={})


def _learned_positions(model: ModelConfig) -> bool:
    """Whether the model holds a learned position table (Megatron's default position embedding is RoPE: none)."""
    return str(model.kind) != ModelKind.megatron.value or model.stack.get("position_embedding_type") == \
        "learned_absolute"


def make_plan(cfg: TaxbenchConfig) -> Plan:
    recipe, gpus = cfg.recipe, cfg.cluster.gpus
    if str(recipe.model.kind) == ModelKind.titan.value:  # its flavor's Llama is no GPT of the recipe's fields
        raise ConfigError(f"plan=true counts taxbench's GPT/MoE and the Megatron-Core and DeepSpeed models of the "
                          f"recipe's fields; recipe {recipe.name} is torchtitan's own model, which the planner does "
                          "not count: run it (or its job config) on the cluster instead")
    with torch.device("meta"):
        model = build_model(planned_model(recipe.model), deterministic_kernels=True)
    kinds, tp_split = _param_kinds(model)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()
              if _learned_positions(recipe.model) or not name.startswith("pos.")}
    kinds = {name: kind for name, kind in kinds.items() if name in shapes}
    numels = {name: math.prod(shape) for name, shape in shapes.items()}
    by_kind = {kind: sum(n for name, n in numels.items() if kinds[name] == kind) for kind in ("embeddings", "dense",
                                                                                             "experts")}
    total = sum(numels.values())
    m = recipe.model
    active = total - by_kind["experts"] + (by_kind["experts"] * m.top_k // m.n_experts if m.n_experts else 0)
    problems = layout_problems(recipe, gpus)
    state = model_state(recipe)
    plan = Plan(recipe.name, gpus, total, active, by_kind, problems, interleave=cfg.experiment.interleave, state=state,
                one_model_alternative=_one_model_schedule(cfg), cfg=cfg)
    if problems:
        return plan
    plan.hours = gpu_hours(cfg, active, max_steps(cfg.experiment))

    par = recipe.parallel
    shape = ParallelShape.of(par, gpus)
    dp = shape.dp
    layers_per_stage = m.n_layers // par.pp
    micro_batches = shape.micro_batches(recipe.global_batch_size, recipe.micro_batch_size)
    assert micro_batches is not None  # layout_problems found the batch to split evenly
    plan.layout = {
        "tp": par.tp, "pp": par.pp, "ep": par.ep, "dp": dp, "edp": shape.edp,
        "data_parallel": par.data_parallel.value, "layers_per_stage": layers_per_stage,
        "experts_per_rank": m.n_experts // par.ep if m.n_experts else 0, "micro_batches_per_step": micro_batches,
    }
    fsdp = par.data_parallel is DataParallel.fsdp
    element = 2 if recipe.precision in (Precision.bf16, Precision.fp8) else 4  # fp8: bf16 activations
    layer = _layer_activations(recipe)
    tokens = recipe.micro_batch_size * m.seq_len
    stages: dict[ActivationCheckpointing, list[StageMemory]] = {mode: [] for mode in RECOMPUTE_MODES}
    for stage in range(par.pp):
        held = optimizer = 0.0
        for name, param_shape in shapes.items():
            if _stage_of(name, layers_per_stage, par.pp) == stage:
                experts = kinds[name] == "experts"
                share = _rank_share(param_shape, experts, name in tp_split, par, dp, fsdp)
                held += share
                optimizer += share * state.optimizer / (
                    (shape.edp if experts else dp) if state.sharded else 1)
        in_flight = min(par.pp - stage, micro_batches)
        logits = tokens * m.vocab_size * 4 * 2 if stage == par.pp - 1 else 0  # fp32 logits and their gradient
        for mode in RECOMPUTE_MODES:
            kept = layers_per_stage * layer.kept(mode) * in_flight + layer.working_set(mode)
            stages[mode].append(StageMemory(
                stage, mode, held, held * state.weights, held * state.grads, optimizer,
                kept * tokens * element + logits,
            ))
    plan.memory_by_mode = {mode: max(per_stage, key=lambda s: s.total) for mode, per_stage in stages.items()}
    plan.activation_checkpointing = recipe.activation_checkpointing
    plan.memory = plan.memory_by_mode[recipe.activation_checkpointing]
    plan.stages = stages[recipe.activation_checkpointing]
    return plan


def _count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def render_plan(plan: Plan) -> str:
    lines = [
        f"taxbench plan: recipe {plan.recipe} on {plan.gpus} GPUs (model built on the meta device)",
        f"parameters: {plan.total_params:,} ({_count(plan.total_params)}), active per token "
        f"{_count(plan.active_params)}",
        "  " + ", ".join(f"{kind} {_count(n)}" for kind, n in plan.params_by_kind.items()),
    ]
    if not plan.valid:
        lines.append("layout: INVALID")
        lines += [f"  - {problem}" for problem in plan.problems]
        return "\n".join(lines)
    lay = plan.layout
    lines.append(
        f"layout: valid - tp={lay['tp']} x pp={lay['pp']} x dp={lay['dp']} = {plan.gpus} GPUs, ep={lay['ep']} "
        f"within dp (edp={lay['edp']}), {lay['data_parallel']}; {lay['layers_per_stage']} layers per stage, "
        f"{lay['experts_per_rank']} experts per rank, {lay['micro_batches_per_step']} micro-batches per step"
    )
    return "\n".join(lines + _render_memory(plan))


def _fits(total: float) -> str:
    gpus = [name for name, capacity in GPU_MEMORY.items() if total <= capacity]
    if len(gpus) == len(GPU_MEMORY):
        return f"fits an {' and a '.join(gpus)}"
    if gpus:
        missing = [name for name in GPU_MEMORY if name not in gpus]
        return f"fits a {' and a '.join(gpus)}, not an {' or a '.join(missing)}"
    return f"fits neither an {' nor a '.join(GPU_MEMORY)}"


def _render_memory(plan: Plan) -> list[str]:
    chosen = plan.memory
    assert chosen is not None and plan.state is not None
    columns = [plan.memory_by_mode[mode] for mode in RECOMPUTE_MODES]
    headers = [f"{m.recompute.value}{' *' if m.recompute is chosen.recompute else ''} (stage {m.stage})"
               for m in columns]
    lines = [
        f"per-GPU memory estimate, GiB ({plan.state.description}), heaviest pipeline stage:",
        f"  recipe.activation_checkpointing={chosen.recompute.value}: {chosen.total / GIB:.1f} GiB on stage "
        f"{chosen.stage}, {_fits(chosen.total)}",
        f"  {'':12}" + "".join(f" {h:>20}" for h in headers),
        f"  {'params held':12}" + "".join(f" {_count(m.params):>20}" for m in columns),
    ]
    for label in ("weights", "grads", "optimizer", "activations", "total"):
        lines.append(f"  {label:12}" + "".join(f" {getattr(m, label) / GIB:20.1f}" for m in columns))
    lines.append("  * the recipe's setting. none keeps all activations, selective each layer's input and matmul "
                 "outputs, full its input")
    lines.append(f"  assumes: {plan.layout['pp']}-stage 1F1B keeping pp - stage micro-batches in flight, flash "
                 "attention, no sequence parallelism; not counted: the CUDA context, NCCL and token-dispatch "
                 "buffers, FSDP's gathered weights, allocator fragmentation (keep a few GiB free)")
    lines += _render_interleave(plan, chosen)
    if plan.hours is not None and plan.cfg is not None:
        lines += render_gpu_hours(plan.hours, plan.cfg)
    return lines


def _render_interleave(plan: Plan, chosen: StageMemory) -> list[str]:
    """What the experiment holds: the timed rounds keep experiment.interleave's models in memory at once; where they
    do not fit an 80 GB H100 but one model does, the schedule that holds one."""
    models = MODELS_HELD[plan.interleave]
    one_model_interleave = not plan.one_model_alternative.startswith("whole runs")  # else refused for this stack
    others = ", ".join(f"{mode if mode != 'policy' or one_model_interleave else 'one model'}: {n} "
                       f"model{'s' if n > 1 else ''}, {chosen.held(n) / GIB:.1f} GiB"
                       for mode, n in MODELS_HELD.items() if mode != plan.interleave)
    lines = [f"experiment: experiment.interleave={plan.interleave} holds {models} model{'s' if models > 1 else ''} at "
             f"once, {chosen.held(models) / GIB:.1f} GiB per GPU on stage {chosen.stage}, "
             f"{_fits(chosen.held(models))} ({others})"]
    smallest = min(GPU_MEMORY.values())
    if chosen.held(models) > smallest and models > 1 and chosen.held(1) <= smallest:
        lines.append(f"  on an {min(GPU_MEMORY, key=GPU_MEMORY.__getitem__)} the experiment fits one model at a time "
                     f"({chosen.held(1) / GIB:.1f} GiB): {plan.one_model_alternative}")
    return lines


def cost_of(cfg: TaxbenchConfig, steps: ExperimentSteps | None = None, params: int | None = None) -> GpuHours | None:
    """The device time of the experiment `cfg` (or of `steps` of its recipe) on cluster.gpus GPUs; a model the
    planner does not build (torchtitan's own) is costed on `params` (its count, taken as all active) where given,
    else None."""
    try:
        plan = make_plan(cfg)
    except ConfigError:
        return None if params is None else gpu_hours(cfg, params, max_steps(cfg.experiment), steps)
    if plan.hours is None:
        return None
    return plan.hours if steps is None else gpu_hours(cfg, plan.active_params, steps.per_run, steps)
