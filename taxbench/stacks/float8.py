"""recipe.precision=fp8: the model's linear layers train in float8 through torchao (convert_to_float8_training,
tensorwise scaling, as torchtitan's float8 converter), the rest under bf16 autocast.

torchao's float8 matmuls (torch._scaled_mm) run on CUDA GPUs of compute capability 8.9 or newer (Ada, Hopper,
Blackwell); elsewhere the recipe is refused before launch (`float8_problem`). The output head stays in high precision,
and layers whose dimensions are not multiples of 16 (what _scaled_mm needs) are left alone.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

from taxbench.config.schema import Device

MIN_CAPABILITY = (8, 9)
_SKIPPED_MODULES = ("head",)


def float8_problem(device: Device, check_gpu: bool = True) -> str | None:
    """Why recipe.precision=fp8 cannot run here (None when it can). `check_gpu=False` for a job that runs on other
    machines (Slurm): only the software is checked."""
    if importlib.util.find_spec("torchao") is None:
        return "recipe.precision=fp8 needs torchao (pip install torchao); use recipe.precision=bf16 without it"
    if device is not Device.cuda:
        return (f"recipe.precision=fp8 trains float8 linears with torchao on CUDA GPUs of compute capability "
                f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}+; cluster.device={device.value} cannot: use "
                "recipe.precision=bf16 or fp32 here")
    if check_gpu and torch.cuda.is_available():
        capability = torch.cuda.get_device_capability()
        if capability < MIN_CAPABILITY:
            return (f"recipe.precision=fp8 needs a GPU of compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}+ "
                    f"(H100, L4, B200); {torch.cuda.get_device_name()} is {capability[0]}.{capability[1]}: use "
                    "recipe.precision=bf16")
    return None


def _float8_eligible(module: nn.Module, path: str) -> bool:
    if not isinstance(module, nn.Linear) or path.rsplit(".", 1)[-1] in _SKIPPED_MODULES:
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def convert_to_float8(model: nn.Module) -> list[str]:
    """Swap the eligible linear layers for torchao's Float8Linear in place; the paths converted."""
    from torchao.float8 import convert_to_float8_training  # optional dependency: checked by float8_problem

    converted = float8_layers(model)
    convert_to_float8_training(model, module_filter_fn=_float8_eligible)
    return converted


def float8_layers(model: nn.Module) -> list[str]:
    """The paths of the linear layers recipe.precision=fp8 trains in float8."""
    return [path for path, module in model.named_modules() if _float8_eligible(module, path)]
