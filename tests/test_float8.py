"""recipe.precision=fp8: which layers torchao converts (on the meta device, no GPU needed), and the refusal where
float8 matmuls cannot run. The float8 training step itself is in tests/test_gpu.py (compute capability 8.9+)."""

from __future__ import annotations

import pytest
import torch
from helpers import compose_typed

from taxbench.config.schema import ConfigError, Device
from taxbench.preflight import check_model
from taxbench.stacks.float8 import convert_to_float8, float8_layers, float8_problem
from taxbench.workloads import build_model


def test_linear_layers_become_float8_but_the_head_and_unaligned_layers_stay() -> None:
    pytest.importorskip("torchao")
    with torch.device("meta"):
        model = build_model(compose_typed("+recipe=moe_tiny").recipe.model, deterministic_kernels=True)
    converted = convert_to_float8(model)
    assert "blocks.0.attn.qkv" in converted and "blocks.1.ffn.shared.down" in converted
    kinds = {path: type(module).__name__ for path, module in model.named_modules()}
    assert kinds["blocks.0.attn.qkv"] == "Float8Linear"
    assert kinds["head"] == "Linear"  # the output head stays in high precision
    assert kinds["blocks.0.ffn.router"] == "Linear"  # 64 -> 8 experts: not a multiple of 16


def test_fp8_is_refused_on_cpu_with_the_fix() -> None:
    problem = float8_problem(Device.cpu)
    assert problem is not None and problem.startswith("recipe.precision=fp8")
    assert "bf16" in problem


def test_a_model_with_no_float8_layer_is_refused_rather_than_trained_as_bf16() -> None:
    aligned = compose_typed("+recipe=moe_tiny", "recipe.precision=fp8").recipe
    assert float8_layers(check_model(aligned))
    unaligned = compose_typed("+recipe=moe_tiny", "recipe.precision=fp8", "recipe.model.d_model=40",
                              "recipe.model.n_heads=4", "recipe.model.d_ff=72", "recipe.model.moe_d_ff=72").recipe
    with pytest.raises(ConfigError, match="finds no linear layer to train in float8"):
        check_model(unaligned)
