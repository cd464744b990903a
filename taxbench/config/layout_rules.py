"""Whether a recipe's parallel layout runs on a world of ranks: every reason it cannot, each naming the key and the fix.

The rules beside the arithmetic they apply (taxbench.config.shape.ParallelShape): the schema's `validate`, the plan,
preflight, `taxbench layouts` and the torchrun launcher all ask here. Like the shape, this reads the recipe through
the protocols below (the model and pipeline kinds by their config values), so that the schema can call it without an
import cycle. Torch-free.
"""

from __future__ import annotations

from typing import Protocol

from taxbench.config.shape import ParallelDegrees, ParallelShape

ZERO_BUBBLE_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble")  # weight gradients in a separate pass
# torch.distributed.pipelining schedules -> stages per rank: one ("single"), virtual_stages >= 2 in a loop ("looped"),
# or two in a V ("v")
PIPELINE_SCHEDULES = {
    "1F1B": "single",
    "GPipe": "single",
    "Interleaved1F1B": "looped",
    "InterleavedZeroBubble": "looped",
    "ZBVZeroBubble": "v",
}


# recipe.model.kind values whose models hold experts (taxbench.config.schema.ModelKind)
EXPERT_MODEL_KINDS = ("moe", "megatron", "deepspeed")


class ParallelFields(ParallelDegrees, Protocol):
    """What the rules read of recipe.parallel (taxbench.config.schema.ParallelConfig)."""

    data_parallel: str
    pp_schedule: str
    virtual_stages: int


class ModelFields(Protocol):
    """What the rules read of recipe.model (taxbench.config.schema.ModelConfig)."""

    kind: str
    n_layers: int
    n_heads: int
    d_ff: int
    n_experts: int
    top_k: int
    moe_d_ff: int
    n_shared_experts: int


class RecipeFields(Protocol):
    """What the rules read of a recipe (taxbench.config.schema.RecipeConfig)."""

    @property
    def parallel(self) -> ParallelFields: ...

    @property
    def model(self) -> ModelFields: ...

    global_batch_size: int
    micro_batch_size: int


def layout_problems(recipe: RecipeFields, world: int, world_key: str = "cluster.gpus") -> list[str]:
    """Every reason the recipe's parallel layout cannot run on `world` ranks, set by `world_key` (empty when it can).

    world = tp * pp * dp, and the expert-parallel group is carved out of data parallel (ep divides dp), as in Megatron.
    """
    par, model = recipe.parallel, recipe.model
    problems = [f"recipe.parallel.{k}={v} must be >= 1" for k, v in (("tp", par.tp), ("pp", par.pp), ("ep", par.ep))
                if v < 1]
    if problems:
        return problems
    shape = ParallelShape.of(par, world)
    model_parallel, dp = shape.model_parallel, shape.dp
    if not shape.fits_world:
        problems.append(
            f"world size {world} is not divisible by tp*pp = {par.tp}*{par.pp} = {model_parallel}; change {world_key} "
            "or the recipe's parallel layout"
        )
    elif dp % par.ep:
        problems.append(
            f"data-parallel size dp = world/(tp*pp) = {world}/{model_parallel} = {dp} is not divisible by "
            f"recipe.parallel.ep={par.ep} (expert parallelism is carved out of data parallelism); pick ep dividing {dp}"
        )
    if par.ep > 1 and model.kind not in EXPERT_MODEL_KINDS:
        problems.append(f"recipe.parallel.ep={par.ep} needs an MoE model, but recipe.model.kind={model.kind}; set "
                        "recipe.parallel.ep=1 (or recipe.model.kind=moe)")
    elif par.ep > 1 and (model.n_experts == 0 or model.n_experts % par.ep):
        problems.append(
            f"recipe.model.n_experts={model.n_experts} is not divisible by recipe.parallel.ep={par.ep}"
            + ("; expert parallelism needs an MoE model (recipe.model.kind=moe)" if model.n_experts == 0 else "")
        )
    if model.n_experts and not 1 <= model.top_k <= model.n_experts:
        problems.append(f"recipe.model.top_k={model.top_k} must be in [1, n_experts={model.n_experts}]")
    if model.kind != "custom":
        for key, value in (("n_heads", model.n_heads), ("d_ff", model.d_ff)):
            if value % par.tp:
                problems.append(f"recipe.model.{key}={value} is not divisible by recipe.parallel.tp={par.tp}")
        if model.n_shared_experts and (model.moe_d_ff or model.d_ff) * model.n_shared_experts % par.tp:
            problems.append(f"the shared-expert width is not divisible by recipe.parallel.tp={par.tp}")
    micro_batches = shape.micro_batches(recipe.global_batch_size, recipe.micro_batch_size)
    if dp and shape.fits_world and micro_batches is None:
        problems.append(
            f"recipe.global_batch_size={recipe.global_batch_size} is not divisible by micro_batch_size*dp = "
            f"{recipe.micro_batch_size}*{dp}; pick a global batch that is a multiple of {recipe.micro_batch_size * dp}"
        )
    return problems + pipeline_problems(recipe, micro_batches)


def schedule_kind(name: str) -> str | None:
    """How many stages per rank a pipeline schedule runs (see PIPELINE_SCHEDULES); None for an unknown name."""
    return next((kind for known, kind in PIPELINE_SCHEDULES.items() if known.lower() == name.lower()), None)


def pipeline_problems(recipe: RecipeFields, micro_batches: int | None) -> list[str]:
    """Every reason the recipe's pipeline cannot run (none when pp == 1); `micro_batches` per step and data-parallel
    rank, when known."""
    par, model = recipe.parallel, recipe.model
    if par.pp == 1:
        return []
    kind = schedule_kind(par.pp_schedule)
    if kind is None:
        return [f"recipe.parallel.pp_schedule={par.pp_schedule!r} is unknown; choose one of "
                f"{list(PIPELINE_SCHEDULES)}"]
    problems = []
    if model.kind == "custom":
        problems.append("recipe.parallel.pp>1 splits taxbench's GPT blocks into stages; a custom model "
                        "(recipe.model.kind=custom) runs with recipe.parallel.pp=1")
    virtual = par.virtual_stages
    if kind == "single" and virtual != 1:
        problems.append(f"recipe.parallel.pp_schedule={par.pp_schedule} runs one stage per rank; set "
                        "recipe.parallel.virtual_stages=1 or pick Interleaved1F1B, InterleavedZeroBubble or "
                        "ZBVZeroBubble")
    if kind == "looped" and virtual < 2:
        problems.append(f"recipe.parallel.pp_schedule={par.pp_schedule} needs recipe.parallel.virtual_stages>=2")
    if kind == "v" and virtual != 2:
        problems.append(f"recipe.parallel.pp_schedule={par.pp_schedule} needs recipe.parallel.virtual_stages=2")
    if par.pp_schedule in ZERO_BUBBLE_SCHEDULES and par.data_parallel == "fsdp":
        # Found by restart replay on the moe_1t proxy: after 6 steps no parameter of the last stage had optimizer
        # state (the split weight-gradient pass never reached FSDP2's sharded parameters); with DDP all are trained.
        problems.append(f"recipe.parallel.pp_schedule={par.pp_schedule} with recipe.parallel.data_parallel=fsdp "
                        "leaves the last stage untrained here (no gradient reaches its FSDP2 parameters); use "
                        "1F1B, GPipe or Interleaved1F1B, or data_parallel=ddp")
    stages = par.pp * max(virtual, 1)
    if model.n_layers % stages:
        problems.append(f"recipe.model.n_layers={model.n_layers} is not divisible by pp * virtual_stages = "
                        f"{par.pp}*{virtual} = {stages} (blocks per stage)")
    if micro_batches is not None:
        if micro_batches < par.pp:
            problems.append(f"{micro_batches} micro-batches per step cannot fill {par.pp} pipeline stages; raise "
                            "recipe.global_batch_size or lower recipe.micro_batch_size")
        elif kind != "single" and micro_batches % par.pp:
            problems.append(f"{par.pp_schedule} needs the micro-batches per step ({micro_batches}) to be a multiple "
                            f"of recipe.parallel.pp={par.pp}")
    return problems
