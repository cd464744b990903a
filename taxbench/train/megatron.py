"""Megatron-Core as a training stack: GPU only. Without CUDA a megatron recipe is refused before anything is built.

Its determinism switch (`--deterministic-mode`) sets NCCL_ALGO=Ring (Tree refused), NVTE_ALLOW_NONDETERMINISTIC_ALGO=0
and a cuBLAS workspace, and rejects cross-entropy fusion and tp-comm overlap; the manifest records it beside
taxbench's policy. Building GPTModel (local spec, Transformer Engine where present) with get_forward_backward_func
is not implemented yet: on a GPU the recipe is refused with that reason (scripts/gpu_check.sh runs the refusal and
the import of megatron-core, `taxbench[megatron]`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from taxbench.config.schema import ConfigError, PolicyConfig, RecipeConfig
from taxbench.parallel.distributed import DistContext
from taxbench.train.build import RankModel

TESTED_VERSION = "0.19"
INSTALL_HINT = "pip install 'taxbench[megatron]'"
SWITCH_ENV = {"NCCL_ALGO": "Ring", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def require_megatron() -> None:
    """Refuse in one line: Megatron-Core needs CUDA, and the package from the extra."""
    if not torch.cuda.is_available():
        raise ConfigError(f"recipe.model.kind=megatron needs a CUDA GPU (Megatron-Core is GPU only; torch "
                          f"{torch.__version__} sees none) and {INSTALL_HINT}; note that its GPTModel stack is not "
                          "implemented yet, so on a GPU it is refused too (issue 21)")
    try:
        import megatron.core  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"recipe.model.kind=megatron needs megatron-core {TESTED_VERSION}.x: {INSTALL_HINT} "
                          f"({exc})") from None


class MegatronStack:
    name = "megatron-core"

    def switch(self, recipe: RecipeConfig, arm_policy: PolicyConfig) -> dict[str, Any]:
        del recipe
        on = arm_policy.deterministic
        return {"stack": self.name, "deterministic_mode": on, "env": SWITCH_ENV if on else {}}

    def meta_model(self, recipe: RecipeConfig) -> nn.Module:
        del recipe
        require_megatron()
        raise ConfigError("recipe.model.kind=megatron: the Megatron-Core GPTModel stack is not implemented yet "
                          "(issue 21); only its refusal is")

    def build(self, recipe: RecipeConfig, arm_policy: PolicyConfig, ctx: DistContext, micro_batches: int) -> RankModel:
        del arm_policy, ctx, micro_batches
        self.meta_model(recipe)
        raise AssertionError("unreachable: meta_model refuses")

    def optimizer(self, recipe: RecipeConfig, model: RankModel) -> torch.optim.Optimizer:
        raise ConfigError("recipe.model.kind=megatron is not implemented yet")
