"""Timing a training step and what the process holds: CUDA events on GPU, perf_counter on CPU; Python's garbage
collector kept out of timed blocks; peak memory for the records."""

from __future__ import annotations

import gc
import resource
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


class StepTimer:
    """perf_counter on CPU; CUDA events (read at block end) on GPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def start(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def stop(self, started: Any) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return (started, event)
        return time.perf_counter() - started

    def seconds(self, measured: Any) -> float:
        if self.cuda:
            start, end = measured
            return float(start.elapsed_time(end)) / 1000.0
        return float(measured)


@contextmanager
def collected_between_blocks(manual: bool) -> Iterator[None]:
    """Python's garbage collector run before a timed block and paused inside it (a collection inside a timed step
    costs milliseconds at random; Megatron's --manual-gc does the same). Only the young generations are collected:
    a full collection walks every object of the process (over 100 ms here), and the long-lived ones are the models."""
    if not manual or not gc.isenabled():
        yield
        return
    gc.collect(1)
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def peak_memory(device: torch.device) -> dict[str, int]:
    """This process's peak memory so far (every run it holds counts): CUDA allocated and reserved, or host RSS."""
    if device.type == "cuda":
        return {"mem_peak_bytes": torch.cuda.max_memory_allocated(device),
                "mem_reserved_bytes": torch.cuda.max_memory_reserved(device)}
    return {"mem_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
