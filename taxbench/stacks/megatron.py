"""Megatron-Core as a training stack: its GPTModel (dense or with its MoE layers), forward-backward schedules, DDP,
gradient norm and determinism switch; CUDA only (without CUDA a megatron recipe is refused in one line before
anything is built; its model on the meta device, for the checks before launch, needs no GPU).

The recipe's model fields (n_layers, d_model, n_heads, d_ff, vocab_size, seq_len; n_experts, top_k, moe_d_ff,
n_shared_experts, aux_loss_coef) become a Megatron TransformerConfig; `recipe.model.stack` picks the layer spec
(`spec`: local, or transformer_engine where Transformer Engine is installed), the position embedding, sequence
parallelism and, for MoE, the token dispatcher (allgather or alltoall), grouped GEMM (Transformer Engine's) or
sequential local experts, and the router's load balancing. What runs is Megatron's own: GPTModel (its tensor-parallel
layers, its router, dispatcher and experts, vocab-parallel cross entropy), `get_forward_backward_func`'s schedule over
the harness's micro-batches (no pipeline, 1F1B, or interleaved 1F1B over recipe.parallel.virtual_stages), one
DistributedDataParallel per model chunk (fp32 gradient buffers, experts reduced over the expert-data-parallel group,
all reduced by `finalize_model_grads` at the end of the schedule), its recompute (recipe.activation_checkpointing) and
its model-parallel gradient norm and clipping. What stays the harness's: the data (the same tokens as every stack), the
timer marks, AdamW over fp32 parameters (as Megatron's FP32Optimizer, the gradients are the DDP buffers'), bf16 as
autocast (Megatron's `enable_autocast`), the initial weights (drawn per global parameter name and expert id:
taxbench.stacks.megatron_chunks, so every tp/pp/ep layout starts from the same model), fingerprints and DCP checkpoints
of the unsplit model (tensor-parallel weights saved as DTensors over the tensor-parallel mesh).

Process groups: each arm's model gets its own (a ProcessGroupCollection over the harness's per-arm DeviceMesh, whose
rank order is Megatron's, so its NCCL_ALGO is the arm's). Megatron also reads some groups from its global
parallel_state (the global memory buffer, the vocab-parallel cross entropy's rank): parallel_state is initialised
once per process, with the same rank order, under the first arm built.

The deterministic arm turns on Megatron's `deterministic_mode` (TransformerConfig) and its environment
(NCCL_ALGO=Ring, NVTE_ALLOW_NONDETERMINISTIC_ALGO=0, CUBLAS_WORKSPACE_CONFIG), which must agree with taxbench's
policy; like Megatron's `--deterministic-mode`, it refuses cross-entropy loss fusion (not deterministic). Its MoE
unpermute takes Megatron's index_add path when torch's deterministic algorithms are on (the arm's policy).
With recipe.model.stack.use_distributed_optimizer=true (CUDA only; refused in one line elsewhere) Megatron also owns
the optimizer step, its state and its checkpoint: its DistributedOptimizer, bf16 parameters with
recipe.model.stack.params_dtype=bf16 (taxbench.stacks.megatron_optimizer).
Not driven here (refused in one line): FSDP, context parallelism, its dist_checkpointing (the distributed optimizer
saves in Megatron's legacy torch format), pipeline schedules other than 1F1B and interleaved 1F1B, fp8.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from taxbench.config import policy
from taxbench.config.schema import (
    ActivationCheckpointing,
    ConfigError,
    DataParallel,
    ParallelConfig,
    PolicyConfig,
    Precision,
    RecipeConfig,
)
from taxbench.parallel.distributed import DistContext
from taxbench.parallel.layout import Layout, Meshes, ParallelModel, layout_for, meshes_for
from taxbench.runtime import determinism
from taxbench.stacks import megatron_chunks, megatron_optimizer
from taxbench.stacks.megatron_optimizer import DistributedOptimizerStep
from taxbench.stacks.native import build_optimizer
from taxbench.stacks.protocol import RankModel, refuse_conflicts, refuse_unknown_options
from taxbench.stacks.step import Batch

SUPPORTED_VERSIONS = "0.16.1 (Python 3.11) or 0.19.x (Python 3.12)"
INSTALL_HINT = "pip install 'taxbench[megatron]'"
# Megatron's --deterministic-mode environment (megatron/training/arguments.py and its NCCL note).
SWITCH_ENV = {"NCCL_ALGO": "Ring", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
# Megatron's --deterministic-mode as policy fields (a stack-native arm): torch.use_deterministic_algorithms(True), with
# torch's default fill of uninitialized memory that comes with it, and the environment Megatron requires beside it
# (SWITCH_ENV). TF32 and cuDNN's autotuner are left as the process has them: TF32 as torch's defaults (allow_tf32=None),
# the autotuner off, torch's default (Megatron-Core does not turn it on).
SWITCH_FIELDS = {"deterministic": True, "cudnn_benchmark": False, "allow_tf32": None,
                 "cublas_workspace_config": SWITCH_ENV["CUBLAS_WORKSPACE_CONFIG"], "nccl_algo": SWITCH_ENV["NCCL_ALGO"],
                 "nvte_allow_nondeterministic_algo": False, "fill_uninitialized_memory": True,
                 "deterministic_kernels": False}
SPECS = ("local", "transformer_engine")
PARAMS_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
POSITION_EMBEDDINGS = ("rope", "learned_absolute")
DISPATCHERS = ("allgather", "alltoall")
LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "none")
# Megatron's pipeline schedules (get_forward_backward_func): 1F1B, and 1F1B over virtual stages (interleaved).
SCHEDULES = {"1f1b": "1F1B", "interleaved1f1b": "Interleaved1F1B"}


@dataclass(frozen=True)
class MegatronOptions:
    spec: str = "local"
    position_embedding_type: str = "rope"
    sequence_parallel: bool = False
    cross_entropy_loss_fusion: bool = False
    # MoE (recipe.model.n_experts > 0): Megatron's token dispatcher, grouped or sequential local experts, the router's
    # load balancing (its loss weighted by recipe.model.aux_loss_coef)
    moe_token_dispatcher_type: str = "allgather"
    moe_grouped_gemm: bool = False
    moe_router_load_balancing_type: str = "aux_loss"
    # Megatron's distributed optimizer (DistributedOptimizer: fp32 main parameters and AdamW's moments sharded over
    # each parameter's data-parallel group; CUDA only) and the model's parameter dtype (bf16: Megatron's Float16Module,
    # with the optimizer's fp32 main copy; needs recipe.precision=bf16).
    use_distributed_optimizer: bool = False
    params_dtype: str = "fp32"

    @classmethod
    def of(cls, recipe: RecipeConfig) -> MegatronOptions:
        refuse_unknown_options("Megatron-Core", cls, recipe.model.stack)
        options = cls(**recipe.model.stack)
        if options.spec not in SPECS:
            raise ConfigError(f"recipe.model.stack.spec={options.spec!r}: choose one of {list(SPECS)}")
        if options.position_embedding_type not in POSITION_EMBEDDINGS:
            raise ConfigError(f"recipe.model.stack.position_embedding_type={options.position_embedding_type!r}: "
                              f"choose one of {list(POSITION_EMBEDDINGS)}")
        if options.sequence_parallel and recipe.parallel.tp == 1:
            raise ConfigError("recipe.model.stack.sequence_parallel=true needs recipe.parallel.tp > 1")
        if options.moe_token_dispatcher_type not in DISPATCHERS:
            raise ConfigError(f"recipe.model.stack.moe_token_dispatcher_type={options.moe_token_dispatcher_type!r}: "
                              f"choose one of {list(DISPATCHERS)}")
        if options.moe_router_load_balancing_type not in LOAD_BALANCING:
            raise ConfigError(f"recipe.model.stack.moe_router_load_balancing_type="
                              f"{options.moe_router_load_balancing_type!r}: choose one of {list(LOAD_BALANCING)}")
        if options.moe_grouped_gemm and options.spec != "transformer_engine":
            raise ConfigError("recipe.model.stack.moe_grouped_gemm=true needs recipe.model.stack.spec="
                              "transformer_engine (Transformer Engine's grouped GEMM; the local spec runs Megatron's "
                              "SequentialMLP)")
        if options.params_dtype not in PARAMS_DTYPES:
            raise ConfigError(f"recipe.model.stack.params_dtype={options.params_dtype!r}: choose one of "
                              f"{list(PARAMS_DTYPES)}")
        if options.params_dtype == "bf16" and str(recipe.precision) != Precision.bf16.value:
            raise ConfigError(f"recipe.model.stack.params_dtype=bf16 needs recipe.precision=bf16, not "
                              f"{recipe.precision}; set one of them")
        if options.params_dtype == "bf16" and not options.use_distributed_optimizer:
            raise ConfigError("recipe.model.stack.params_dtype=bf16 keeps the fp32 main parameters in Megatron's "
                              "optimizer, which this adapter drives as its distributed optimizer only; add "
                              "recipe.model.stack.use_distributed_optimizer=true")
        return options


def require_layout(recipe: RecipeConfig) -> None:
    """Refuse, in one line, what this adapter does not drive (see the module docstring)."""
    par, model = recipe.parallel, recipe.model
    if par.pp > 1 and par.pp_schedule.lower() not in SCHEDULES:
        raise ConfigError(f"recipe.parallel.pp_schedule={par.pp_schedule} is not one of Megatron's schedules; choose "
                          f"one of {list(SCHEDULES.values())} (Interleaved1F1B with recipe.parallel.virtual_stages>=2)")
    if par.ep > 1 and model.n_experts == 0:
        raise ConfigError(f"recipe.parallel.ep={par.ep} needs MoE layers: set recipe.model.n_experts (and top_k)")
    if model.n_experts and model.n_experts % par.ep:
        raise ConfigError(f"recipe.parallel.ep={par.ep} must divide recipe.model.n_experts={model.n_experts}")
    if par.data_parallel is DataParallel.fsdp or str(par.data_parallel) == DataParallel.fsdp.value:
        raise ConfigError("recipe.model.kind=megatron uses Megatron's DistributedDataParallel; set "
                          "recipe.parallel.data_parallel=ddp")
    if str(recipe.precision) not in (Precision.fp32.value, Precision.bf16.value):
        raise ConfigError(f"recipe.precision={recipe.precision} is not wired to Megatron-Core's stack; use fp32 or "
                          "bf16 with recipe.model.kind=megatron")
    if recipe.model.n_heads <= 0 or recipe.model.d_model % recipe.model.n_heads:
        raise ConfigError(f"recipe.model.d_model={recipe.model.d_model} must be a multiple of recipe.model.n_heads="
                          f"{recipe.model.n_heads}")
    if recipe.model.n_heads % par.tp or recipe.model.vocab_size % par.tp:
        raise ConfigError(f"recipe.parallel.tp={par.tp} must divide recipe.model.n_heads={recipe.model.n_heads} and "
                          f"recipe.model.vocab_size={recipe.model.vocab_size} (Megatron splits heads and vocabulary)")


def require_megatron(cuda: bool = True) -> None:
    """Refuse in one line: Megatron-Core needs the package from the extra and, to train (`cuda`), CUDA. Its model on
    the meta device needs no GPU (a Slurm job is checked on the submitting machine)."""
    if cuda and not torch.cuda.is_available():
        raise ConfigError(f"recipe.model.kind=megatron needs a CUDA GPU (Megatron-Core's schedule, gradient buffers "
                          f"and norms are CUDA only; torch {torch.__version__} sees none); on a GPU node: "
                          f"{INSTALL_HINT}")
    try:
        import megatron.core  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"recipe.model.kind=megatron needs megatron-core {SUPPORTED_VERSIONS}: {INSTALL_HINT} "
                          f"({exc})") from None


def _version() -> str:
    try:
        return version("megatron-core")
    except PackageNotFoundError:
        return "not installed"


def transformer_config(recipe: RecipeConfig, options: MegatronOptions, deterministic: bool, on_device: bool) -> Any:
    """Megatron's TransformerConfig for the recipe: fp32 parameters with bf16 as autocast, or with
    recipe.model.stack.params_dtype=bf16 Megatron's bf16 model (built in fp32 and cast by its Float16Module, as
    get_model wraps it, so that its initial weights are the fp32 ones rounded), no dropout (as the harness's models),
    recipe.activation_checkpointing as Megatron's recompute, deterministic_mode for the deterministic arm.
    `on_device=False`: built on the host or the meta device (use_cpu_initialization; no CUDA RNG tracker)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    model, tp = recipe.model, recipe.parallel.tp
    bf16 = str(recipe.precision) == Precision.bf16.value
    bf16_params = options.params_dtype == "bf16"
    return TransformerConfig(**_recompute(recipe.activation_checkpointing), **_moe(recipe, options),
        **_pipeline(recipe.parallel),
        num_layers=model.n_layers, hidden_size=model.d_model, num_attention_heads=model.n_heads,
        ffn_hidden_size=model.d_ff, tensor_model_parallel_size=tp, sequence_parallel=options.sequence_parallel,
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32, bf16=bf16_params,
        pipeline_dtype=torch.bfloat16 if bf16_params else torch.float32,
        enable_autocast=bf16 and not bf16_params, autocast_dtype=torch.bfloat16 if bf16 and not bf16_params else None,
        deterministic_mode=deterministic, cross_entropy_loss_fusion=options.cross_entropy_loss_fusion,
        gradient_accumulation_fusion=False, use_cpu_initialization=not on_device, init_method_std=0.02,
    )


def _moe(recipe: RecipeConfig, options: MegatronOptions) -> dict[str, Any]:
    """The recipe's MoE fields as Megatron's: top-k routing with its load-balancing loss, local experts of width
    moe_d_ff (GELU, no biases, as Megatron's MoE recipes), shared experts, expert parallelism over recipe.parallel.ep.
    The deterministic arm's unpermute is Megatron's index_add path (taken when torch's deterministic algorithms are
    on, which the arm's policy switches)."""
    model = recipe.model
    if not model.n_experts:
        return {}
    width = model.moe_d_ff or model.d_ff
    return {"num_moe_experts": model.n_experts, "moe_router_topk": model.top_k, "moe_ffn_hidden_size": width,
            "moe_aux_loss_coeff": model.aux_loss_coef, "moe_router_load_balancing_type":
            options.moe_router_load_balancing_type, "moe_token_dispatcher_type": options.moe_token_dispatcher_type,
            "moe_grouped_gemm": options.moe_grouped_gemm, "expert_model_parallel_size": recipe.parallel.ep,
            "moe_shared_expert_intermediate_size": width * model.n_shared_experts or None,
            "add_bias_linear": False}


def _pipeline(par: ParallelConfig) -> dict[str, Any]:
    """Megatron's pipeline fields: pp stages, and virtual stages per rank for its interleaved schedule."""
    if par.pp == 1:
        return {}
    virtual = par.virtual_stages if par.pp_schedule.lower() == "interleaved1f1b" else 1
    return {"pipeline_model_parallel_size": par.pp,
            "virtual_pipeline_model_parallel_size": virtual if virtual > 1 else None}


def _recompute(mode: ActivationCheckpointing) -> dict[str, Any]:
    """recipe.activation_checkpointing as Megatron's recompute settings (selective: its default, core attention)."""
    if str(mode) == ActivationCheckpointing.full.value:
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    if str(mode) == ActivationCheckpointing.selective.value:
        return {"recompute_granularity": "selective"}
    return {}


def _layer_spec(options: MegatronOptions, n_experts: int) -> Any:
    from megatron.core.models.gpt import gpt_layer_specs

    moe = {"num_experts": n_experts or None, "moe_grouped_gemm": options.moe_grouped_gemm}
    if options.spec == "local":
        return gpt_layer_specs.get_gpt_layer_local_spec(**moe)
    try:
        import transformer_engine  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"recipe.model.stack.spec=transformer_engine needs Transformer Engine ({exc}); install "
                          "it or use recipe.model.stack.spec=local") from None
    return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(**moe)


def process_groups(meshes: Meshes, distributed_optimizer: bool = False) -> Any:
    """Megatron's ProcessGroupCollection over one arm's DeviceMesh ([pp,] edp, ep, tp), whose rank order is Megatron's
    (tp innermost, ep carved out of data parallel, pp outermost): a group over several dimensions is the mesh's
    flattened sub-mesh; context parallelism (not driven) and the embedding groups get a one-rank group; with
    `distributed_optimizer`, its one instance spans the arm's world (the group of its gradient norm). Call under the
    arm's environment."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    full = meshes.full
    present = tuple(full.mesh_dim_names or ())

    def over(*dims: str) -> dist.ProcessGroup:
        held = [dim for dim in dims if dim in present]
        if len(held) == 1:
            return full[held[0]].get_group()
        return full[tuple(held)]._flatten("_".join(held)).get_group()  # the same sub-mesh again on a second build

    tp, edp, dp, alone = over("tp"), over("edp"), meshes.dp.get_group(), _alone(full)
    # The embedding groups only reduce embeddings shared across stages (tied input and output embeddings, which
    # build_gpt does not make): one rank each. None would make finalize_model_grads fall back to parallel_state's.
    groups = ProcessGroupCollection()
    for name, group in {"tp": tp, "tp_cp": tp, "expt_tp": tp, "pp": over("pp") if "pp" in present else alone,
                        "ep": over("ep"), "mp": over("pp", "tp"), "tp_ep": over("ep", "tp"),
                        "tp_ep_pp": over("pp", "ep", "tp"), "dp": dp, "dp_cp": dp, "intra_dp_cp": dp,
                        "expt_dp": edp, "intra_expt_dp": edp, "tp_dp_cp": over("edp", "ep", "tp"),
                        "cp": alone, "embd": alone, "pos_embd": alone,
                        "intra_dist_opt": over(*present) if distributed_optimizer else None}.items():
        setattr(groups, name, group)
    return groups


def _alone(full: Any) -> dist.ProcessGroup:
    """A one-rank group: a size-1 dimension of the mesh where there is one, else one of torch's one-rank subgroups."""
    for dim in full.mesh_dim_names or ():
        if full[dim].size() == 1:
            return full[dim].get_group()
    group, _ = dist.new_subgroups(group_size=1)
    return group


def ensure_parallel_state(par: ParallelConfig) -> None:
    """Megatron's global parallel_state, for what its code still reads from there (see the module docstring)."""
    from megatron.core import parallel_state

    sizes = {"tp": par.tp, "pp": par.pp, "ep": par.ep}
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=par.tp,
                                                 pipeline_model_parallel_size=par.pp,
                                                 virtual_pipeline_model_parallel_size=_virtual_stages(par),
                                                 expert_model_parallel_size=par.ep)
        return
    held = {"tp": parallel_state.get_tensor_model_parallel_world_size(),
            "pp": parallel_state.get_pipeline_model_parallel_world_size(),
            "ep": parallel_state.get_expert_model_parallel_world_size()}
    if held != sizes:
        raise ConfigError(f"Megatron-Core's parallel_state is set up for {held} in this process; one process trains "
                          f"one layout (recipe.parallel: {sizes})")


def _virtual_stages(par: ParallelConfig) -> int | None:
    return _pipeline(par).get("virtual_pipeline_model_parallel_size")


def build_gpt(recipe: RecipeConfig, options: MegatronOptions, config: Any, groups: Any, first: bool = True,
              last: bool = True, vp_stage: int | None = None) -> nn.Module:
    """Megatron's GPTModel for the recipe, or one pipeline chunk of it (on the current default device; fp32
    parameters): `first` holds the embeddings, `last` the final norm and the output layer."""
    from megatron.core.models.gpt import GPTModel

    model = recipe.model
    return GPTModel(config=config, transformer_layer_spec=_layer_spec(options, model.n_experts),
                    vocab_size=model.vocab_size, max_sequence_length=model.seq_len,
                    position_embedding_type=options.position_embedding_type, pre_process=first, post_process=last,
                    share_embeddings_and_output_weights=False, pg_collection=groups, vp_stage=vp_stage)


def rank_chunks(recipe: RecipeConfig, options: MegatronOptions, config: Any, groups: Any, layout: Layout,
                device: torch.device) -> list[nn.Module]:
    """This rank's model chunks, as Megatron's get_model builds them (one per virtual pipeline stage, in order; its
    layers and experts only), moved to `device` and filled by global name (taxbench.stacks.megatron_chunks)."""
    virtual = config.virtual_pipeline_model_parallel_size or 1
    pp, pp_rank = layout.pp, layout.pp_rank
    chunks = [build_gpt(recipe, options, config, groups, first=pp_rank == 0 and v == 0,
                        last=pp_rank == pp - 1 and v == virtual - 1, vp_stage=v if virtual > 1 else None)
              for v in range(virtual)]
    # As Megatron's get_model: its parallel layers allocate on the GPU, torch's norms on the host.
    chunks = [chunk.to(device) for chunk in chunks]
    megatron_chunks.initialize(chunks, recipe.seed, layout.tp, layout.tp_rank)
    return chunks


def gpt_forward(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """GPTModel's per-token loss [batch, seq] (its vocab-parallel cross entropy, fp32) on the last pipeline stage, its
    hidden states on the others; causal attention, no mask."""
    positions = torch.arange(inputs.shape[1], device=inputs.device).expand_as(inputs)
    return model(inputs, positions, None, labels=targets)


def mean_token_loss(per_token: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss function Megatron's schedule calls: the micro-batch's mean token loss, and a copy for the record (the
    schedule divides the loss it backpropagates by the number of micro-batches in place)."""
    loss = per_token.float().mean()
    return loss, {"loss": loss.detach().clone()}


def meta_gpt(recipe: RecipeConfig) -> nn.Module:
    """The whole GPTModel (every layer and expert) on the meta device, built before launch in a one-rank world (its
    module paths are the unsplit model's, whatever the recipe's pp and ep)."""
    options = MegatronOptions.of(recipe)
    require_layout(recipe)
    whole = replace(recipe, parallel=replace(recipe.parallel, pp=1, ep=1, virtual_stages=1))
    # The alltoall dispatcher creates CUDA streams when built; dispatchers hold no parameters, so the module paths
    # are those of the allgather one.
    options = replace(options, moe_token_dispatcher_type="allgather")
    config = transformer_config(whole, options, deterministic=False, on_device=False)
    config.perform_initialization = False
    with _one_rank_world() as groups, torch.device("meta"):
        return build_gpt(whole, options, config, groups)


class MegatronStep:
    """Megatron's forward-backward schedule over the harness's micro-batches: without pipeline parallelism its plain
    loop, with it 1F1B or, over virtual stages, its interleaved 1F1B (stage-to-stage sends by its P2PCommunicator on
    the arm's pipeline group). Gradients land in DDP's buffers, reduced by finalize_model_grads at the schedule's end.
    The loss exists on the last stage; the recorded loss is summed over the pipeline group so that every rank records
    the same bits (the cross entropy: Megatron applies the MoE load-balancing loss in the backward only)."""

    def __init__(self, ddps: list[nn.Module], recipe: RecipeConfig, config: Any, groups: Any) -> None:
        self.ddps, self.groups = ddps, groups
        self.seq_len, self.micro_batch = recipe.model.seq_len, recipe.micro_batch_size
        self.pp, self.virtual = recipe.parallel.pp, config.virtual_pipeline_model_parallel_size
        self.p2p: Any = None
        if self.pp > 1:
            from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

            self.p2p = P2PCommunicator(pp_group=groups.pp, config=config)

    def _forward_step(self, data: Iterator[Batch], model: nn.Module) -> tuple[torch.Tensor, Any]:
        inputs, targets = next(data)
        return gpt_forward(model, inputs, targets), mean_token_loss

    def run(self, batches: list[Batch]) -> torch.Tensor:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        for ddp in self.ddps:
            ddp.zero_grad_buffer()
        forward_backward = get_forward_backward_func(pp_size=self.pp, vp_size=self.virtual)
        # Every chunk reads the micro-batches in order (the interleaved schedule takes one iterator per chunk).
        data: Any = [iter(batches) for _ in self.ddps] if len(self.ddps) > 1 else iter(batches)
        pipeline = {"p2p_communicator": self.p2p} if self.p2p is not None else {}
        records = forward_backward(forward_step_func=self._forward_step, data_iterator=data, model=self.ddps,
                                   num_microbatches=len(batches), seq_length=self.seq_len,
                                   micro_batch_size=self.micro_batch, forward_only=False, pg_collection=self.groups,
                                   **pipeline)
        device = next(self.ddps[0].parameters()).device
        total = torch.zeros((), device=device)
        for record in records:  # the last stage's, in micro-batch order
            total = total + record["loss"].float()
        if self.pp > 1:
            dist.all_reduce(total, group=self.groups.pp)
        return total / len(batches)  # this rank's mean token loss, as the harness's


class MegatronParallel(ParallelModel):
    """The rank's GPTModel chunks in Megatron's DDP, as the trainer drives them: one part, the chunks under the unsplit
    model's names (megatron_chunks.unsplit_view: what fingerprints, the optimizer's state keys and checkpoints read);
    gradients come from DDP's buffers; the norm and the clipping are Megatron's (tensor-parallel shards counted once;
    dense parameters over the model-parallel group, experts over tensor x expert x pipeline, as its chained optimizer
    counts them), and the tensor-parallel weights are checkpointed as DTensors over the arm's tensor-parallel mesh.
    Gradient sync across micro-batches is the schedule's (config.no_sync_func)."""

    def __init__(self, chunks: list[nn.Module], ddps: list[nn.Module], layout: Layout, meshes: Meshes,
                 groups: Any) -> None:
        view = megatron_chunks.unsplit_view(chunks)
        super().__init__([view], ddps, layout, meshes, groups.tp_dp_cp, [])
        self.groups = groups
        self._tp_mesh = meshes.full["tp"]
        self._sliced = {name: p for name, p in view.named_parameters() if getattr(p, "tensor_model_parallel", False)}
        self._experts = any(not getattr(p, "allreduce", True) for p in view.parameters())

    def finish_gradients(self) -> None:
        """DDP's reduced fp32 buffers become the parameters' gradients (as Megatron's FP32Optimizer does)."""
        for param in self.parts.parameters():
            if param.requires_grad:
                param.grad = param.main_grad

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32, get_grad_norm_fp32
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        params = [p for p in self.parts.parameters() if p.grad is not None]
        counted = [p for p in params if param_is_not_tensor_parallel_duplicate(p, tp_group=self.groups.tp)]
        norm = get_grad_norm_fp32([p.grad for p in counted if getattr(p, "allreduce", True)],
                                  grad_stats_parallel_group=self.groups.mp)
        if self._experts:
            experts = get_grad_norm_fp32([p.grad for p in counted if not getattr(p, "allreduce", True)],
                                         grad_stats_parallel_group=self.groups.tp_ep_pp)
            norm = (norm**2 + experts**2) ** 0.5
        clip_grad_by_total_norm_fp32(params, max_norm, norm)
        return torch.tensor(norm, dtype=torch.float32, device=params[0].device)

    def sliced_names(self) -> set[str]:
        return set(self._sliced) if self.layout.tp > 1 else set()

    def global_view(self, name: str, local: torch.Tensor) -> DTensor:
        param = self._sliced[name]
        dim = int(param.partition_dim)
        shape = list(local.shape)
        shape[dim] *= self.layout.tp
        return DTensor.from_local(local, self._tp_mesh, (Shard(dim),), run_check=False, shape=torch.Size(shape),
                                  stride=torch.empty(shape, device="meta").stride())


class MegatronStack:
    name = "megatron-core"

    def switch(self, recipe: RecipeConfig, arm_policy: PolicyConfig) -> dict[str, Any]:
        options = MegatronOptions.of(recipe)
        require_layout(recipe)
        on = arm_policy.deterministic
        if on and options.cross_entropy_loss_fusion:
            raise ConfigError("Megatron's deterministic_mode rejects cross-entropy loss fusion (not deterministic); "
                              "set recipe.model.stack.cross_entropy_loss_fusion=false")
        if on:
            _refuse_env_conflicts(arm_policy)
        moe = {"moe_token_dispatcher_type": options.moe_token_dispatcher_type,
               "moe_grouped_gemm": options.moe_grouped_gemm} if recipe.model.n_experts else {}
        return {"stack": self.name, "version": _version(), "deterministic_mode": on, "spec": options.spec,
                "cross_entropy_loss_fusion": options.cross_entropy_loss_fusion,
                "sequence_parallel": options.sequence_parallel, **moe, "env": SWITCH_ENV if on else {}}

    def native_policy(self, recipe: RecipeConfig, name: str) -> PolicyConfig:
        del recipe
        return PolicyConfig(name=name, **SWITCH_FIELDS)

    def meta_model(self, recipe: RecipeConfig) -> nn.Module:
        require_megatron(cuda=False)
        return meta_gpt(recipe)

    def build(self, recipe: RecipeConfig, arm_policy: PolicyConfig, ctx: DistContext, micro_batches: int) -> RankModel:
        del micro_batches  # the harness hands the schedule its micro-batches
        require_megatron()
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        options = MegatronOptions.of(recipe)
        require_layout(recipe)
        layout = layout_for(recipe.parallel, ctx.world_size, ctx.rank)
        meshes = meshes_for(layout, ctx, arm_policy)
        with determinism.active(arm_policy):
            refuse_conflicts(self.name, arm_policy, SWITCH_ENV if arm_policy.deterministic else {})
            with determinism.arm_environment(arm_policy):
                groups = process_groups(meshes, options.use_distributed_optimizer)
                ensure_parallel_state(recipe.parallel)
            model_parallel_cuda_manual_seed(recipe.seed, tp_rank=layout.tp_rank, ep_rank=layout.ep_rank,
                                            etp_rank=layout.tp_rank)
            config = transformer_config(recipe, options, arm_policy.deterministic, on_device=True)
            chunks = rank_chunks(recipe, options, config, groups, layout, ctx.device)
            distributed = options.use_distributed_optimizer
            ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                       use_distributed_optimizer=distributed)
            # As Megatron's get_model: a bf16 model in its Float16Module, one DDP per chunk, bucketing only the first.
            wrapped = [_float16(config, chunk) for chunk in chunks] if config.bf16 else chunks
            ddps = [DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=index > 0,
                                            pg_collection=groups) for index, chunk in enumerate(wrapped)]
            config.no_sync_func = [ddp.no_sync for ddp in ddps] if len(ddps) > 1 else ddps[0].no_sync
            config.finalize_model_grads_func = finalize_model_grads
            step = MegatronStep(ddps, recipe, config, groups)
            engine = _distributed_optimizer(recipe, options, ddps, step, layout, meshes, groups, ctx.device) \
                if distributed else None
        parallel = MegatronParallel(chunks, ddps, layout, meshes, groups)
        return RankModel(parallel, None, [], step, None, engine=engine)

    def optimizer(self, recipe: RecipeConfig, model: RankModel) -> torch.optim.Optimizer:
        if isinstance(model.engine, DistributedOptimizerStep):
            # The torch optimizer over the dense parameters' shards (a tracing capture or the op scan hooks its
            # step); the state of every chained optimizer is the engine's.
            return model.engine.torch_optimizers()[0]
        return build_optimizer(recipe, model.parts.parameters())


def _float16(config: Any, chunk: nn.Module) -> nn.Module:
    from megatron.core.transformer.module import Float16Module

    return Float16Module(config, chunk)


def _distributed_optimizer(recipe: RecipeConfig, options: MegatronOptions, ddps: list[nn.Module], step: MegatronStep,
                           layout: Layout, meshes: Meshes, groups: Any,
                           device: torch.device) -> DistributedOptimizerStep:
    """Megatron's DistributedOptimizer over the DDP chunks (chained: dense over dp, experts over edp), with gloo groups
    over the same ranks for its checkpoint's gathers (Megatron makes those itself only from its global
    parallel_state, not for the arm's process groups)."""
    from megatron.core.optimizer import get_megatron_optimizer

    megatron_optimizer.require_cuda(device)
    config = megatron_optimizer.optimizer_config(recipe, PARAMS_DTYPES[options.params_dtype])
    optimizer = get_megatron_optimizer(config, ddps, use_gloo_process_groups=False, pg_collection=groups)
    megatron_optimizer.attach_gloo_groups(optimizer, meshes.full)
    return DistributedOptimizerStep(step, ddps, optimizer, layout, groups, device)


def _refuse_env_conflicts(arm_policy: PolicyConfig) -> None:
    """Megatron's --deterministic-mode environment against the deterministic arm's policy (before launch): taxbench's
    policy sets the environment, so it must set what Megatron's mode needs (unset is refused too)."""
    ours = policy.policy_env(arm_policy)
    for name, theirs in SWITCH_ENV.items():
        if ours.get(name) != theirs:
            raise ConfigError(f"Megatron's deterministic_mode sets {name}={theirs} but the {arm_policy.name} arm's "
                              f"taxbench policy has {ours.get(name)}; make the two agree (arms.{arm_policy.name})")


@contextmanager
def _one_rank_world() -> Iterator[Any]:
    """Process groups of a one-rank world (torch's fake process group, gone after) for `meta_gpt`."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from torch.testing._internal.distributed.fake_pg import FakeStore

    own = not dist.is_initialized()
    if own:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    elif dist.get_world_size() > 1:
        raise RuntimeError("the Megatron-Core model on the meta device is built before launch, in one process")
    try:
        alone = dist.group.WORLD
        groups = ProcessGroupCollection()
        for name in ("tp", "mp", "tp_cp", "tp_ep", "tp_ep_pp", "expt_tp", "dp", "dp_cp", "intra_dp_cp", "expt_dp",
                     "intra_expt_dp", "tp_dp_cp", "pp", "cp", "ep"):
            setattr(groups, name, alone)
        groups.embd = groups.pos_embd = None
        yield groups
    finally:
        if own:
            dist.destroy_process_group()
