"""Model zoo: each workload maps token ids [batch, seq] to logits [batch, seq, vocab].

A model may expose `aux_loss()` returning a scalar tensor (e.g. MoE load balancing) that the trainer adds to the loss.
Custom models: `recipe.model.kind=custom recipe.model.target=my_pkg.my_module.factory`, where
`factory(model_cfg, **recipe.model.kwargs)` returns such an nn.Module.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from torch import nn

from taxbench.config import ConfigError, ModelConfig
from taxbench.workloads.dense import build_dense

Builder = Callable[[ModelConfig, bool], nn.Module]

BUILDERS: dict[str, Builder] = {"dense": build_dense}


def _load_factory(target: str) -> Callable[..., nn.Module]:
    module_name, _, attr = target.rpartition(".")
    if not module_name:
        raise ConfigError(f"recipe.model.target={target!r} must be a dotted path like 'my_pkg.models.build'")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"recipe.model.target={target!r} cannot be imported: {exc}") from exc
    if not callable(factory):
        raise ConfigError(f"recipe.model.target={target!r} is not callable")
    return factory


def build_model(cfg: ModelConfig, deterministic_kernels: bool) -> nn.Module:
    """Build the recipe's model; `deterministic_kernels` selects fixed-order paths where a model has fast ones."""
    if cfg.kind == "custom":
        if not cfg.target:
            raise ConfigError("recipe.model.kind=custom needs recipe.model.target=<module.factory>")
        model = _load_factory(cfg.target)(cfg, **cfg.kwargs)
        if not isinstance(model, nn.Module):
            raise ConfigError(f"recipe.model.target={cfg.target!r} returned {type(model).__name__}, not an nn.Module")
        return model
    if cfg.kind not in BUILDERS:
        raise ConfigError(
            f"recipe.model.kind={cfg.kind!r} is unknown; choose one of {sorted(BUILDERS) + ['custom']}"
        )
    return BUILDERS[cfg.kind](cfg, deterministic_kernels)
