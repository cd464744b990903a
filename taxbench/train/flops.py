"""Model FLOPs per step, counted once per recipe with torch's FlopCounterMode, and the peak FLOP/s they are held to.

FLOPs are the model's (forward and backward of one micro-batch, times the micro-batches of a global batch): activation
recompute is not counted, as in MFU's usual definition. The model is built on the meta device; a model that cannot run
there (MoE token counts, data-dependent values) is counted on a real host copy when it is small, and left uncounted
otherwise.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from taxbench.config.schema import ClusterConfig, Precision, RecipeConfig
from taxbench.parallel.gpu_hours import PEAK_TFLOPS, peak_key
from taxbench.parallel.plan import planned_model
from taxbench.stacks.registry import foreign_stack, stack_for
from taxbench.workloads import TooLargeForHost, build_model, on_meta_or_host


def _count(recipe: RecipeConfig, device: str) -> int:
    counted = planned_model(recipe.model)
    if foreign_stack(counted):  # a foreign stack's model: on meta
        model = stack_for(counted).meta_model(recipe)
    else:
        with torch.device(device):  # a host count needs values: the MoE routes tokens by them
            model = build_model(counted, deterministic_kernels=True, seed=None if device == "meta" else recipe.seed)
    tokens = torch.zeros(recipe.micro_batch_size, recipe.model.seq_len, dtype=torch.long, device=device)
    with FlopCounterMode(display=False) as counter:
        logits = model(tokens)
        F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten()).backward()
    return int(counter.get_total_flops())


def flops_per_step(recipe: RecipeConfig) -> tuple[float | None, str]:
    """Model FLOPs of one training step of the whole job, and how they were counted (or why not)."""
    micro_batches = recipe.global_batch_size // recipe.micro_batch_size
    counted = planned_model(recipe.model)
    try:
        if foreign_stack(counted):
            flops, device = _count(recipe, "meta"), "meta"
        else:
            flops, device = on_meta_or_host(counted, lambda device: (_count(recipe, device), device))
    except TooLargeForHost as exc:
        return None, f"not counted: {exc}"
    except Exception as exc:  # a foreign stack's model that cannot run on the meta device
        if not foreign_stack(counted):
            raise
        return None, f"not counted: {type(exc).__name__} on the meta device"
    where = "the meta device" if device == "meta" else "a host copy"
    of = ", taxbench's dense GPT of the same shape" if counted is not recipe.model else ""
    return float(flops * micro_batches), f"FlopCounterMode on {where}{of}"


def peak_flops(cluster: ClusterConfig, precision: Precision, device_name: str | None) -> tuple[float | None, str]:
    """Peak FLOP/s of one device: cluster.peak_tflops if set, else the table by device name; None on CPU."""
    if cluster.peak_tflops > 0:
        return cluster.peak_tflops * 1e12, "cluster.peak_tflops"
    if cluster.device.value != "cuda" or not device_name:
        return None, "MFU does not apply on CPU"
    key = peak_key(precision)
    for name, peaks in PEAK_TFLOPS.items():
        if name in device_name:
            return peaks[key] * 1e12, f"{name} {key} datasheet peak"
    return None, f"no peak known for {device_name!r}; set cluster.peak_tflops"


def throughput_manifest(recipe: RecipeConfig, cluster: ClusterConfig) -> dict[str, Any]:
    """What the analysis turns into tokens/s, TFLOP/s and MFU: per-step work and the peak it is held to."""
    device_name = torch.cuda.get_device_name() if cluster.device.value == "cuda" and torch.cuda.is_available() else None
    flops, counted = flops_per_step(recipe)
    peak, peak_source = peak_flops(cluster, recipe.precision, device_name)
    return {
        "tokens_per_step": recipe.global_batch_size * recipe.model.seq_len,
        "flops_per_step": flops,
        "flops_counted": counted,
        "peak_flops_per_device": peak,
        "peak_source": peak_source,
    }
