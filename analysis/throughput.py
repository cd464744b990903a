"""Training metrics per arm, as torchtitan and Megatron log them: tokens/s, TFLOP/s and MFU, peak memory, the
data-loading share; and the tax as what it costs (tokens/s lost, device-hours per day of training)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pandas as pd

from taxbench.rundir.step_record import DATA_S, MEM_PEAK_BYTES, TIME_S


@dataclass(frozen=True)
class ArmThroughput:
    tokens_per_s: float  # the whole job, at the arm's steady-state median step
    tokens_per_s_per_device: float
    tflops_per_device: float | None  # None: the model's FLOPs were not counted
    mfu: float | None  # None on CPU or without a known peak
    peak_memory_bytes: int | None  # the largest over ranks: CUDA max allocated, or host peak RSS (every run held)
    data_share: float  # median share of a step's wall time spent loading its batches (outside the timed step)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


THROUGHPUT_FIELDS = [DATA_S, TIME_S, MEM_PEAK_BYTES]  # the record fields arm_throughput reads


def arm_throughput(frames: list[pd.DataFrame], median_step_s: float, world: int,
                   throughput: dict[str, Any] | None) -> ArmThroughput | None:
    """The arm's metrics from its timed runs' records; None without the manifest's per-step work (older runs)."""
    if not throughput or not math.isfinite(median_step_s) or median_step_s <= 0:
        return None
    records = pd.concat(frames) if frames else pd.DataFrame()
    tokens_per_s = throughput["tokens_per_step"] / median_step_s
    flops = throughput.get("flops_per_step")
    tflops = flops / world / median_step_s / 1e12 if flops else None
    peak = throughput.get("peak_flops_per_device")
    mfu = tflops * 1e12 / peak if tflops is not None and peak else None
    memory = records[MEM_PEAK_BYTES].dropna() if MEM_PEAK_BYTES in records else pd.Series(dtype=float)
    share = math.nan
    if {DATA_S, TIME_S} <= set(records.columns) and not records.empty:
        share = float(np.median(records[DATA_S] / (records[DATA_S] + records[TIME_S])))
    return ArmThroughput(
        tokens_per_s=tokens_per_s,
        tokens_per_s_per_device=tokens_per_s / world,
        tflops_per_device=tflops,
        mfu=mfu,
        peak_memory_bytes=int(memory.max()) if not memory.empty else None,
        data_share=share,
    )


def cost_of_tax(baseline: ArmThroughput | None, deterministic: ArmThroughput | None, tax: float,
                world: int) -> dict[str, float | None]:
    """What the tax costs: tokens/s lost, and device-hours per day of training spent on it at this world size."""
    lost = baseline.tokens_per_s - deterministic.tokens_per_s if baseline and deterministic else None
    return {
        "tokens_per_s_lost": lost,
        "device_hours_per_day": tax * world * 24 if math.isfinite(tax) else None,
    }
