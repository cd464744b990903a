"""Per-op profile of training steps: where each op's own time goes, per step, for per-op attribution of the tax.

`profile_steps` runs a trainer's block under torch.profiler and keeps key_averages' self time and call count of every
op, divided by the steps profiled. Self time (an op's time minus its children's) adds up to the step without counting
a parent and its children twice, so the growth of one op between two arms is its share of the tax
(taxbench.analysis.attribution). Shapes and stacks are not recorded, to keep the profiler's own cost per op small.

A table holds host rows (device "cpu": self CPU time of aten ops, autograd nodes and record_function ranges) and, on
CUDA, device rows (device "cuda": self device time of each kernel, memcpy and memset, by kernel name). Its `device` is
where a step's time is spent, "cpu" or "cuda": the rows attribution compares by default.

The profiled block is a real block of the run: its steps are recorded and advance the trainer like any other, and
their step times include the profiler's overhead. It profiles all of run_block, so the harness's work outside the
timed step (data loading, fingerprints) is in the table too, alike in both arms.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import pandas as pd

from taxbench.rundir.op_table import DEVICES, OpTable

if TYPE_CHECKING:
    from taxbench.train.trainer import Trainer

def profile_ops(run: Callable[[], None], steps: int, device: str) -> OpTable:
    """Run `run` (which executes `steps` steps) under torch.profiler and return its ops' self time and calls per
    step. `device` is "cpu" or "cuda": on CUDA kernels are recorded too, by name, with their device time."""
    if device not in DEVICES:
        raise ValueError(f"cannot profile ops on device {device!r}; supported: {DEVICES}")
    if steps < 1:
        raise ValueError(f"profile at least one step, got {steps}")
    # Imported here: analysis reads op tables through this module and should not pay torch's 2 s import for it.
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    # Kineto (read when the profiler starts) would print a "USDT: profiler_start/stop" line per profiled block into
    # the progress display; a level the user set is kept.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    with profile(activities=activities, record_shapes=False, with_stack=False, profile_memory=False,
                 with_flops=False, with_modules=False) as profiler:
        run()
    rows = []
    for event in profiler.key_averages():
        if event.device_type == DeviceType.CPU:
            rows.append((event.key, "cpu", event.self_cpu_time_total, event.count))
        elif event.device_type == DeviceType.CUDA and not event.is_user_annotation:
            # A record_function range is mirrored on the GPU timeline as an annotation spanning its kernels: its
            # device time is theirs again.
            rows.append((event.key, "cuda", event.self_device_time_total, event.count))
    ops = pd.DataFrame(rows, columns=["op", "device", "self_us", "calls"])
    ops = ops.groupby(["op", "device"], as_index=False, sort=True)[["self_us", "calls"]].sum()
    table = pd.DataFrame({
        "op": ops["op"].astype(str),
        "device": ops["device"].astype(str),
        "self_us_per_step": ops["self_us"].astype(float) / steps,
        "calls_per_step": ops["calls"].astype(float) / steps,
    })
    return OpTable(table, steps, device)


def profile_steps(trainer: Trainer, steps: int, block: int, on_step: Callable[[], None] | None = None) -> OpTable:
    """Run `trainer.run_block(steps, block, on_step)` under torch.profiler: per-op self time and calls per step (see
    the module docstring for what the table covers)."""
    device = trainer.ctx.device.type
    return profile_ops(lambda: trainer.run_block(steps, block, on_step), steps, device)
