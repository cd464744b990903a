"""DeepSpeed as a training stack: its engine (ZeRO stage 1-3), its optimizer step with gradient accumulation and
clipping, its MoE layer with expert parallelism, its checkpoint and its determinism switch.

The model is taxbench's GPT (taxbench.workloads.dense) from the recipe's model fields; an MoE recipe (n_experts > 0)
puts DeepSpeed's own `deepspeed.moe.layer.MoE` (top-k gate, expert parallelism over ep_size = recipe.parallel.ep)
in every block's FFN, its load-balancing loss added with recipe.model.aux_loss_coef. `deepspeed.initialize` builds the
engine from the recipe: `recipe.model.stack.zero_stage`, the micro-batch size and gradient accumulation the harness
computes, gradient clipping (recipe.optimizer.grad_clip), AdamW (DeepSpeed's torch AdamW: the fused CPU Adam op is not
built), bf16 or fp32. Initial values are torch's defaults from recipe.seed (not layout invariant).

A user's own DeepSpeed JSON (`recipe.model.stack.config`: a mapping, or the path of a ds_config.json) is deep-merged
over taxbench's config: its other keys reach the engine as it wrote them, but a key that the recipe also decides (ZeRO
stage, batch sizes, precision, clipping, the optimizer, the switch) must agree with the recipe, or the pair is refused
before launch naming both values (`refuse_disagreements`); neither is picked. The manifest's stack_switch records what
the built engine received, read back from it (`EngineStep.received`), not what taxbench meant to hand it.

What DeepSpeed owns here (taxbench.stacks.step.OwnedStep): the step (`engine.backward` per micro-batch,
`engine.step` reducing, clipping and stepping at the accumulation boundary) and the checkpoint (`save_checkpoint` /
`load_checkpoint`, which is what a DeepSpeed user resumes with). DeepSpeed's client_state is read back from rank 0's
file only, so each rank's RNG streams and data position go beside it in `rank<R>.pt`. Fingerprints cover what each
rank holds under ZeRO: its fp32 partitions of the master weights, their gradients (as the optimizer receives them)
and the optimizer state over them. What stays the harness's: the data, the timer marks, fingerprints, gates.

The switch: DeepSpeed's `deterministic_mode` JSON key where the installed DeepSpeed's config knows it (read from its
config class, not its version: no release up to 0.19.8 has it) and the device is CUDA (the key raises elsewhere by
design); otherwise the equivalent DeepSpeed documents for it (strict deterministic algorithms, TF32 off, cuDNN
deterministic with benchmark off, CUBLAS_WORKSPACE_CONFIG validated), applied as a policy. The manifest's
stack_switch says which. Not driven: tensor and pipeline parallelism, DeepSpeed's launcher and its fused ops.
On CPU DeepSpeed needs DS_ACCELERATOR=cpu before its import; it is set here when CUDA is absent.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import json
import logging
import os
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from taxbench.checkpoint.state import extras_path
from taxbench.config.schema import ConfigError, DataParallel, ModelConfig, PolicyConfig, Precision, RecipeConfig
from taxbench.config.shape import ParallelShape
from taxbench.diagnostics import logger
from taxbench.parallel.distributed import DistContext
from taxbench.parallel.layout import ParallelModel, layout_for
from taxbench.rundir.records import write_atomically
from taxbench.runtime import determinism
from taxbench.stacks.protocol import RankModel, refuse_conflicts, refuse_unknown_options
from taxbench.stacks.step import Batch, cross_entropy, numbered_partitions
from taxbench.workloads.dense import GPT, MLP

log = logger(__name__)

TESTED_VERSION = "0.19.8"
INSTALL_HINT = "DS_BUILD_OPS=0 pip install 'taxbench[deepspeed]'"
TAG = "deepspeed"  # the checkpoint's tag: <checkpoint dir>/deepspeed/
# What DeepSpeed's deterministic_mode documents that it does (its tutorial "deterministic-mode"), as taxbench's policy
# fields: the equivalent applied where the installed DeepSpeed lacks the key. It changes no NCCL algorithm and no
# Transformer Engine setting, and fills no uninitialized memory.
SWITCH_FIELDS = {"deterministic": True, "cudnn_benchmark": False, "allow_tf32": False,
                 "cublas_workspace_config": ":4096:8", "nccl_algo": None, "nvte_allow_nondeterministic_algo": True,
                 "fill_uninitialized_memory": False, "deterministic_kernels": False}


DEFAULT_ZERO_STAGE = 2
AUTO = "auto"  # Hugging Face's ds_config.json convention: "fill this in from the training arguments" (the recipe)


@dataclass(frozen=True)
class DeepSpeedOptions:
    zero_stage: int | None = None  # None: the user config's zero_optimization.stage, else DEFAULT_ZERO_STAGE
    capacity_factor: float = 1.0  # DeepSpeed MoE's token capacity per expert
    config: dict[str, Any] = field(default_factory=dict)  # the user's DeepSpeed JSON, deep-merged over taxbench's

    @classmethod
    def of(cls, model: ModelConfig) -> DeepSpeedOptions:
        refuse_unknown_options("DeepSpeed", cls, model.stack)
        options = cls(**{**model.stack, "config": user_config(model.stack.get("config", {}))})
        if options.stage not in (1, 2, 3) or isinstance(options.stage, bool):
            # Stage 0 steps a plain torch optimizer, whose engine reports no global gradient norm: every record's
            # grad_norm would be NaN, and the run "diverged".
            raise ConfigError(f"{options.stage_key}={options.stage}: choose 1, 2 or 3 (stage 0's engine reports no "
                              "gradient norm to fingerprint)")
        return options

    @property
    def stage(self) -> Any:
        """The ZeRO stage the engine gets: recipe.model.stack.zero_stage, else the user config's, else 2."""
        if self.zero_stage is not None:
            return self.zero_stage
        theirs = _leaf(self.config, ("zero_optimization", "stage"))
        return DEFAULT_ZERO_STAGE if theirs in (None, AUTO) else theirs

    @property
    def stage_key(self) -> str:
        """Where the stage comes from, as a refusal names it."""
        if self.zero_stage is None and _leaf(self.config, ("zero_optimization", "stage")) not in (None, AUTO):
            return "recipe.model.stack.config's zero_optimization.stage"
        return "recipe.model.stack.zero_stage" + ("" if self.zero_stage is not None else " (default)")


def user_config(value: Any) -> dict[str, Any]:
    """recipe.model.stack.config as a DeepSpeed JSON mapping: given inline, or read from a ds_config.json path
    (relative to the folder taxbench is started in)."""
    if isinstance(value, Mapping):
        return _plain(value)
    if not isinstance(value, str):
        raise ConfigError(f"recipe.model.stack.config={value!r}: give DeepSpeed JSON as a mapping or the path of a "
                          "ds_config.json")
    path = Path(value).expanduser()
    try:
        loaded = json.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"recipe.model.stack.config={value}: cannot read {path.absolute()} ({exc.strerror}); give "
                          "the path of a DeepSpeed ds_config.json, or the config as a mapping") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"recipe.model.stack.config={value}: not JSON ({exc}); give the path of a DeepSpeed "
                          "ds_config.json") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"recipe.model.stack.config={value}: holds a JSON {type(loaded).__name__}, DeepSpeed's "
                          "config is a JSON object")
    return loaded


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _leaf(config: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    """The value at `path` in a nested config, or None where the path is absent."""
    node: Any = config
    for key in path:
        if not isinstance(node, Mapping) or key not in node:
            return None
        node = node[key]
    return node


def deep_merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """`over` merged into `base` key by key at every depth (a mapping in both is merged, any other value of `over`
    replaces base's); "auto" in `over` keeps base's value."""
    merged = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        elif not (value == AUTO and key in merged):
            merged[key] = _plain(value)
    return merged


@dataclass(frozen=True)
class Decided:
    """A DeepSpeed config key that the recipe decides: where in the recipe, the recipe's value there, and the value
    DeepSpeed must get for it."""

    path: tuple[str, ...]
    recipe_key: str
    recipe_value: Any
    wanted: Any

    def agrees(self, theirs: Any) -> bool:
        if theirs == AUTO:
            return True
        if isinstance(self.wanted, str) and isinstance(theirs, str):
            return theirs.lower() == self.wanted.lower()  # DeepSpeed reads optimizer names case-insensitively
        if isinstance(self.wanted, bool) or isinstance(theirs, bool):
            return theirs is self.wanted
        return bool(theirs == self.wanted)


def decided_keys(recipe: RecipeConfig, options: DeepSpeedOptions, world: int | None) -> list[Decided]:
    """Every DeepSpeed config key that the recipe decides (and taxbench sets from it). `world`: the world size, when
    known (gradient accumulation depends on it)."""
    opt, precision = recipe.optimizer, str(recipe.precision)
    bf16 = precision == Precision.bf16.value
    keys = [
        Decided(("zero_optimization", "stage"), options.stage_key, options.stage, options.stage),
        Decided(("train_micro_batch_size_per_gpu",), "recipe.micro_batch_size", recipe.micro_batch_size,
                recipe.micro_batch_size),
        Decided(("train_batch_size",), "recipe.global_batch_size", recipe.global_batch_size,
                recipe.global_batch_size),
        Decided(("gradient_clipping",), "recipe.optimizer.grad_clip", opt.grad_clip, opt.grad_clip),
        Decided(("bf16", "enabled"), "recipe.precision", precision, bf16),
        Decided(("bfloat16", "enabled"), "recipe.precision", precision, bf16),  # DeepSpeed's alias of bf16
        Decided(("fp16", "enabled"), "recipe.precision", precision, False),
        Decided(("optimizer", "type"), "taxbench's optimizer (recipe.optimizer)", "AdamW", "AdamW"),
        Decided(("optimizer", "params", "lr"), "recipe.optimizer.lr", opt.lr, opt.lr),
        Decided(("optimizer", "params", "betas"), "recipe.optimizer.beta1/beta2", [opt.beta1, opt.beta2],
                [opt.beta1, opt.beta2]),
        Decided(("optimizer", "params", "eps"), "recipe.optimizer.eps", opt.eps, opt.eps),
        Decided(("optimizer", "params", "weight_decay"), "recipe.optimizer.weight_decay", opt.weight_decay,
                opt.weight_decay),
    ]
    if world is not None:
        dp = max(ParallelShape.of(recipe.parallel, world).dp, 1)
        accumulation = recipe.global_batch_size // (recipe.micro_batch_size * dp)
        shown = f"{accumulation} ({recipe.global_batch_size} / ({recipe.micro_batch_size} * {dp}))"
        keys.append(Decided(("gradient_accumulation_steps",),
                            "recipe.global_batch_size / (recipe.micro_batch_size * dp)", shown, accumulation))
    return keys


def refuse_disagreements(recipe: RecipeConfig, options: DeepSpeedOptions, world: int | None = None) -> None:
    """Refuse, in one line naming both values, a key of the user's DeepSpeed config that the recipe decides
    otherwise: both arms must run the recipe, and picking either value would hide that the two differ."""
    user = options.config
    if "deterministic_mode" in user:
        value = json.dumps(user["deterministic_mode"])
        raise ConfigError(f"recipe.model.stack.config has deterministic_mode={value}, but DeepSpeed's switch is set "
                          "per arm by taxbench (mode@arms.deterministic); drop deterministic_mode from the config")
    for key in decided_keys(recipe, options, world):
        theirs = _leaf(user, key.path)
        if theirs is None or key.agrees(theirs):
            continue
        dotted = ".".join(key.path)
        raise ConfigError(f"recipe.model.stack.config has {dotted}={json.dumps(theirs)} but {key.recipe_key}="
                          f"{key.recipe_value}; the two disagree and neither is picked: drop {dotted} from the config "
                          f"or make the two agree")


def require_layout(recipe: RecipeConfig, options: DeepSpeedOptions) -> None:
    """Refuse, in one line, what this adapter or DeepSpeed does not drive (see the module docstring)."""
    par, model = recipe.parallel, recipe.model
    if par.pp > 1 or par.tp > 1:
        raise ConfigError(f"recipe.model.kind=deepspeed runs ZeRO data parallelism and expert parallelism here "
                          f"(recipe.parallel.tp={par.tp}, pp={par.pp}); set recipe.parallel.tp=1 and pp=1")
    if str(par.data_parallel) == DataParallel.fsdp.value:
        raise ConfigError("recipe.model.kind=deepspeed shards with ZeRO (recipe.model.stack.zero_stage); set "
                          "recipe.parallel.data_parallel=ddp")
    if par.ep > 1 and model.n_experts == 0:
        raise ConfigError(f"recipe.parallel.ep={par.ep} needs an MoE model; set recipe.model.n_experts")
    if model.n_experts and (model.top_k not in (1, 2) or model.n_experts % par.ep):
        raise ConfigError(f"DeepSpeed's MoE takes top_k 1 or 2 and ep dividing n_experts (recipe.model.top_k="
                          f"{model.top_k}, n_experts={model.n_experts}, recipe.parallel.ep={par.ep})")
    if model.n_experts and options.stage == 3:
        # DeepSpeed's engine asserts "Native DeepSpeed MoE is not supported with ZeRO Stage 3" at initialize.
        raise ConfigError(f"{options.stage_key}=3 with an MoE model (recipe.model.n_experts={model.n_experts}): "
                          "DeepSpeed's own MoE layer is not supported at ZeRO stage 3 (its engine asserts it); set "
                          "recipe.model.stack.zero_stage=1 or 2")
    if model.n_shared_experts:
        raise ConfigError("recipe.model.n_shared_experts is not wired to DeepSpeed's MoE; set it to 0")
    if str(recipe.precision) not in (Precision.fp32.value, Precision.bf16.value):
        raise ConfigError(f"recipe.precision={recipe.precision} is not wired to DeepSpeed's stack; use fp32 or bf16")


def require_deepspeed() -> Any:
    """DeepSpeed, imported for this device (refused in one line with the install line when it is missing)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
    except ImportError as exc:
        raise ConfigError(f"recipe.model.kind=deepspeed needs DeepSpeed (tested {TESTED_VERSION}): {INSTALL_HINT} "
                          f"({exc})") from None
    return deepspeed


def knows_deterministic_mode() -> bool:
    """Whether the installed DeepSpeed's config reads the `deterministic_mode` key (from its config class's code)."""
    from deepspeed.runtime import config as ds_config

    try:
        return "deterministic_mode" in inspect.getsource(ds_config)
    except (OSError, TypeError):  # no source shipped: the key cannot be vouched for
        return False


def switch_policy(name: str) -> PolicyConfig:
    """DeepSpeed's deterministic_mode as taxbench's policy fields (what a stack-native arm runs)."""
    return PolicyConfig(name=name, **SWITCH_FIELDS)


def _version() -> str:
    try:
        return version("deepspeed")
    except PackageNotFoundError:
        return "not installed"


class MoEFeedForward(nn.Module):
    """DeepSpeed's MoE layer as a block's FFN: its experts are taxbench's MLP; the gate's load-balancing loss of the
    last forward is kept for the step's loss."""

    def __init__(self, model: ModelConfig, ep: int, capacity_factor: float) -> None:
        super().__init__()
        from deepspeed.moe.layer import MoE

        self.moe = MoE(model.d_model, MLP(model.d_model, model.moe_d_ff or model.d_ff), num_experts=model.n_experts,
                       ep_size=ep, k=model.top_k, capacity_factor=capacity_factor,
                       eval_capacity_factor=capacity_factor)
        self.aux: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, self.aux, _ = self.moe(x)
        return out

    def collectives_within(self) -> dict[str, tuple[str, list[int] | None]]:
        """For the tracing ladder (taxbench.tracing.capture.communicating_modules): DeepSpeed's MOELayer sends tokens
        to their experts' ranks and back with all-to-all over its expert-parallel group."""
        layer = self.moe.deepspeed_moe
        if layer.ep_size <= 1:
            return {}
        group = None if layer.ep_group is None else sorted(dist.get_process_group_ranks(layer.ep_group))
        return {"moe.deepspeed_moe": ("all_to_all", group)}


def build_gpt(recipe: RecipeConfig, options: DeepSpeedOptions) -> nn.Module:
    model = recipe.model
    if not model.n_experts:
        return GPT(model)
    return GPT(model, lambda: MoEFeedForward(model, recipe.parallel.ep, options.capacity_factor))


def engine_config(recipe: RecipeConfig, options: DeepSpeedOptions, deterministic_key: bool,
                  batch: Mapping[str, int] | None = None) -> dict[str, Any]:
    """DeepSpeed's JSON config for the recipe (with `batch`, the batch sizes: `batch_config`), the user's config
    deep-merged over it. Keys the two both set agree (refuse_disagreements runs first)."""
    opt = recipe.optimizer
    config: dict[str, Any] = {
        **(batch or {}),
        "gradient_clipping": opt.grad_clip,
        "optimizer": {"type": "AdamW", "params": {"lr": opt.lr, "betas": [opt.beta1, opt.beta2], "eps": opt.eps,
                                                  "weight_decay": opt.weight_decay, "torch_adam": True}},
        "zero_optimization": {"stage": options.stage},
        "bf16": {"enabled": str(recipe.precision) == Precision.bf16.value},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if deterministic_key:
        config["deterministic_mode"] = True
    return deep_merge(config, options.config)


def batch_config(recipe: RecipeConfig, micro_batches: int, world: int) -> dict[str, int]:
    """The harness's batch sizes as DeepSpeed's: its micro-batch per rank, accumulated over `micro_batches`."""
    return {"train_micro_batch_size_per_gpu": recipe.micro_batch_size, "gradient_accumulation_steps": micro_batches,
            "train_batch_size": recipe.micro_batch_size * micro_batches * world}


def received_config(engine: Any) -> dict[str, Any]:
    """What the built engine received, read back from it: the JSON it was given (`engine.config`) and what its
    DeepSpeedConfig made of it (ZeRO stage, precision, clipping, batch sizes, optimizer)."""
    return {
        "zero_stage": int(engine.zero_optimization_stage()),
        "bf16": bool(engine.bfloat16_enabled()),
        "fp16": bool(engine.fp16_enabled()),
        "gradient_clipping": engine.gradient_clipping(),
        "train_batch_size": engine.train_batch_size(),
        "train_micro_batch_size_per_gpu": engine.train_micro_batch_size_per_gpu(),
        "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
        "optimizer": engine.optimizer_name(),
        "optimizer_params": _plain(engine.optimizer_params()),
        "config": _plain(engine.config),
    }


def _init_distributed(ctx: DistContext) -> None:
    """DeepSpeed's communication over the harness's process group (created at launch). Its engine reads the rank
    from the environment as its own launcher sets it."""
    import deepspeed

    for name, value in (("RANK", ctx.rank), ("LOCAL_RANK", ctx.local_rank), ("WORLD_SIZE", ctx.world_size)):
        os.environ.setdefault(name, str(value))
    # DeepSpeed's own logger writes to stdout, which carries the verdict: its warnings go to stderr instead.
    for handler in deepspeed.utils.logger.handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)
    if not deepspeed.comm.is_initialized():
        with _prints_logged(ctx):
            deepspeed.init_distributed(dist_backend=ctx.backend, rank=ctx.rank, world_size=ctx.world_size)


@contextlib.contextmanager
def _prints_logged(ctx: DistContext) -> Iterator[None]:
    """What DeepSpeed print()s on every rank while building ("DeepSpeed ... shm_comm_op built successfully", "No
    existing process group found, creating a new group named: ep_size_2") as taxbench debug lines, not on stdout."""
    said = io.StringIO()
    try:
        with contextlib.redirect_stdout(said):
            yield
    finally:
        for line in said.getvalue().splitlines():
            if line.strip():
                log.debug("DeepSpeed on rank %d: %s", ctx.rank, line)


class EngineStep:
    """The DeepSpeed engine's step and checkpoint as the trainer drives them (taxbench.stacks.step.OwnedStep)."""

    def __init__(self, engine: Any, model: nn.Module, aux_loss_coef: float, device: torch.device) -> None:
        self.engine, self.model, self.device = engine, model, device
        self.aux_loss_coef = aux_loss_coef
        self.zero = engine.optimizer  # DeepSpeed's ZeRO optimizer around the torch one
        self.inner: torch.optim.Optimizer = getattr(self.zero, "optimizer", self.zero)
        self._grads: list[torch.Tensor] = []
        self._moe = [m for m in model.modules() if isinstance(m, MoEFeedForward)]
        # ZeRO 1/2 step one parameter group at a time: keep each group's gradients (references, no copy).
        self.inner.register_step_pre_hook(self._keep_grads)

    def received(self) -> dict[str, Any]:
        """What the engine received, read back from it after the build (the manifest's stack_switch)."""
        read_back = received_config(self.engine)
        return {"zero_stage": read_back["zero_stage"], "config": read_back.pop("config"),
                "engine": {"read_back": "from the built engine (engine.config and its DeepSpeedConfig)", **read_back}}

    def _keep_grads(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        self._grads += [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]

    def optimize(self, batches: list[Batch], optimizer_step: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        if not optimizer_step:
            raise ConfigError("DeepSpeed's engine reduces gradients inside its step; a step without the optimizer "
                              "step is not available for recipe.model.kind=deepspeed")
        self._grads = []
        total = torch.zeros((), device=self.device)
        for inputs, targets in batches:
            loss = cross_entropy(self.engine(inputs), targets)
            for layer in self._moe:
                if layer.aux is not None:
                    loss = loss + self.aux_loss_coef * layer.aux.float()
            self.engine.backward(loss)  # scaled by 1/gradient_accumulation_steps inside
            self.engine.step()  # reduces, clips and steps at the accumulation boundary only
            total += loss.detach().float()
        norm = self.engine.get_global_grad_norm()
        grad_norm = torch.as_tensor(norm if norm is not None else float("nan"), dtype=torch.float32)
        return total / len(batches), grad_norm

    def _partitions(self) -> list[torch.Tensor]:
        groups = getattr(self.zero, "single_partition_of_fp32_groups", None)  # ZeRO 1 and 2
        if groups is None:
            groups = getattr(self.zero, "fp32_partitioned_groups_flat", None)  # ZeRO 3
        assert groups is not None, "ZeRO 1-3 hold fp32 partitions (stage 0 is refused before launch)"
        return list(groups)

    def gradients(self) -> list[torch.Tensor]:
        return list(self._grads)

    def parameters(self) -> list[torch.Tensor]:
        return self._partitions()

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        return numbered_partitions(self.parameters())

    def held_tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return self.gradients(), self.parameters()

    def optimizer_tensors(self) -> Iterator[torch.Tensor]:
        for param in self._partitions():
            for _, value in sorted(self.inner.state.get(param, {}).items()):
                if isinstance(value, torch.Tensor):
                    yield value

    def save(self, directory: Path, extras: dict[str, Any], rank: int) -> list[Path]:
        """DeepSpeed's checkpoint in `directory`/deepspeed (a collective) and this rank's extras beside it; the files
        this rank lists (rank 0 lists DeepSpeed's, every rank its own extras)."""
        directory.mkdir(parents=True, exist_ok=True)
        self.engine.save_checkpoint(str(directory), tag=TAG)
        write_atomically(extras_path(directory, rank), lambda handle: torch.save(extras, handle))
        if dist.is_initialized():
            dist.barrier()
        files = [extras_path(directory, rank)]
        if rank == 0:
            files += sorted(p for p in directory.rglob("*") if p.is_file() and not p.name.startswith("rank"))
        return files

    def load(self, directory: Path, rank: int, map_location: torch.device) -> dict[str, Any]:
        path, _ = self.engine.load_checkpoint(str(directory), tag=TAG)
        if path is None:
            raise RuntimeError(f"DeepSpeed found no checkpoint under {directory / TAG}")
        extras: dict[str, Any] = torch.load(extras_path(directory, rank), map_location=map_location,
                                            weights_only=False)
        return extras


class DeepSpeedStack:
    name = "deepspeed"

    def switch(self, recipe: RecipeConfig, arm_policy: PolicyConfig) -> dict[str, Any]:
        require_deepspeed()
        options = DeepSpeedOptions.of(recipe.model)
        require_layout(recipe, options)
        refuse_disagreements(recipe, options)
        on = arm_policy.deterministic
        key = on and knows_deterministic_mode() and torch.cuda.is_available()
        if not on:
            applied = None
        elif key:
            applied = "deepspeed deterministic_mode key"
        else:
            why = ("this DeepSpeed's config has no deterministic_mode key" if not knows_deterministic_mode()
                   else "DeepSpeed's deterministic_mode raises off NVIDIA CUDA")
            applied = f"documented equivalent ({why}): {_equivalent_text()}"
        return {"stack": self.name, "version": _version(), "zero_stage": options.stage,
                "deterministic_mode": applied, "arm": _arm_text(arm_policy),
                "moe": "deepspeed.moe.layer.MoE" if recipe.model.n_experts else None,
                "checkpoint": "deepspeed save_checkpoint/load_checkpoint (tag deepspeed); RNG streams and data "
                              "position per rank in rank<R>.pt beside it",
                # What taxbench hands the engine, but the batch sizes; the manifest replaces it with what the built
                # engine received (EngineStep.received).
                "config": engine_config(recipe, options, key)}

    def native_policy(self, recipe: RecipeConfig, name: str) -> PolicyConfig:
        del recipe
        return switch_policy(name)

    def meta_model(self, recipe: RecipeConfig) -> nn.Module:
        require_deepspeed()
        options = DeepSpeedOptions.of(recipe.model)
        require_layout(recipe, options)
        with torch.device("meta"):
            return build_gpt(recipe, options)

    def build(self, recipe: RecipeConfig, arm_policy: PolicyConfig, ctx: DistContext, micro_batches: int) -> RankModel:
        deepspeed = require_deepspeed()
        options = DeepSpeedOptions.of(recipe.model)
        require_layout(recipe, options)
        refuse_disagreements(recipe, options, ctx.world_size)
        _init_distributed(ctx)
        key = arm_policy.deterministic and knows_deterministic_mode() and ctx.device.type == "cuda"
        with determinism.active(arm_policy):
            refuse_conflicts(self.name, arm_policy, {})
            torch.manual_seed(recipe.seed)
            model = build_gpt(recipe, options).to(ctx.device)
            params: Any = model.parameters()
            if recipe.model.n_experts:
                from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

                params = split_params_into_different_moe_groups_for_optimizer(
                    {"params": list(model.parameters()), "name": "parameters"})
            config = engine_config(recipe, options, key, batch_config(recipe, micro_batches, ctx.world_size))
            with _prints_logged(ctx):
                engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=config)
        layout = layout_for(recipe.parallel, ctx.world_size, ctx.rank)
        parallel = ParallelModel([model], [engine], layout, None, None, [])
        step = EngineStep(engine, model, recipe.model.aux_loss_coef, ctx.device)
        return RankModel(parallel, None, [], step, None, engine=step)

    def optimizer(self, recipe: RecipeConfig, model: RankModel) -> torch.optim.Optimizer:
        del recipe
        assert isinstance(model.engine, EngineStep)
        return model.engine.inner  # the torch optimizer inside DeepSpeed's (its state is what each rank holds)


def _arm_text(arm_policy: PolicyConfig) -> str:
    if arm_policy.stack_native:
        return "the stack's own switch only (stack-native)"
    if arm_policy.deterministic:
        return f"the switch under taxbench's {arm_policy.name} policy, which it agrees with"
    return f"switch off: taxbench's {arm_policy.name} policy (not deterministic)"


def _equivalent_text() -> str:
    return ("use_deterministic_algorithms, TF32 off, cudnn.deterministic on and benchmark off, "
            "CUBLAS_WORKSPACE_CONFIG validated")
