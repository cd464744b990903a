"""Plan a recipe for a GPU cluster without running it: build the model on the meta device, count its parameters, check
the parallel layout for `cluster.gpus` ranks and estimate per-GPU memory.

    python -m taxbench +recipe=moe_1t cluster.gpus=2432 plan=true

Memory is estimated as taxbench's trainer holds state: fp32 parameters (bf16 recipes compute under autocast), fp32
gradients and AdamW's two fp32 moments, i.e. 4 + 4 + 8 bytes per parameter held by a rank. A rank holds its pipeline
stage's layers; attention and dense/shared MLP matrices are split over tp, routed experts over ep; FSDP also shards
everything over data parallel (experts over dp/ep). Activations are per-token counts of the tensors the backward keeps,
for the micro-batches a 1F1B pipeline schedule keeps in flight on that stage (pp - stage), with flash attention (no
seq^2 term) and no sequence parallelism, without recomputation and with full activation recomputation (layer inputs
plus one layer's working set). The heaviest stage is reported.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from taxbench.config import ConfigError, DataParallel, Precision, RecipeConfig, TaxbenchConfig, layout_problems
from taxbench.workloads import build_model

BYTES_PER_PARAM = {"weights": 4, "grads": 4, "optimizer": 8}
GIB = 1024**3


@dataclass
class StageMemory:
    stage: int
    params: float  # parameters held by one rank of this stage (after tp/ep and, with FSDP, dp sharding)
    weights: float
    grads: float
    optimizer: float
    activations: float
    activations_recompute: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations

    @property
    def total_recompute(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations_recompute


@dataclass
class Plan:
    recipe: str
    gpus: int
    total_params: int
    active_params: int
    params_by_kind: dict[str, int]
    problems: list[str]
    layout: dict[str, int | str] = field(default_factory=dict)
    # Heaviest stage without and with full activation recomputation; None when the layout is invalid.
    memory: StageMemory | None = None
    memory_recompute: StageMemory | None = None

    @property
    def valid(self) -> bool:
        return not self.problems


def _param_kinds(model: nn.Module) -> tuple[dict[str, str], set[str]]:
    """name -> 'experts' | 'embeddings' | 'dense', and the names that tensor parallelism splits."""
    from taxbench.parallel import expert_modules, tensor_parallel_plan

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


def _activation_elements_per_token(recipe: RecipeConfig) -> tuple[float, float]:
    """(elements kept per token per layer, elements of a layer's input per token)."""
    m, tp = recipe.model, recipe.parallel.tp
    d = m.d_model
    attention = 2 * d + 3 * d / tp + d / tp + d  # norm in/out, qkv, attention out, residual
    if m.n_experts:
        ff = m.moe_d_ff or m.d_ff
        routed = m.top_k * (d + 2 * ff + d)  # dispatched tokens, up and gelu outputs, expert outputs
        shared = m.n_shared_experts * 2 * ff / tp
        ffn = 2 * d + 2 * m.n_experts + routed + shared  # norm in/out, fp32 router probabilities
    else:
        ffn = 2 * d + 2 * m.d_ff / tp
    return attention + ffn, d


def make_plan(cfg: TaxbenchConfig) -> Plan:
    recipe, gpus = cfg.recipe, cfg.cluster.gpus
    with torch.device("meta"):
        model = build_model(recipe.model, deterministic_kernels=True)
    kinds, tp_split = _param_kinds(model)
    numels = {name: p.numel() for name, p in model.named_parameters()}
    by_kind = {kind: sum(n for name, n in numels.items() if kinds[name] == kind) for kind in ("embeddings", "dense",
                                                                                             "experts")}
    total = sum(numels.values())
    m = recipe.model
    active = total - by_kind["experts"] + (by_kind["experts"] * m.top_k // m.n_experts if m.n_experts else 0)
    problems = layout_problems(recipe, gpus)
    plan = Plan(recipe.name, gpus, total, active, by_kind, problems)
    if problems:
        return plan

    par = recipe.parallel
    dp = gpus // (par.tp * par.pp)
    layers_per_stage = m.n_layers // par.pp
    micro_batches = recipe.global_batch_size // (recipe.micro_batch_size * dp)
    plan.layout = {
        "tp": par.tp, "pp": par.pp, "ep": par.ep, "dp": dp, "edp": dp // par.ep,
        "data_parallel": par.data_parallel.value, "layers_per_stage": layers_per_stage,
        "experts_per_rank": m.n_experts // par.ep if m.n_experts else 0, "micro_batches_per_step": micro_batches,
    }
    fsdp = par.data_parallel is DataParallel.fsdp
    element = 2 if recipe.precision is Precision.bf16 else 4
    kept, layer_input = _activation_elements_per_token(recipe)
    tokens = recipe.micro_batch_size * m.seq_len
    stages = []
    for stage in range(par.pp):
        held = 0.0
        for name, n in numels.items():
            if _stage_of(name, layers_per_stage, par.pp) != stage:
                continue
            share = n / (par.ep if kinds[name] == "experts" else 1) / (par.tp if name in tp_split else 1)
            if fsdp:
                share /= dp // par.ep if kinds[name] == "experts" else dp
            held += share
        in_flight = min(par.pp - stage, micro_batches)
        per_layer = kept * tokens * element
        logits = tokens * m.vocab_size * 4 * 2 if stage == par.pp - 1 else 0  # fp32 logits and their gradient
        activations = layers_per_stage * per_layer * in_flight + logits
        recompute = layers_per_stage * layer_input * tokens * element * in_flight + per_layer + logits
        stages.append(StageMemory(
            stage, held, held * BYTES_PER_PARAM["weights"], held * BYTES_PER_PARAM["grads"],
            held * BYTES_PER_PARAM["optimizer"], activations, recompute,
        ))
    plan.memory = max(stages, key=lambda s: s.total)
    plan.memory_recompute = max(stages, key=lambda s: s.total_recompute)
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
    plain, recompute = plan.memory, plan.memory_recompute
    assert plain is not None and recompute is not None
    lines += [
        "per-GPU memory estimate, GiB (fp32 weights and grads, AdamW fp32 moments), heaviest pipeline stage:",
        f"  {'':12} {f'no recompute (stage {plain.stage})':>28} {f'full recompute (stage {recompute.stage})':>30}",
        f"  {'params held':12} {_count(plain.params):>28} {_count(recompute.params):>30}",
    ]
    for label, first, second in (
        ("weights", plain.weights, recompute.weights),
        ("grads", plain.grads, recompute.grads),
        ("optimizer", plain.optimizer, recompute.optimizer),
        ("activations", plain.activations, recompute.activations_recompute),
        ("total", plain.total, recompute.total_recompute),
    ):
        lines.append(f"  {label:12} {first / GIB:28.1f} {second / GIB:30.1f}")
    return "\n".join(lines)
