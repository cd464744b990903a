"""torchtitan as a training stack: its model registry, parallelize function, weight init, loss and determinism switch.

The recipe names torchtitan's model in `recipe.model.stack`: `family` (llama3, qwen3, deepseek_v3), `flavor`
(debugmodel, debugmodel_moe, ...), `attn_backend` (torchtitan's flex | varlen, or sdpa: see below), and optionally
`deterministic_warn_only` and `spmd_backend`. The model is built on the meta device from torchtitan's config,
sharded by torchtitan's `parallelize_fn` on torchtitan's ParallelDims mesh (FSDP2 over every rank, tp and ep as the
recipe's layout says), materialised with torchtitan's `init_weights`, and each micro-batch runs torchtitan's forward
and loss as its Trainer's `forward_backward_step` does (loss = token sum / global tokens, gradients summed).
With recipe.parallel.pp>1 torchtitan's own `pipeline_llm` splits the meta model into one stage per rank (its module
names per stage, each stage deep-copied with what it does not own deleted and then parallelized by the same
`parallelize_fn`), each part is materialised and initialised as a whole model is, and its schedule (1F1B, GPipe) runs
the harness's micro-batches (TitanPipelineStep); a part keeps the unsplit model's module names, so checkpoints and
fingerprints need no mapping.
What stays the harness's: the data (taxbench's token source, so both stacks read the same tokens), the step loop and
its timer marks, AdamW from recipe.optimizer, gradient clipping, fingerprints and DCP checkpoints. torchtitan's
Trainer class itself is not constructed: its __init__ also builds its Hugging Face tokenizer and data loader, metrics
and checkpointer, which the harness replaces.

The deterministic arm runs torchtitan's own switch (`debug.deterministic`: torchtitan.distributed.utils
.set_determinism, which also seeds) inside taxbench's policy; flags it leaves differing from the policy are refused.
The rest of what it changes is put back after the build (environment, generators, FlexAttention's class-wide kernel,
which each model then swaps in for its own steps), so that one process can build several trainers.

On CPU (torchtitan 0.3.0 targets accelerators), four things are adapted, each needed to get past a concrete failure:
- torchtitan binds `device_type = "cuda"` at import when no accelerator is present (torchtitan/tools/utils.py:55);
  the modules that read it are pointed at the CPU while taxbench builds;
- FlexAttention has no CPU backward and varlen attention calls flash attention (CUDA): `attn_backend: sdpa` swaps
  the inner attention for torchtitan's own ScaledDotProductAttention (causal; one document per row);
- FSDP2 reduce-scatters with ReduceOp.PREMUL_SUM, which gloo rejects: its modules sum instead
  (set_force_sum_reduction_for_comms; the divide factor torchtitan set is then applied after the reduction);
- torchtitan's default spmd_backend=spmd_types refuses FSDP2 at 2 ranks ("all parameters must be DTensors on the
  full SPMD mesh ... 'weight'"): recipes use spmd_backend=partial_dtensor.
"""

from __future__ import annotations

import importlib
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from taxbench.checkpoint.rng import RngSnapshot
from taxbench.config import policy
from taxbench.config.schema import (
    ActivationCheckpointing,
    ConfigError,
    DataParallel,
    ModelConfig,
    PolicyConfig,
    RecipeConfig,
)
from taxbench.config.shape import ParallelShape
from taxbench.parallel.distributed import DistContext
from taxbench.parallel.layout import ParallelModel, layout_for
from taxbench.stacks.native import build_optimizer
from taxbench.stacks.protocol import RankModel, not_wired_native, refuse_conflicts, refuse_unknown_options
from taxbench.stacks.step import Batch

TESTED_VERSION = "0.3.0"
INSTALL_HINT = "pip install 'taxbench[titan]'"
FAMILIES = ("llama3", "qwen3", "deepseek_v3")
ATTN_BACKENDS = ("flex", "varlen", "sdpa")
# torchtitan's switch puts this in the environment (torchtitan/distributed/utils.py, set_determinism).
SWITCH_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
SEED_ENV = "PYTHONHASHSEED"  # which it sets to its seed as well


@dataclass(frozen=True)
class TitanOptions:
    family: str
    flavor: str
    attn_backend: str = "sdpa"
    deterministic_warn_only: bool = False
    spmd_backend: str = "partial_dtensor"

    @classmethod
    def of(cls, model: ModelConfig) -> TitanOptions:
        refuse_unknown_options("torchtitan", cls, model.stack)
        if "family" not in model.stack or "flavor" not in model.stack:
            raise ConfigError("recipe.model.kind=titan needs recipe.model.stack.family (one of "
                              f"{list(FAMILIES)}) and recipe.model.stack.flavor (e.g. debugmodel)")
        options = cls(**model.stack)
        if options.family not in FAMILIES:
            raise ConfigError(f"recipe.model.stack.family={options.family!r}: choose one of {list(FAMILIES)}")
        if options.attn_backend not in ATTN_BACKENDS:
            raise ConfigError(f"recipe.model.stack.attn_backend={options.attn_backend!r}: choose one of "
                              f"{list(ATTN_BACKENDS)}")
        return options


def require_torchtitan() -> None:
    """Refuse a titan recipe in one line when torchtitan (or what its import needs, e.g. triton) is missing."""
    try:
        import torchtitan.trainer  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"recipe.model.kind=titan needs torchtitan=={TESTED_VERSION}: {INSTALL_HINT} "
                          f"({exc})") from None


@contextmanager
def _torchtitan_on(device: torch.device) -> Iterator[None]:
    """torchtitan resolved its device at import; on the CPU, the modules that use it on our path read the CPU instead
    while taxbench builds (their own values come back after)."""
    if device.type != "cpu":
        yield
        return
    from torchtitan.distributed import parallel_dims, utils
    from torchtitan.models.common import token_dispatcher
    from torchtitan.tools import utils as tools_utils

    cpu = {"device_type": "cpu", "device_module": torch.cpu}
    saved = [(module, name, getattr(module, name)) for module in (tools_utils, parallel_dims, utils, token_dispatcher)
             for name in cpu if hasattr(module, name)]
    for module, name, _ in saved:
        setattr(module, name, cpu[name])
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


@dataclass(frozen=True)
class FlexKernel:
    """FlexAttention's compiled kernel and its inductor options: class-wide, and replaced by torchtitan's switch (a
    compile without autotuning). Each model runs with the one its build chose (TitanStep)."""

    compiled: Any
    options: dict[str, Any]

    @classmethod
    def current(cls) -> FlexKernel:
        from torchtitan.models.common.attention import FlexAttention

        return cls(FlexAttention._compiled_flex_attn, dict(FlexAttention.inductor_configs))

    def install(self) -> None:
        from torchtitan.models.common.attention import FlexAttention

        FlexAttention._compiled_flex_attn = self.compiled
        FlexAttention.inductor_configs.clear()  # the switch edits this dict in place: so does its restore
        FlexAttention.inductor_configs.update(self.options)


@contextmanager
def _flex_kernel(kernel: FlexKernel | None) -> Iterator[None]:
    if kernel is None:
        yield
        return
    saved = FlexKernel.current()
    kernel.install()
    try:
        yield
    finally:
        saved.install()


@contextmanager
def _switch_undone() -> Iterator[None]:
    """Puts back what torchtitan's switch (set_determinism) changes and policy.active does not (it restores torch's
    flags): the environment variables it sets, the generators it seeds and FlexAttention's kernel, so that building a
    titan model leaves the process as it found it (`taxbench scan` and in-process launches build several)."""
    env = {name: os.environ.get(name) for name in (*SWITCH_ENV, SEED_ENV)}
    rng = RngSnapshot.capture()
    flex = FlexKernel.current()
    try:
        yield
    finally:
        policy.put_env(env)
        rng.restore()
        flex.install()


def _model_config(options: TitanOptions) -> Any:
    """torchtitan's model config from its registry (attention swapped for SDPA when asked)."""
    family = importlib.import_module(f"torchtitan.models.{options.family}")
    backend = "flex" if options.attn_backend == "sdpa" else options.attn_backend
    try:
        spec = family.model_registry(options.flavor, attn_backend=backend)
    except KeyError:
        raise ConfigError(f"recipe.model.stack.flavor={options.flavor!r} is not a torchtitan {options.family} "
                          "flavor") from None
    if options.attn_backend == "sdpa":
        from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention

        for _, _, parent, attr in list(spec.model.traverse(FlexAttention.Config)):
            setattr(parent, attr, ScaledDotProductAttention.Config())
    return spec


def _param_dtype(recipe: RecipeConfig) -> str:
    """torchtitan's mixed_precision_param for recipe.precision (its default, bfloat16, would make an fp32 recipe
    compute in bf16 under FSDP)."""
    precision = str(recipe.precision)
    if precision not in ("fp32", "bf16"):
        raise ConfigError(f"recipe.precision={precision} is not wired to torchtitan's stack; use fp32 or bf16 with "
                          "recipe.model.kind=titan")
    return "float32" if precision == "fp32" else "bfloat16"


def _trainer_config(recipe: RecipeConfig, options: TitanOptions, spec: Any, deterministic: bool, world: int,
                    micro_batches: int = 1) -> Any:
    from torchtitan.config.configs import DebugConfig, ParallelismConfig, TrainingConfig
    from torchtitan.trainer import Trainer

    par = recipe.parallel
    dp = ParallelShape.of(par, world).dp
    ddp = par.data_parallel is DataParallel.ddp or str(par.data_parallel) == DataParallel.ddp.value
    parallelism = ParallelismConfig(
        data_parallel_replicate_degree=dp if ddp else 1, data_parallel_shard_degree=1 if ddp else -1,
        tensor_parallel_degree=par.tp, expert_parallel_degree=par.ep, spmd_backend=options.spmd_backend,
        pipeline_parallel_degree=par.pp, pipeline_parallel_schedule=par.pp_schedule,
        pipeline_parallel_microbatch_size=recipe.micro_batch_size)
    # torchtitan's pipeline splits the rank's local batch into its micro-batches: the harness's, one step's worth.
    training = TrainingConfig(local_batch_size=recipe.micro_batch_size * micro_batches, seq_len=recipe.model.seq_len,
                              disable_cuda_graphs=True, mixed_precision_param=_param_dtype(recipe))
    debug = DebugConfig(seed=recipe.seed, deterministic=deterministic,
                        deterministic_warn_only=options.deterministic_warn_only)
    return Trainer.Config(model_spec=spec, training=training, parallelism=parallelism, debug=debug,
                          activation_checkpoint=None)


class TitanStep:
    """torchtitan's forward_backward_step over the harness's micro-batches: loss = token sum / global tokens."""

    def __init__(self, model: nn.Module, loss_fn: Any, dp: int, device: torch.device, needs_masks: bool,
                 flex: FlexKernel | None) -> None:
        self.model, self.loss_fn, self.dp, self.device, self.needs_masks = model, loss_fn, dp, device, needs_masks
        self.flex = flex  # FlexAttention's kernel as this model's build left it (None: the model has no FlexAttention)

    def _extra(self, inputs: torch.Tensor) -> dict[str, Any]:
        if not self.needs_masks:  # SDPA: causal, no positions
            return {}
        positions = torch.arange(inputs.shape[1], device=inputs.device).expand_as(inputs).contiguous()
        return {"positions": positions, "attention_masks": self.model.get_attention_masks(positions=positions)}

    def run(self, batches: list[Batch]) -> torch.Tensor:
        # Every harness token is a valid label: the global count needs no all-reduce.
        global_tokens = torch.tensor(sum(t.numel() for _, t in batches) * self.dp, device=self.device)
        total = torch.zeros((), device=self.device)
        with _flex_kernel(self.flex):
            for inputs, targets in batches:
                pred = self.model(inputs, **self._extra(inputs))
                loss, _ = self.loss_fn(pred, targets, global_tokens)
                del pred
                loss.backward()
                total += loss.detach()
        return total * self.dp  # this rank's mean token loss, as the harness's own steps record it


class TitanPipelineStep:
    """torchtitan's pipeline schedule (from `pipeline_llm`) over the harness's micro-batches, as its Trainer's
    pp_forward_backward_step runs it, but in the form torch 2.13 takes: the whole local batch, which the schedule
    splits into the same micro-batches (the Trainer's per-micro-batch lists are rejected: "Expecting 4 arg_mbs but got
    1"). The loss exists on the last stage (token sum / global tokens per micro-batch); the recorded loss is summed over
    the pipeline group, so every rank records the same bits."""

    def __init__(self, schedule: Any, first: bool, last: bool, dp: int, device: torch.device,
                 pp_group: Any) -> None:
        self.schedule, self.first, self.last, self.dp, self.device = schedule, first, last, dp, device
        self.pp_group = pp_group

    def run(self, batches: list[Batch]) -> torch.Tensor:
        import torch.distributed as dist

        inputs = torch.cat([x for x, _ in batches])
        targets = torch.cat([y for _, y in batches])
        global_tokens = torch.tensor(targets.numel() * self.dp, device=self.device)
        losses: list[torch.Tensor] = []
        kwargs: dict[str, Any] = {"loss_kwargs": {"global_valid_tokens": global_tokens}, "return_outputs": False}
        if self.last:
            kwargs.update(target=targets, losses=losses)
        if self.first:
            self.schedule.step(inputs, **kwargs)
        else:
            self.schedule.step(**kwargs)
        total = torch.zeros((), device=self.device)
        for loss in losses:  # fixed micro-batch order
            total = total + loss.detach().float().to(self.device)
        dist.all_reduce(total, group=self.pp_group)
        return total * self.dp  # this rank's mean token loss, as the harness's own steps record it


class TitanStack:
    name = "torchtitan"

    def __init__(self) -> None:
        self._spec: Any = None  # torchtitan's ModelSpec, ParallelDims and device of the last build (the optimizer's
        self._dims: Any = None  # MoE hook)
        self._device = torch.device("cpu")

    def switch(self, recipe: RecipeConfig, arm_policy: PolicyConfig) -> dict[str, Any]:
        options = TitanOptions.of(recipe.model)
        on = arm_policy.deterministic
        if on:
            _refuse_static_conflicts(options, arm_policy)
        return {"stack": self.name, "version": _version(), "debug.deterministic": on,
                "debug.deterministic_warn_only": options.deterministic_warn_only, "debug.seed": recipe.seed,
                "env": SWITCH_ENV if on else {}, "attn_backend": options.attn_backend,
                "spmd_backend": options.spmd_backend}

    def native_policy(self, recipe: RecipeConfig, name: str) -> PolicyConfig:
        raise not_wired_native(self.name, "debug.deterministic")

    def meta_model(self, recipe: RecipeConfig) -> nn.Module:
        require_torchtitan()
        options = TitanOptions.of(recipe.model)
        if recipe.parallel.pp > 1 and recipe.parallel.virtual_stages > 1:
            raise ConfigError(f"recipe.parallel.virtual_stages={recipe.parallel.virtual_stages}: torchtitan's "
                              "pipeline_llm is driven with one stage per rank here (1F1B, GPipe); set "
                              "recipe.parallel.virtual_stages=1")
        if recipe.parallel.pp > 1 and options.attn_backend != "sdpa":
            raise ConfigError(f"recipe.model.stack.attn_backend={options.attn_backend} needs attention masks, which "
                              "taxbench does not pass through torchtitan's pipeline schedule; use attn_backend=sdpa "
                              "with recipe.parallel.pp>1")
        if str(recipe.activation_checkpointing) != ActivationCheckpointing.none.value:
            raise ConfigError(f"recipe.activation_checkpointing={recipe.activation_checkpointing} is not wired to "
                              "torchtitan's stack (its checkpoint wrappers rename the module paths that faults, "
                              "traces and records use); set recipe.activation_checkpointing=none")
        spec = _model_config(options)
        config = _trainer_config(recipe, options, spec, False, recipe.parallel.tp * recipe.parallel.ep)
        spec.model.update_from_config(config=config)
        with torch.device("meta"):
            model = spec.model.build()
        vocab = model.tok_embeddings.num_embeddings if hasattr(model, "tok_embeddings") else None
        if vocab is not None and vocab != recipe.model.vocab_size:
            raise ConfigError(f"torchtitan {options.family} {options.flavor} has a vocabulary of {vocab} tokens; set "
                              f"recipe.model.vocab_size={vocab}")
        return model

    def build(self, recipe: RecipeConfig, arm_policy: PolicyConfig, ctx: DistContext, micro_batches: int) -> RankModel:
        require_torchtitan()
        from torch.distributed.fsdp import FSDPModule
        from torchtitan.distributed import ParallelDims
        from torchtitan.distributed.utils import set_determinism
        from torchtitan.models.common.attention import FlexAttention, VarlenAttention

        options = TitanOptions.of(recipe.model)
        spec = _model_config(options)
        config = _trainer_config(recipe, options, spec, arm_policy.deterministic, ctx.world_size, micro_batches)
        loss_fn = _loss(spec, config)
        pipeline: Any = None
        with _switch_undone(), _torchtitan_on(ctx.device), policy.active(arm_policy):
            dims = ParallelDims.from_config(config.parallelism, ctx.world_size)
            set_determinism(dims, ctx.device, config.debug, distinct_seed_mesh_dims=["pp"])
            refuse_conflicts(self.name, arm_policy, SWITCH_ENV if arm_policy.deterministic else {})
            spec.model.update_from_config(config=config)
            with torch.device("meta"):
                model = spec.model.build()
            with tempfile.TemporaryDirectory() as dump_folder:
                if dims.pp_enabled:
                    from torchtitan.distributed.pipeline_parallel import pipeline_llm

                    pipeline = pipeline_llm(model, parallel_dims=dims, training=config.training,
                                            parallelism=config.parallelism, compile_config=config.compile,
                                            ac_config=None, dump_folder=dump_folder, device=ctx.device,
                                            model_config=spec.model, parallelize_fn=spec.parallelize_fn,
                                            loss_fn=loss_fn)
                    parts = list(pipeline[1])
                else:
                    parts = [spec.parallelize_fn(model, parallel_dims=dims, training=config.training,
                                                 parallelism=config.parallelism, compile_config=config.compile,
                                                 ac_config=None, dump_folder=dump_folder)]
            for part in parts:
                if ctx.backend == "gloo":
                    for module in part.modules():
                        if isinstance(module, FSDPModule):
                            module.set_force_sum_reduction_for_comms(True)
                _keep_fused_qkv_in_checkpoints(part)
                part.to_empty(device=ctx.device)
                with torch.no_grad():
                    part.init_weights(buffer_device=None)
                part.train()
            uses_flex = any(True for _ in spec.model.traverse(FlexAttention.Config))
            flex = FlexKernel.current() if uses_flex else None
        layout = layout_for(recipe.parallel, ctx.world_size, ctx.rank)
        parallel = ParallelModel(parts, parts, layout, None, None, [])
        needs_masks = uses_flex or any(True for _ in spec.model.traverse(VarlenAttention.Config))
        step: TitanStep | TitanPipelineStep
        if pipeline is not None:
            schedule, _, first, last = pipeline
            step = TitanPipelineStep(schedule, first, last, layout.dp, ctx.device, dims.get_mesh("pp").get_group())
        else:
            step = TitanStep(parts[0], loss_fn, layout.dp, ctx.device, needs_masks, flex)
        self._spec, self._dims, self._device = spec, dims, ctx.device
        return RankModel(parallel, None, [], step, None)

    def optimizer(self, recipe: RecipeConfig, model: RankModel) -> torch.optim.Optimizer:
        optimizer = build_optimizer(recipe, model.parts.parameters())
        if self._spec.post_optimizer_build_fn is not None:  # MoE: torchtitan's expert-bias load balancing hook
            with _torchtitan_on(self._device):
                self._spec.post_optimizer_build_fn(optimizer, model.parts.parts, self._dims)
        return optimizer


def _refuse_static_conflicts(options: TitanOptions, arm_policy: PolicyConfig) -> None:
    """What torchtitan's switch is known to set, against the deterministic arm's policy (before launch)."""
    clash = None
    if options.deterministic_warn_only:
        clash = ("deterministic_warn_only", "true", "use_deterministic_algorithms without warn_only")
    elif arm_policy.fill_uninitialized_memory:
        clash = ("fill_uninitialized_memory", "false", "true")
    elif arm_policy.cublas_workspace_config not in (None, SWITCH_ENV["CUBLAS_WORKSPACE_CONFIG"]):
        clash = ("CUBLAS_WORKSPACE_CONFIG", SWITCH_ENV["CUBLAS_WORKSPACE_CONFIG"], arm_policy.cublas_workspace_config)
    if clash is not None:
        name, theirs, ours = clash
        raise ConfigError(f"torchtitan's debug.deterministic sets {name}={theirs} but the {arm_policy.name} arm's "
                          f"taxbench policy has {ours}; make the two agree (recipe.model.stack or "
                          f"arms.{arm_policy.name})")


def _keep_fused_qkv_in_checkpoints(model: nn.Module) -> None:
    """torchtitan's FusedQKVLinear renames `wqkv` to wq/wk/wv in its state dict (for Hugging Face checkpoints);
    torch's get_state_dict, which the harness's DCP checkpoint reads through, cannot map renamed keys back to
    parameters. The harness's checkpoints keep `wqkv` as it trains."""
    from torchtitan.models.common.attention import FusedQKVLinear

    for module in model.modules():
        if isinstance(module, FusedQKVLinear):
            module._state_dict_hooks.clear()
            module._load_state_dict_pre_hooks.clear()


def _loss(spec: Any, config: Any) -> Any:
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.models.common.config_utils import decoder_vocab_size

    return CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(spec)).build(compile_config=config.compile)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torchtitan")
    except PackageNotFoundError:
        return "not installed"
