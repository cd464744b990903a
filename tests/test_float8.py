"""recipe.precision=fp8: which layers torchao converts (on the meta device, no GPU needed), and the refusal where
float8 matmuls cannot run. The float8 training step itself is in tests/test_gpu.py (compute capability 8.9+)."""

from __future__ import annotations

import pytest
import torch
from conftest import compose_typed

from taxbench.config.schema import Device
from taxbench.train.float8 import convert_to_float8, float8_problem
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
