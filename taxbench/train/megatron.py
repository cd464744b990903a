"""Megatron-Core as a training stack: its GPTModel, forward-backward schedule, DDP, gradient norm and determinism
switch; CUDA only (without CUDA a megatron recipe is refused in one line before anything is built).

The recipe's model fields (n_layers, d_model, n_heads, d_ff, vocab_size, seq_len) become a Megatron TransformerConfig;
`recipe.model.stack` picks the layer spec (`spec`: local, or transformer_engine where Transformer Engine is installed),
the position embedding and sequence parallelism. What runs is Megatron's own: GPTModel (its tensor-parallel layers,
vocab-parallel cross entropy), `get_forward_backward_func`'s schedule over the harness's micro-batches, its
DistributedDataParallel (fp32 gradient buffers, reduced by `finalize_model_grads` at the end of the schedule) and its
model-parallel gradient norm and clipping. What stays the harness's: the data (the same tokens as every stack), the
timer marks, AdamW over fp32 parameters (as Megatron's FP32Optimizer, the gradients are the DDP buffers'), bf16 as
autocast (Megatron's `enable_autocast`), fingerprints and DCP checkpoints (tensor-parallel weights saved as DTensors
over the tensor-parallel mesh).

Process groups: each arm's model gets its own (a ProcessGroupCollection over the harness's per-arm DeviceMesh, so
its NCCL_ALGO is the arm's). Megatron also reads some groups from its global parallel_state (the pipeline rank, the
global memory buffer, the vocab-parallel cross entropy's rank): parallel_state is initialised once per process, with
the same rank order (tensor parallel innermost), under the first arm built.

The deterministic arm turns on Megatron's `deterministic_mode` (TransformerConfig) and its environment
(NCCL_ALGO=Ring, NVTE_ALLOW_NONDETERMINISTIC_ALGO=0, CUBLAS_WORKSPACE_CONFIG), which must agree with taxbench's
policy; like Megatron's `--deterministic-mode`, it refuses cross-entropy loss fusion (not deterministic).
Not driven here: pipeline parallelism (Megatron's interleaved schedules), expert parallelism, FSDP, context
parallelism, Megatron's distributed optimizer and its dist_checkpointing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from taxbench.config import policy
from taxbench.config.policy import arm_environment
from taxbench.config.schema import (
    ActivationCheckpointing,
    ConfigError,
    DataParallel,
    PolicyConfig,
    Precision,
    RecipeConfig,
)
from taxbench.parallel.distributed import DistContext
from taxbench.parallel.layout import Layout, Meshes, ParallelModel, layout_for, meshes_for
from taxbench.train.build import RankModel, build_optimizer
from taxbench.train.stack import not_wired_native, refuse_conflicts, refuse_unknown_options
from taxbench.train.step import Batch

SUPPORTED_VERSIONS = "0.16.1 (Python 3.11) or 0.19.x (Python 3.12)"
INSTALL_HINT = "pip install 'taxbench[megatron]'"
# Megatron's --deterministic-mode environment (megatron/training/arguments.py and its NCCL note).
SWITCH_ENV = {"NCCL_ALGO": "Ring", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
SPECS = ("local", "transformer_engine")
POSITION_EMBEDDINGS = ("rope", "learned_absolute")


@dataclass(frozen=True)
class MegatronOptions:
    spec: str = "local"
    position_embedding_type: str = "rope"
    sequence_parallel: bool = False
    cross_entropy_loss_fusion: bool = False

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
        return options


def require_layout(recipe: RecipeConfig) -> None:
    """Refuse, in one line, what this adapter does not drive (see the module docstring)."""
    par = recipe.parallel
    if par.pp > 1 or par.ep > 1:
        raise ConfigError(f"recipe.model.kind=megatron runs tensor and data parallelism here (recipe.parallel.pp="
                          f"{par.pp}, ep={par.ep}: Megatron's pipeline and expert parallelism are not driven yet); "
                          "set recipe.parallel.pp=1 and ep=1")
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


def require_megatron() -> None:
    """Refuse in one line: Megatron-Core needs CUDA, and the package from the extra."""
    if not torch.cuda.is_available():
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
    """Megatron's TransformerConfig for the recipe: fp32 parameters, bf16 as autocast, no dropout (as the harness's
    models), recipe.activation_checkpointing as Megatron's recompute, deterministic_mode for the deterministic arm.
    `on_device=False`: built on the host or the meta device (use_cpu_initialization; no CUDA RNG tracker)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    model, tp = recipe.model, recipe.parallel.tp
    bf16 = str(recipe.precision) == Precision.bf16.value
    return TransformerConfig(**_recompute(recipe.activation_checkpointing),
        num_layers=model.n_layers, hidden_size=model.d_model, num_attention_heads=model.n_heads,
        ffn_hidden_size=model.d_ff, tensor_model_parallel_size=tp, sequence_parallel=options.sequence_parallel,
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        enable_autocast=bf16, autocast_dtype=torch.bfloat16 if bf16 else None,
        deterministic_mode=deterministic, cross_entropy_loss_fusion=options.cross_entropy_loss_fusion,
        gradient_accumulation_fusion=False, use_cpu_initialization=not on_device, init_method_std=0.02,
    )


def _recompute(mode: ActivationCheckpointing) -> dict[str, Any]:
    """recipe.activation_checkpointing as Megatron's recompute settings (selective: its default, core attention)."""
    if str(mode) == ActivationCheckpointing.full.value:
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    if str(mode) == ActivationCheckpointing.selective.value:
        return {"recompute_granularity": "selective"}
    return {}


def _layer_spec(options: MegatronOptions) -> Any:
    from megatron.core.models.gpt import gpt_layer_specs

    if options.spec == "local":
        return gpt_layer_specs.get_gpt_layer_local_spec()
    try:
        import transformer_engine  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"recipe.model.stack.spec=transformer_engine needs Transformer Engine ({exc}); install "
                          "it or use recipe.model.stack.spec=local") from None
    return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()


def process_groups(meshes: Meshes, world: dist.ProcessGroup) -> Any:
    """Megatron's ProcessGroupCollection for tensor x data parallelism over one arm's DeviceMesh ((edp, ep, tp) with
    ep=1): the size-1 ep dimension's group serves every dimension of size 1 (pipeline, context, expert)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    tp, dp, alone = meshes.full["tp"].get_group(), meshes.dp.get_group(), meshes.full["ep"].get_group()
    groups = ProcessGroupCollection()
    for name, group in {"tp": tp, "mp": tp, "tp_cp": tp, "tp_ep": tp, "tp_ep_pp": tp, "expt_tp": tp,
                        "dp": dp, "dp_cp": dp, "intra_dp_cp": dp, "expt_dp": dp, "intra_expt_dp": dp,
                        "tp_dp_cp": world, "pp": alone, "cp": alone, "ep": alone,
                        "embd": None, "pos_embd": None}.items():
        setattr(groups, name, group)
    return groups


def ensure_parallel_state(tp: int) -> None:
    """Megatron's global parallel_state, for what its code still reads from there (see the module docstring)."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    elif parallel_state.get_tensor_model_parallel_world_size() != tp:
        raise ConfigError(f"Megatron-Core's parallel_state is set up for tp="
                          f"{parallel_state.get_tensor_model_parallel_world_size()} in this process; one process "
                          f"trains one layout (recipe.parallel.tp={tp})")


def build_gpt(recipe: RecipeConfig, options: MegatronOptions, config: Any, groups: Any) -> nn.Module:
    """Megatron's GPTModel for the recipe (on the current default device; fp32 parameters)."""
    from megatron.core.models.gpt import GPTModel

    model = recipe.model
    return GPTModel(config=config, transformer_layer_spec=_layer_spec(options), vocab_size=model.vocab_size,
                    max_sequence_length=model.seq_len, position_embedding_type=options.position_embedding_type,
                    share_embeddings_and_output_weights=False, pg_collection=groups)


def gpt_forward(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """GPTModel's per-token loss [batch, seq] (its vocab-parallel cross entropy, fp32); causal attention, no mask."""
    positions = torch.arange(inputs.shape[1], device=inputs.device).expand_as(inputs)
    return model(inputs, positions, None, labels=targets)


def mean_token_loss(per_token: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss function Megatron's schedule calls: the micro-batch's mean token loss, and a copy for the record (the
    schedule divides the loss it backpropagates by the number of micro-batches in place)."""
    loss = per_token.float().mean()
    return loss, {"loss": loss.detach().clone()}


def meta_gpt(recipe: RecipeConfig) -> nn.Module:
    """The GPTModel on the meta device, built before launch in a one-rank world (its module paths do not depend on
    the tensor-parallel degree)."""
    options = MegatronOptions.of(recipe)
    require_layout(recipe)
    config = transformer_config(recipe, options, deterministic=False, on_device=False)
    config.perform_initialization = False
    with _one_rank_world() as groups, torch.device("meta"):
        return build_gpt(recipe, options, config, groups)


class MegatronStep:
    """Megatron's forward-backward schedule over the harness's micro-batches (gradients in DDP's buffers, reduced by
    finalize_model_grads at its end)."""

    def __init__(self, ddp: nn.Module, recipe: RecipeConfig, groups: Any) -> None:
        self.ddp, self.groups = ddp, groups
        self.seq_len, self.micro_batch = recipe.model.seq_len, recipe.micro_batch_size

    def _forward_step(self, data: Iterator[Batch], model: nn.Module) -> tuple[torch.Tensor, Any]:
        inputs, targets = next(data)
        return gpt_forward(model, inputs, targets), mean_token_loss

    def run(self, batches: list[Batch]) -> torch.Tensor:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self.ddp.zero_grad_buffer()
        forward_backward = get_forward_backward_func(pp_size=1)
        records = forward_backward(forward_step_func=self._forward_step, data_iterator=iter(batches),
                                   model=[self.ddp], num_microbatches=len(batches), seq_length=self.seq_len,
                                   micro_batch_size=self.micro_batch, forward_only=False, pg_collection=self.groups)
        return torch.stack([r["loss"] for r in records]).mean()  # this rank's mean token loss, as the harness's


class MegatronParallel(ParallelModel):
    """The GPTModel in Megatron's DDP, as the trainer drives it: gradients come from DDP's buffers, the norm and the
    clipping are Megatron's (tensor-parallel shards counted once, over the model-parallel group), and the
    tensor-parallel weights are checkpointed as DTensors over the arm's tensor-parallel mesh. Gradient sync across
    micro-batches is the schedule's (config.no_sync_func)."""

    def __init__(self, gpt: nn.Module, ddp: nn.Module, layout: Layout, meshes: Meshes, groups: Any) -> None:
        super().__init__([gpt], [ddp], layout, meshes, groups.tp_dp_cp, [])
        self.groups = groups
        self._tp_mesh = meshes.full["tp"]
        self._sliced = {name: p for name, p in gpt.named_parameters() if getattr(p, "tensor_model_parallel", False)}

    def finish_gradients(self) -> None:
        """DDP's reduced fp32 buffers become the parameters' gradients (as Megatron's FP32Optimizer does)."""
        for param in self.parts.parameters():
            if param.requires_grad:
                param.grad = param.main_grad

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32, get_grad_norm_fp32
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        params = [p for p in self.parts.parameters() if p.grad is not None]
        counted = [p.grad for p in params if param_is_not_tensor_parallel_duplicate(p, tp_group=self.groups.tp)]
        norm = get_grad_norm_fp32(counted, grad_stats_parallel_group=self.groups.mp)
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
        return {"stack": self.name, "version": _version(), "deterministic_mode": on, "spec": options.spec,
                "cross_entropy_loss_fusion": options.cross_entropy_loss_fusion,
                "sequence_parallel": options.sequence_parallel, "env": SWITCH_ENV if on else {}}

    def native_policy(self, recipe: RecipeConfig, name: str) -> PolicyConfig:
        raise not_wired_native(self.name, "--deterministic-mode")

    def meta_model(self, recipe: RecipeConfig) -> nn.Module:
        require_megatron()
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
        groups = process_groups(meshes, ctx.group_for(arm_policy))
        with policy.active(arm_policy):
            refuse_conflicts(self.name, arm_policy, SWITCH_ENV if arm_policy.deterministic else {})
            with arm_environment(arm_policy):
                ensure_parallel_state(layout.tp)
            model_parallel_cuda_manual_seed(recipe.seed, tp_rank=layout.tp_rank, ep_rank=0, etp_rank=layout.tp_rank)
            config = transformer_config(recipe, options, arm_policy.deterministic, on_device=True)
            # As Megatron's get_model: its parallel layers allocate on the GPU, torch's norms on the host.
            gpt = build_gpt(recipe, options, config, groups).to(ctx.device)
            ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                       use_distributed_optimizer=False)
            ddp = DistributedDataParallel(config, ddp_config, gpt, pg_collection=groups)
            config.no_sync_func = ddp.no_sync
            config.finalize_model_grads_func = finalize_model_grads
        parallel = MegatronParallel(gpt, ddp, layout, meshes, groups)
        return RankModel(parallel, None, [], MegatronStep(ddp, recipe, groups), None)

    def optimizer(self, recipe: RecipeConfig, model: RankModel) -> torch.optim.Optimizer:
        return build_optimizer(recipe, model.parts.parameters())


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
