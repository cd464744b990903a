"""torchtitan as a training stack: its model registry, parallelize function, weight init, loss and determinism switch.

The recipe names torchtitan's model in `recipe.model.stack`: `family` (llama3, qwen3, deepseek_v3), `flavor`
(debugmodel, debugmodel_moe, ...), `attn_backend` (torchtitan's flex | varlen, or sdpa: see below), and optionally
`deterministic_warn_only` and `spmd_backend`; or a whole torchtitan job config as its CLI takes it, `job`: `--module`,
`--config` (a function of that module's config registry) and dotted overrides, parsed by torchtitan's ConfigManager. The
job gives the model, parallelism, optimizer, LR schedule and activation checkpointing; where it overlaps the recipe
(layout, precision, batch, clipping, recompute) the two must agree, or the pair is refused (_refuse_job_disagreements):
both arms must stay identical but for the policy. The model is built on the meta device from torchtitan's config,
sharded by torchtitan's `parallelize_fn` on torchtitan's ParallelDims mesh (FSDP2 over every rank, tp and ep as the
recipe's layout says), materialised with torchtitan's `init_weights`, and each micro-batch runs torchtitan's forward
and loss as its Trainer's `forward_backward_step` does (loss = token sum / global tokens, gradients summed).
With recipe.parallel.pp>1 torchtitan's own `pipeline_llm` splits the meta model into one stage per rank (its module
names per stage, each stage deep-copied with what it does not own deleted and then parallelized by the same
`parallelize_fn`), each part is materialised and initialised as a whole model is, and its schedule (1F1B, GPipe) runs
the harness's micro-batches (TitanPipelineStep); a part keeps the unsplit model's module names, so checkpoints and
fingerprints need no mapping.
The optimizer is torchtitan's OptimizersContainer (the job's, or recipe.optimizer's AdamW mapped onto it), and a job's
LR schedule steps after each optimizer step and is saved in the checkpoint beside it. Activation checkpointing is
torchtitan's (its block wrappers; the harness names modules without the wrapper's level: ModelParts).
What stays the harness's: the data (taxbench's token source, so both stacks read the same tokens), the step loop and
its timer marks, gradient clipping, fingerprints and DCP checkpoints. torchtitan's
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

import contextlib
import copy
import functools
import importlib
import io
import os
import shlex
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from taxbench.checkpoint.rng import RngSnapshot
from taxbench.config.schema import (
    ActivationCheckpointing,
    ConfigError,
    DataParallel,
    ModelConfig,
    PolicyConfig,
    RecipeConfig,
)
from taxbench.config.shape import ParallelShape
from taxbench.diagnostics import stacks_quieted
from taxbench.parallel.distributed import DistContext
from taxbench.parallel.layout import ParallelModel, layout_for
from taxbench.runtime import determinism
from taxbench.stacks.protocol import RankModel, refuse_conflicts, refuse_unknown_options
from taxbench.stacks.step import Batch

TESTED_VERSION = "0.3.0"
INSTALL_HINT = "pip install 'taxbench[titan]'"
FAMILIES = ("llama3", "qwen3", "deepseek_v3")
ATTN_BACKENDS = ("flex", "varlen", "sdpa")
# torchtitan's switch puts this in the environment (torchtitan/distributed/utils.py, set_determinism).
SWITCH_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
# debug.deterministic as policy fields (a stack-native arm): deterministic algorithms with the fill of uninitialized
# memory off, cuDNN deterministic without its autotuner, and SWITCH_ENV. set_determinism does not touch TF32
# (allow_tf32=None: the arm leaves torch's flags as the process has them, torch's defaults under plain torchtitan:
# matmul off, cuDNN on) nor NCCL.
SWITCH_FIELDS = {"deterministic": True, "cudnn_benchmark": False, "allow_tf32": None,
                 "cublas_workspace_config": SWITCH_ENV["CUBLAS_WORKSPACE_CONFIG"], "nccl_algo": None,
                 "nvte_allow_nondeterministic_algo": True, "fill_uninitialized_memory": False,
                 "deterministic_kernels": False}
SEED_ENV = "PYTHONHASHSEED"  # which it sets to its seed as well


# With recipe.model.stack.job these come from torchtitan's job config and are refused in recipe.model.stack.
FROM_JOB = {"family": "--module", "flavor": "--config", "spmd_backend": "--parallelism.spmd_backend",
            "deterministic_warn_only": "--debug.deterministic_warn_only"}


@dataclass(frozen=True)
class TitanOptions:
    family: str = ""
    flavor: str = ""
    attn_backend: str = "sdpa"
    deterministic_warn_only: bool = False
    spmd_backend: str = "partial_dtensor"
    job: tuple[str, ...] = ()  # torchtitan's CLI arguments: --module, --config and its dotted overrides

    @classmethod
    def of(cls, model: ModelConfig) -> TitanOptions:
        refuse_unknown_options("torchtitan", cls, model.stack)
        if "job" in model.stack:
            return cls._of_job(model.stack)
        if "family" not in model.stack or "flavor" not in model.stack:
            raise ConfigError("recipe.model.kind=titan needs recipe.model.stack.family (one of "
                              f"{list(FAMILIES)}) and recipe.model.stack.flavor (e.g. debugmodel), or "
                              "recipe.model.stack.job (torchtitan's --module, --config and overrides)")
        options = cls(**model.stack)
        return options._checked()

    @classmethod
    def _of_job(cls, stack: dict[str, Any]) -> TitanOptions:
        """The options torchtitan's job config gives: its model's family and flavor, spmd backend and warn_only."""
        given = [key for key in FROM_JOB if key in stack]
        if given:
            raise ConfigError(f"recipe.model.stack.{given[0]} comes from recipe.model.stack.job; drop it (set "
                              f"{FROM_JOB[given[0]]} in the job instead)")
        args = _job_args(stack["job"])
        job = job_config(args)
        spec = job.model_spec
        return cls(family=spec.name, flavor=spec.flavor, attn_backend=stack.get("attn_backend", "sdpa"),
                   deterministic_warn_only=job.debug.deterministic_warn_only,
                   spmd_backend=job.parallelism.spmd_backend, job=args)._checked()

    def _checked(self) -> TitanOptions:
        options = self
        if options.family not in FAMILIES:
            raise ConfigError(f"recipe.model.stack.family={options.family!r}: choose one of {list(FAMILIES)}")
        if options.attn_backend not in ATTN_BACKENDS:
            raise ConfigError(f"recipe.model.stack.attn_backend={options.attn_backend!r}: choose one of "
                              f"{list(ATTN_BACKENDS)}")
        return options


def _job_args(value: Any) -> tuple[str, ...]:
    """recipe.model.stack.job as torchtitan's CLI takes it: a list of arguments or one string (split as a shell
    would)."""
    if isinstance(value, str):
        return tuple(shlex.split(value))
    if isinstance(value, (list, tuple)) or (hasattr(value, "__iter__") and not isinstance(value, dict)):
        return tuple(str(item) for item in value)
    raise ConfigError(f"recipe.model.stack.job={value!r}: give torchtitan's arguments as a list or one string, e.g. "
                      "[--module, llama3, --config, llama3_debugmodel]")


@functools.lru_cache(maxsize=8)
def job_config(args: tuple[str, ...]) -> Any:
    """torchtitan's job config (a Trainer.Config) as its CLI builds it: ConfigManager().parse_args(args), i.e. the
    --config function of the --module's config registry with the dotted overrides applied. Cached per arguments:
    callers copy before changing it. What torchtitan refuses is refused in one line."""
    require_torchtitan()
    from torchtitan.config.manager import ConfigManager

    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said), contextlib.redirect_stdout(said), stacks_quieted():
            return ConfigManager().parse_args(list(args))
    except SystemExit:  # tyro: unknown option, bad value, failed validation (its message went to `said`)
        reason = _tyro_reason(said.getvalue())
    except (ValueError, ImportError, AttributeError) as exc:  # --module, --config missing or unknown
        reason = _one_line(str(exc))
    raise ConfigError(f"recipe.model.stack.job={' '.join(args)!r}: torchtitan's ConfigManager refused it ({reason}); "
                      "fix the job's arguments (python -m torchtitan.config.manager ... --help lists them)")


def _tyro_reason(text: str) -> str:
    """The lines of tyro's boxed error that say what is wrong (not the box, the help hints or the blank lines)."""
    lines = text.splitlines()
    # What torchtitan logged while loading the config comes first, flush left; tyro's box is drawn indented.
    start = next((i for i, line in enumerate(lines) if line.startswith((" ", "╭", "│"))), 0)
    lines = [line.strip(" │╭╮╰╯─-") for line in lines[start:]]
    keep = [line for line in lines if line and "helptext" not in line and "For full" not in line
            and not line.startswith(("Value error", "Parsing error", "Available subcommands", "activation-checkpoint"))]
    return _one_line("; ".join(dict.fromkeys(keep[:3])) or "no reason given")


def _one_line(text: str) -> str:
    return " ".join(text.split())[:400]


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
    """Puts back what torchtitan's switch (set_determinism) changes and determinism.active does not (it restores torch's
    flags): the environment variables it sets, the generators it seeds and FlexAttention's kernel, so that building a
    titan model leaves the process as it found it (`taxbench scan` and in-process launches build several)."""
    env = {name: os.environ.get(name) for name in (*SWITCH_ENV, SEED_ENV)}
    rng = RngSnapshot.capture()
    flex = FlexKernel.current()
    try:
        yield
    finally:
        determinism.put_env(env)
        rng.restore()
        flex.install()


def _model_config(options: TitanOptions) -> Any:
    """torchtitan's model spec from its job config or its model registry (attention swapped for SDPA when asked)."""
    if options.job:
        spec = copy.deepcopy(job_config(options.job).model_spec)
    else:
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


def _refuse_job_disagreements(recipe: RecipeConfig, job: Any, world: int | None = None) -> None:
    """The pair must stay identical in everything but the determinism policy: where torchtitan's job config and the
    recipe disagree on the layout, precision or batch, refuse (one line, both values, the fix) rather than pick one.
    `world`: the world size, when known (the local batch depends on it)."""
    par, tp, training = recipe.parallel, job.parallelism, job.training
    dp = max(ParallelShape.of(par, world).dp, 1) if world is not None else None
    ours_ddp = str(par.data_parallel) == DataParallel.ddp.value
    theirs_ddp = tp.data_parallel_shard_degree == 1  # no sharding: replicated, also at a replicate degree of 1 (dp=1)
    # (taxbench's name and value, torchtitan's flag and value, taxbench's value as the job's flag says it)
    same: list[tuple[str, Any, str, Any, Any]] = [
        ("recipe.parallel.pp", par.pp, "--parallelism.pipeline_parallel_degree", tp.pipeline_parallel_degree, par.pp),
        ("recipe.parallel.tp", par.tp, "--parallelism.tensor_parallel_degree", tp.tensor_parallel_degree, par.tp),
        ("recipe.parallel.ep", par.ep, "--parallelism.expert_parallel_degree", tp.expert_parallel_degree, par.ep),
        ("taxbench's context parallel degree", 1, "--parallelism.context_parallel_degree", tp.context_parallel_degree,
         1),
        ("recipe.model.seq_len", recipe.model.seq_len, "--training.seq_len", training.seq_len, recipe.model.seq_len),
        ("recipe.precision", recipe.precision, "--training.mixed_precision_param", training.mixed_precision_param,
         _param_dtype(recipe)),
        ("recipe.optimizer.grad_clip", recipe.optimizer.grad_clip, "--training.max_norm", training.max_norm,
         recipe.optimizer.grad_clip),
    ]
    if par.pp > 1:
        same += [("recipe.parallel.pp_schedule", par.pp_schedule, "--parallelism.pipeline_parallel_schedule",
                  tp.pipeline_parallel_schedule, par.pp_schedule),
                 ("recipe.micro_batch_size", recipe.micro_batch_size,
                  "--parallelism.pipeline_parallel_microbatch_size", tp.pipeline_parallel_microbatch_size,
                  recipe.micro_batch_size)]
    if training.global_batch_size > 0:
        same.append(("recipe.global_batch_size", recipe.global_batch_size, "--training.global_batch_size",
                     training.global_batch_size, recipe.global_batch_size))
    if dp is not None:
        same.append((f"recipe.global_batch_size / dp ({recipe.global_batch_size} / {dp})",
                     recipe.global_batch_size // dp, "--training.local_batch_size", training.local_batch_size,
                     recipe.global_batch_size // dp))
    for name, ours, flag, theirs, wanted in same:
        if theirs != wanted:
            raise ConfigError(f"torchtitan's job config has {flag} {theirs} but {name}={ours}; the pair must agree: "
                              f"set {flag} {wanted} in recipe.model.stack.job, or change {name}")
    if ours_ddp != theirs_ddp:
        flags = (f"--parallelism.data_parallel_shard_degree {tp.data_parallel_shard_degree} "
                 f"--parallelism.data_parallel_replicate_degree {tp.data_parallel_replicate_degree}")
        fix = (f"--parallelism.data_parallel_shard_degree 1 --parallelism.data_parallel_replicate_degree {dp or '<dp>'}"
               if ours_ddp
               else "--parallelism.data_parallel_shard_degree -1 --parallelism.data_parallel_replicate_degree 1")
        raise ConfigError(f"torchtitan's job config has {flags} ({'ddp' if theirs_ddp else 'fsdp'}) but "
                          f"recipe.parallel.data_parallel={par.data_parallel}; the pair must agree: set {fix} in "
                          "recipe.model.stack.job, or change recipe.parallel.data_parallel")


def _ac_config(recipe: RecipeConfig, options: TitanOptions) -> Any:
    """torchtitan's activation checkpointing: the job config's, which recipe.activation_checkpointing must name (both
    arms run it), or recipe.activation_checkpointing's as torchtitan's FullAC / SelectiveAC. Either wraps each block
    in torch's checkpoint wrapper; ModelParts names modules and parameters without it."""
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    kinds: dict[str, Any] = {ActivationCheckpointing.none.value: type(None),
                             ActivationCheckpointing.full.value: FullAC.Config,
                             ActivationCheckpointing.selective.value: SelectiveAC.Config}
    ours = str(recipe.activation_checkpointing)
    if not options.job:
        return None if ours == ActivationCheckpointing.none.value else kinds[ours]()
    theirs = job_config(options.job).activation_checkpoint
    name = next((kind for kind, cls in kinds.items() if type(theirs) is cls), None)
    if name is None:
        raise ConfigError(f"torchtitan's job config has activation_checkpoint {type(theirs).__qualname__}, which is "
                          "not wired to torchtitan's stack here (it needs torch.compile); use activation_checkpoint:"
                          "full, :selective or :none in recipe.model.stack.job")
    if name != ours:
        raise ConfigError(f"torchtitan's job config has activation_checkpoint:{name} but "
                          f"recipe.activation_checkpointing={ours}; the pair must agree: set activation_checkpoint:"
                          f"{ours} in recipe.model.stack.job, or recipe.activation_checkpointing={name}")
    return copy.deepcopy(theirs)


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
    """torchtitan's Trainer.Config for this arm: the job config's (the seed and the determinism switch set by the
    harness), or one made from the recipe."""
    from torchtitan.config.configs import DebugConfig, ParallelismConfig, TrainingConfig
    from torchtitan.trainer import Trainer

    if options.job:
        config = copy.deepcopy(job_config(options.job))
        config.model_spec = spec
        config.debug.seed, config.debug.deterministic = recipe.seed, deterministic
        return config
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
                          activation_checkpoint=_ac_config(recipe, options))


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
        self._config: Any = None  # torchtitan's Trainer.Config of the last build (the optimizer's and LR schedule's)

    def switch(self, recipe: RecipeConfig, arm_policy: PolicyConfig) -> dict[str, Any]:
        options = TitanOptions.of(recipe.model)
        on = arm_policy.deterministic
        if on:
            _refuse_static_conflicts(options, arm_policy)
        record = {"stack": self.name, "version": _version(), "debug.deterministic": on,
                  "debug.deterministic_warn_only": options.deterministic_warn_only, "debug.seed": recipe.seed,
                  "env": SWITCH_ENV if on else {}, "attn_backend": options.attn_backend,
                  "spmd_backend": options.spmd_backend}
        if options.job:  # what the job config gives, and what the harness set in it on purpose
            job = job_config(options.job)
            record.update({"job": list(options.job), "model": f"{options.family} {options.flavor}",
                           "optimizer": repr(job.optimizer), "lr_scheduler": repr(job.lr_scheduler),
                           "lr_scheduler.steps": _schedule_steps(job),
                           "activation_checkpoint": repr(job.activation_checkpoint),
                           "set_by_taxbench": {"debug.seed": recipe.seed, "debug.deterministic": on}})
        else:
            record.update({"optimizer": f"AdamW from recipe.optimizer (lr {recipe.optimizer.lr}), constant",
                           "activation_checkpoint": str(recipe.activation_checkpointing)})
        return record

    def native_policy(self, recipe: RecipeConfig, name: str) -> PolicyConfig:
        del recipe
        return PolicyConfig(name=name, **SWITCH_FIELDS)

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
        _ac_config(recipe, options)
        if options.job:
            _refuse_job_disagreements(recipe, job_config(options.job))
        spec = _model_config(options)
        # In the command's process, where Hydra sends the root logger to stdout: torchtitan's checkpointer config warns
        # there of defaults taxbench does not use (the ranks run quieted: launchers/worker.py).
        with stacks_quieted():
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
        if options.job:
            _refuse_job_disagreements(recipe, config, ctx.world_size)
        loss_fn = _loss(spec, config)
        pipeline: Any = None
        with _switch_undone(), _torchtitan_on(ctx.device), determinism.active(arm_policy):
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
                                            ac_config=config.activation_checkpoint, dump_folder=dump_folder,
                                            device=ctx.device,
                                            model_config=spec.model, parallelize_fn=spec.parallelize_fn,
                                            loss_fn=loss_fn)
                    parts = list(pipeline[1])
                else:
                    parts = [spec.parallelize_fn(model, parallel_dims=dims, training=config.training,
                                                 parallelism=config.parallelism, compile_config=config.compile,
                                                 ac_config=config.activation_checkpoint,
                                                 dump_folder=dump_folder)]
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
        self._spec, self._dims, self._device, self._config = spec, dims, ctx.device, config
        return RankModel(parallel, None, [], step, None)

    def optimizer(self, recipe: RecipeConfig, model: RankModel) -> torch.optim.Optimizer:
        """torchtitan's OptimizersContainer over the rank's parts (the job's optimizer config, or the recipe's AdamW
        mapped onto it), with the job's LR schedule stepping after each optimizer step (`optimizer.lr_scheduler`,
        which the harness's checkpoint saves beside the optimizer state)."""
        config = self._config
        optimizer = _optimizer_config(recipe, config).build(model_parts=list(model.parts.parts))
        if TitanOptions.of(recipe.model).job:
            schedule = config.lr_scheduler.build(optimizers=optimizer, training_steps=config.training.steps)
            _step_schedule_after(optimizer, schedule, _schedule_steps(config))
        if self._spec.post_optimizer_build_fn is not None:  # MoE: torchtitan's expert-bias load balancing hook
            with _torchtitan_on(self._device):
                self._spec.post_optimizer_build_fn(optimizer, model.parts.parts, self._dims)
        return optimizer


def _optimizer_config(recipe: RecipeConfig, config: Any) -> Any:
    """The job config's optimizer, or taxbench's AdamW settings as torchtitan's (one AdamW group over every
    parameter, torch's default for-loop implementation as taxbench's own stack runs it)."""
    if TitanOptions.of(recipe.model).job:
        return config.optimizer
    from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig

    opt = recipe.optimizer
    kwargs = {"lr": opt.lr, "betas": (opt.beta1, opt.beta2), "eps": opt.eps, "weight_decay": opt.weight_decay}
    return OptimizersContainer.Config(param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW",
                                                                     optimizer_kwargs=kwargs)],
                                      implementation="for-loop")


def _schedule_steps(job: Any) -> int:
    """How many steps torchtitan's LR schedule spans: lr_scheduler.total_steps, else training.steps."""
    total = job.lr_scheduler.total_steps
    return int(total if total is not None else job.training.steps)


def refuse_short_schedule(recipe: RecipeConfig, run_steps: int) -> None:
    """A job whose LR schedule spans fewer steps than a run of the experiment trains would fail in every rank once it
    ran out (_step_schedule_after): refused before launch, naming both counts."""
    options = TitanOptions.of(recipe.model)
    if not options.job:
        return  # taxbench's constant AdamW: no schedule to run out of
    job = job_config(options.job)
    spans = _schedule_steps(job)
    if spans >= run_steps:
        return
    flag = "--lr_scheduler.total_steps" if job.lr_scheduler.total_steps is not None else "--training.steps"
    raise ConfigError(f"torchtitan's job config has {flag} {spans} but a run of this experiment trains up to "
                      f"{run_steps} steps, past the end of its LR schedule; set {flag} {run_steps} (or more) in "
                      "recipe.model.stack.job, or lower experiment.steps")


def _step_schedule_after(optimizer: torch.optim.Optimizer, schedule: Any, steps: int) -> None:
    """Step torchtitan's LR schedule once after every optimizer step, as its Trainer does, and carry it on the
    optimizer for the checkpoint. Past its last step torchtitan's linear decay goes negative, and a run held at a
    zero rate would pass every gate with parameters that no longer move: training past it is an error."""

    def after_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        del opt, args, kwargs
        done = schedule.schedulers[0].last_epoch
        if done >= steps:
            raise RuntimeError(f"torchtitan's LR schedule spans {steps} steps and this run trains past it; raise "
                               "--training.steps (or --lr_scheduler.total_steps) in recipe.model.stack.job to at least "
                               "the steps the experiment trains")
        schedule.step()

    optimizer.register_step_post_hook(after_step)
    optimizer.lr_scheduler = schedule  # type: ignore[attr-defined]


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
