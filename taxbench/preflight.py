"""Every check that runs before a rank starts, in one place above the schema and the parts it checks.

A bad input must stop here, with exit 2 and one line naming the key, the value and what is accepted, and before the
experiment folder exists. Beyond the schema's cross-field rules (taxbench.config.schema.validate) this builds the model
on the meta device (factory, shape and vocabulary errors), opens the token shards, checks the device and the output
folder, and checks that an injected fault or a trace selection names something that exists.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

import torch
from omegaconf import DictConfig
from torch import nn

from taxbench.config.layout_rules import layout_problems
from taxbench.config.pairing import validate_pair
from taxbench.config.policy import audit
from taxbench.config.schema import (
    ConfigError,
    DataKind,
    Device,
    FaultKind,
    Launcher,
    ModelKind,
    Precision,
    RecipeConfig,
    TaxbenchConfig,
    load_config,
    max_steps,
    validate,
    world_size,
)
from taxbench.config.shape import ParallelShape
from taxbench.datasets.shards import ShardError
from taxbench.datasets.source import check_shard_recipe
from taxbench.design import design_of
from taxbench.diagnostics import logger
from taxbench.parallel.layout import layout_for, tensor_parallel_plan
from taxbench.parallel.pipeline import stage_holding, stage_split
from taxbench.parallel.recompute import apply_activation_checkpointing
from taxbench.runtime.determinism import validate_on_this_build
from taxbench.stacks.deepspeed import DeepSpeedOptions, refuse_disagreements
from taxbench.stacks.float8 import float8_layers, float8_problem
from taxbench.stacks.registry import foreign_stack, stack_for
from taxbench.stacks.titan import refuse_short_schedule
from taxbench.workloads import TooLargeForHost, build_model, on_meta_or_host

log = logger(__name__)


def prepare(raw: DictConfig) -> TaxbenchConfig:
    """The one conversion of Hydra's config: resolved and typed once, then checked before anything launches. This
    typed config is what every launcher hands its ranks (pickled to the local ranks, submitit or torchrun's control
    group)."""
    cfg = with_stack_native_arms(load_config(raw))
    if cfg.cluster.dry_run and cfg.cluster.launcher is not Launcher.slurm:
        raise ConfigError(f"cluster.dry_run=true writes a Slurm job script without submitting it, but "
                          f"cluster={cfg.cluster.name} runs here; use cluster=slurm with it, or plan=true for the plan "
                          "without running")
    check_before_launch(cfg)
    return cfg


def with_stack_native_arms(cfg: TaxbenchConfig) -> TaxbenchConfig:
    """Each stack-native arm (mode=stack_native) as what the training stack's own switch sets, and nothing of
    taxbench's policy (the stack's TrainingStack.native_policy)."""
    if not any(p.stack_native for p in cfg.arms.values()):
        return cfg
    stack = stack_for(cfg.recipe.model)
    arms = {name: replace(stack.native_policy(cfg.recipe, name), stack_native=True) if p.stack_native else p
            for name, p in cfg.arms.items()}
    return replace(cfg, arms=arms)


def stack_native_audits(cfg: TaxbenchConfig) -> dict[str, list[str]]:
    """Per stack-native arm: what taxbench's full policy would add or change over the stack's own switch."""
    stack = stack_for(cfg.recipe.model).name
    return {name: audit(p, stack) for name, p in cfg.arms.items() if p.stack_native}


def check_before_launch(cfg: TaxbenchConfig) -> None:
    """Raise ConfigError for anything that would fail once the ranks run."""
    check_device(cfg)  # first: without the GPUs asked for, the layout errors below would only confuse
    check_precision(cfg)
    validate(cfg)
    validate_pair(cfg)
    for arm_policy in cfg.arms.values():
        validate_on_this_build(arm_policy, cfg.cluster.device)
    check_data(cfg.recipe, world_size(cfg.cluster))
    model = check_model(cfg.recipe)
    check_model_parallel(cfg.recipe, model)
    for arm_policy in cfg.arms.values():  # the stack's own determinism switch must agree with each arm's policy
        stack_for(cfg.recipe.model).switch(cfg.recipe, arm_policy)
    check_stack_run(cfg)
    check_fault_and_trace(cfg, model)
    check_out_dir(Path(cfg.experiment.out_dir))


def check_stack_run(cfg: TaxbenchConfig) -> None:
    """What a stack's own config says about this experiment that its ranks would only fail on: a DeepSpeed config
    whose batch sizes disagree with the recipe at this world size, a torchtitan LR schedule shorter than a run."""
    recipe, exp = cfg.recipe, cfg.experiment
    if recipe.model.kind == ModelKind.deepspeed:
        refuse_disagreements(recipe, DeepSpeedOptions.of(recipe.model), world_size(cfg.cluster))
    if recipe.model.kind == ModelKind.titan:
        profile = exp.warmup_steps + exp.profile_steps if design_of(cfg).profiled else 0
        refuse_short_schedule(recipe, max(max_steps(exp), profile))


def check_device(cfg: TaxbenchConfig) -> None:
    cluster = cfg.cluster
    if cluster.launcher == Launcher.slurm:
        return  # a Slurm job runs on the cluster's nodes, not on the submitting machine
    if cluster.device == Device.cpu:
        _check_cpu_can_hold_a_replica(cfg)
        return
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if available == 0:
        raise ConfigError(
            f"cluster.device=cuda but this machine has no usable CUDA GPU (torch {torch.__version__}); use "
            "cluster.device=cpu here, or cluster=slurm to run on GPU nodes"
        )
    if cluster.launcher == Launcher.local and cluster.gpus > available:
        raise ConfigError(f"cluster.gpus={cluster.gpus} but this machine has {available} GPU(s); use "
                          f"cluster.gpus<={available}, or cluster=slurm for more")


def check_precision(cfg: TaxbenchConfig) -> None:
    if cfg.recipe.precision is Precision.fp8:
        problem = float8_problem(cfg.cluster.device, check_gpu=cfg.cluster.launcher is not Launcher.slurm)
        if problem:
            raise ConfigError(problem)


def _check_cpu_can_hold_a_replica(cfg: TaxbenchConfig) -> None:
    """A recipe whose model replica spans more ranks (tp*pp) than this machine has cores is for a GPU cluster: there
    the fix is a plan or a Slurm job, not another cluster.cpu_ranks."""
    recipe, ranks = cfg.recipe, cfg.cluster.cpu_ranks
    replica, cores = ParallelShape.of(recipe.parallel, ranks).model_parallel, os.cpu_count() or 1
    if replica <= cores or not layout_problems(recipe, ranks):
        return
    raise ConfigError(f"recipe {recipe.name} is a GPU-cluster recipe: one model replica spans tp*pp = {replica} "
                      f"ranks, more than this machine's {cores} CPU cores, so it cannot run on cluster.cpu_ranks="
                      f"{ranks}; with N GPUs (a multiple of {replica}), plan it here with `+recipe={recipe.name} "
                      "cluster.gpus=N plan=true`, or write its Slurm job with `cluster=slurm cluster.gpus=N "
                      "cluster.dry_run=true`")


def check_data(recipe: RecipeConfig, world: int) -> None:
    data = recipe.data
    if data.kind != DataKind.shards:
        return
    dp = max(ParallelShape.of(recipe.parallel, world).dp, 1)
    try:
        check_shard_recipe(data, recipe.model.vocab_size, recipe.model.seq_len, recipe.micro_batch_size, dp)
    except (ShardError, ImportError) as exc:
        raise ConfigError(f"recipe.data.path={data.path}: {exc}") from exc


def check_model(recipe: RecipeConfig) -> nn.Module:
    """Build the model on the meta device (no memory); a custom model must also map tokens to [batch, seq, vocab]."""
    try:
        model = stack_for(recipe.model).meta_model(recipe)
    except ConfigError:
        raise
    except Exception as exc:  # a factory or a shape problem inside the model's constructor
        raise ConfigError(f"recipe.model: building the model failed: {_one_line(exc)}") from exc
    if recipe.model.kind == ModelKind.custom:
        _check_logits(recipe, model)
    if recipe.precision is Precision.fp8 and not float8_layers(model):
        raise ConfigError("recipe.precision=fp8 finds no linear layer to train in float8 (in and out features must "
                          "be multiples of 16; the output head stays): it would train in bf16; resize the model or "
                          "use recipe.precision=bf16")
    if foreign_stack(recipe.model):
        return model  # the stack applies its own activation checkpointing
    apply_activation_checkpointing(model, recipe.activation_checkpointing)  # a model without blocks is refused
    return model


def check_model_parallel(recipe: RecipeConfig, model: nn.Module) -> None:
    """tp>1 shards the model's taxbench attention and MLP blocks (a foreign stack shards its own): a model without
    them, a custom one, is refused here rather than inside every rank (where it failed with exit 1). ep and pp of a
    custom model are refused with the layout (taxbench.config.layout_rules.layout_problems)."""
    if recipe.parallel.tp == 1 or foreign_stack(recipe.model):
        return
    try:
        tensor_parallel_plan(model)
    except ConfigError:
        target = recipe.model.factory.get("_target_") if recipe.model.kind == ModelKind.custom else None
        what = f"recipe.model.factory._target_={target!r}" if target else f"recipe.model.kind={recipe.model.kind}"
        raise ConfigError(f"recipe.parallel.tp={recipe.parallel.tp} shards taxbench's attention and MLP blocks, and "
                          f"{what} ({type(model).__name__}) has none; set recipe.parallel.tp=1") from None


def _check_logits(recipe: RecipeConfig, model: nn.Module) -> None:
    batch, seq, vocab = recipe.micro_batch_size, recipe.model.seq_len, recipe.model.vocab_size
    target = recipe.model.factory.get("_target_")
    try:
        logits = on_meta_or_host(recipe.model, lambda device: _forward(
            model if device == "meta" else build_model(recipe.model, deterministic_kernels=True), batch, seq, device))
    except TooLargeForHost as exc:
        log.warning("recipe.model.factory._target_=%r: logits not checked before launch: %s", target, exc)
        return
    except Exception as exc:
        raise ConfigError(f"recipe.model.factory._target_={target!r}: the forward pass on a [{batch}, {seq}] token "
                          f"batch failed: {_one_line(exc)}") from exc
    if not isinstance(logits, torch.Tensor):
        raise ConfigError(f"recipe.model.factory._target_={target!r} returns {type(logits).__name__}; taxbench needs "
                          f"a logits tensor [batch, seq, vocab] = [{batch}, {seq}, {vocab}]")
    if tuple(logits.shape) != (batch, seq, vocab):
        hint = (f"; set recipe.model.vocab_size={logits.shape[-1]} or fix the model's vocabulary"
                if logits.dim() == 3 and tuple(logits.shape[:2]) == (batch, seq) else "")
        raise ConfigError(f"recipe.model.factory._target_={target!r} returns logits of shape {list(logits.shape)}, "
                          f"expected [batch, seq, vocab] = [{batch}, {seq}, {vocab}]{hint}")


def _forward(model: nn.Module, batch: int, seq: int, device: str) -> object:
    with torch.no_grad():
        return model(torch.zeros(batch, seq, dtype=torch.long, device=device))


def check_fault_and_trace(cfg: TaxbenchConfig, model: nn.Module) -> None:
    """An injected fault or a trace filter that matches nothing would make a self-test that tests nothing."""
    modules = [name for name, _ in model.named_modules() if name]
    fault, trace = cfg.experiment.fault, cfg.experiment.trace
    if fault.enabled and fault.kind == FaultKind.nondeterministic_op:
        if fault.module not in modules:
            raise ConfigError(f"experiment.fault.module={fault.module!r} is not a module of recipe "
                              f"{cfg.recipe.name}; choose one of: {_sample(modules)}")
        _check_module_on_fault_rank(cfg, fault.module or "")
        if not _matching_ops([fault.op or ""]):
            raise ConfigError(f"experiment.fault.op={fault.op!r} matches no ATen op; give one such as "
                              "aten.mm.default or a pattern such as 'aten.index_put_*'")
    if fault.enabled and fault.kind == FaultKind.perturb_collective:
        _check_collective_on_fault_rank(cfg)
    if trace.enabled:
        for pattern in trace.modules:
            if not any(fnmatch.fnmatchcase(name, pattern) for name in modules):
                raise ConfigError(f"experiment.trace.modules: {pattern!r} matches no module of recipe "
                                  f"{cfg.recipe.name}; modules are: {_sample(modules)}")
        missing = [p for p in trace.ops if not _matching_ops([p])]
        if missing:
            raise ConfigError(f"experiment.trace.ops: {missing[0]!r} matches no ATen op; use names such as "
                              "aten.mm.default or patterns such as 'aten.index_put_*'")


def _check_collective_on_fault_rank(cfg: TaxbenchConfig) -> None:
    """perturb_collective flips a gradient all-reduce result (data parallel) or, without one, an activation that the
    fault rank's pipeline stage receives: the first pipeline rank receives none."""
    rank = cfg.experiment.fault.rank
    layout = layout_for(cfg.recipe.parallel, world_size(cfg.cluster), rank)
    if layout.dp > 1 or layout.pp == 1:
        return
    if all(stage == 0 for stage in stage_split(cfg.recipe, layout.pp_rank).stages):
        raise ConfigError(f"experiment.fault.rank={rank} holds only the first pipeline stage and no data-parallel "
                          "all-reduce: perturb_collective has nothing to perturb there; pick a rank of a later stage")


def _check_module_on_fault_rank(cfg: TaxbenchConfig, module: str) -> None:
    """Under pipeline parallelism the fault's module must be on a stage that the fault rank holds."""
    rank = cfg.experiment.fault.rank
    layout = layout_for(cfg.recipe.parallel, world_size(cfg.cluster), rank)
    if layout.pp == 1:
        return
    split = stage_split(cfg.recipe, layout.pp_rank)
    stage = stage_holding(split, module)
    if stage is not None and stage not in split.stages:
        raise ConfigError(f"experiment.fault.module={module!r} is on pipeline stage {stage}, but "
                          f"experiment.fault.rank={rank} holds stages {list(split.stages)}; pick a rank of stage "
                          f"{stage}")


def _matching_ops(patterns: Iterable[str]) -> list[str]:
    """Fully qualified op overload names ("aten.mm.default") matching any of the fnmatch patterns."""
    names = []
    for qualified in torch._C._dispatch_get_all_op_names():
        namespace, _, op = qualified.partition("::")
        try:
            overloads = getattr(getattr(torch.ops, namespace), op).overloads()
        except (AttributeError, RuntimeError):
            continue
        names += [f"{namespace}.{op}.{overload}" for overload in overloads]
    return [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)]


def check_out_dir(out_dir: Path) -> None:
    """experiment.out_dir must be a folder we can create and write in (it need not exist yet)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"experiment.out_dir={out_dir} is a file, not a folder; choose a folder")
    existing = next(p for p in (out_dir.absolute(), *out_dir.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"experiment.out_dir={out_dir}: {existing} is a file, not a folder; choose another out_dir")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"experiment.out_dir={out_dir}: {existing} is not writable (permissions or a read-only "
                          "file system); choose a writable folder")


def _sample(names: list[str], limit: int = 12) -> str:
    return ", ".join(names[:limit]) + (", ..." if len(names) > limit else "")


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}"
