"""Model zoo: each workload maps token ids [batch, seq] to logits [batch, seq, vocab].

A model may expose `aux_loss()` returning a scalar tensor (e.g. MoE load balancing) that the trainer adds to the loss.
Initial values: taxbench's own workloads are built on the meta device and get their values from
taxbench.workloads.init (layout invariant: the same global weights under any parallel layout), either whole
(`build_model(..., seed=)`) or as one rank's share (taxbench.parallel.materialize).

Custom models use Hydra's `_target_` convention: `recipe.model.kind=custom` and `recipe.model.factory` a node such as
`{_target_: my_pkg.models.build, width: 512, vocab_size: ${recipe.model.vocab_size}}`; `hydra.utils.instantiate`
calls the factory with the other keys as keyword arguments and it must return such an nn.Module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from torch import nn

from taxbench.config.schema import ConfigError, ModelConfig, ModelKind
from taxbench.workloads.dense import build_dense
from taxbench.workloads.init import initialize
from taxbench.workloads.moe import build_moe

Builder = Callable[[ModelConfig, bool], nn.Module]
T = TypeVar("T")

# A model whose forward cannot run on the meta device is run on a real host copy up to this size.
HOST_COPY_MAX_PARAMS = 50_000_000

BUILDERS: dict[ModelKind, Builder] = {ModelKind.dense: build_dense, ModelKind.moe: build_moe}


def _build_custom(cfg: ModelConfig) -> nn.Module:
    if not cfg.factory or "_target_" not in cfg.factory:
        raise ConfigError(
            "recipe.model.kind=custom needs recipe.model.factory with a _target_, e.g. "
            "'+recipe.model.factory={_target_: my_pkg.models.build}'"
        )
    target = cfg.factory["_target_"]
    try:
        model = instantiate(cfg.factory, _convert_="all")
    except InstantiationException as exc:
        reason = str(exc).split(", set env var HYDRA_FULL_ERROR")[0]  # our errors are one line; the hint is noise
        raise ConfigError(f"recipe.model.factory._target_={target!r} could not be instantiated: {reason}") from exc
    if not isinstance(model, nn.Module):
        raise ConfigError(f"recipe.model.factory._target_={target!r} returned {type(model).__name__}, not an nn.Module")
    return model


def own_workload(cfg: ModelConfig) -> bool:
    """Whether the recipe's model is one of taxbench's (built on meta, layout-invariant initial values)."""
    return cfg.kind in (ModelKind.dense, ModelKind.moe, ModelKind.dense.value, ModelKind.moe.value)


def use_deterministic_kernels(model: nn.Module, deterministic_kernels: bool) -> None:
    """Switch a built model's fixed-order kernel paths on or off (a model shared by both arms switches per block)."""
    for module in model.modules():
        if isinstance(getattr(module, "deterministic_kernels", None), bool):
            module.deterministic_kernels = deterministic_kernels


def build_model(cfg: ModelConfig, deterministic_kernels: bool, seed: int | None = None) -> nn.Module:
    """Build the recipe's model; `deterministic_kernels` selects fixed-order paths where a model has fast ones.

    taxbench's own workloads come on the meta device, or on the CPU with their initial values when `seed` is given;
    a custom model comes as its factory makes it."""
    try:
        kind = ModelKind(cfg.kind)
    except ValueError:
        raise ConfigError(
            f"recipe.model.kind={cfg.kind!r} is unknown; choose one of {[k.value for k in ModelKind]}"
        ) from None
    if kind is ModelKind.custom:
        return _build_custom(cfg)
    with torch.device("meta"):
        model = BUILDERS[kind](cfg, deterministic_kernels)
    return model if seed is None else initialize(model, seed)


class TooLargeForHost(Exception):
    """The model's forward failed on the meta device, and the model is too large for a real host copy."""

    def __init__(self, meta_error: Exception, params: int) -> None:
        super().__init__(f"{type(meta_error).__name__}: {' '.join(str(meta_error).split())[:200]} on the meta device, "
                         f"and at {params} parameters the model is too large to run on the host")
        self.meta_error, self.params = meta_error, params


def on_meta_or_host(cfg: ModelConfig, attempt: Callable[[str], T]) -> T:
    """`attempt("meta")`, or `attempt("cpu")` on a host copy when the meta device cannot run the model: any error
    there counts (an op without a meta kernel raises NotImplementedError, a data-dependent value such as the
    `.item()` in transformers' masks a RuntimeError). A model above HOST_COPY_MAX_PARAMS raises TooLargeForHost."""
    try:
        return attempt("meta")
    except Exception as meta_error:
        with torch.device("meta"):
            params = sum(p.numel() for p in build_model(cfg, deterministic_kernels=True).parameters())
        if params > HOST_COPY_MAX_PARAMS:
            raise TooLargeForHost(meta_error, params) from meta_error
    return attempt("cpu")
