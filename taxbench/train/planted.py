"""A planted tax: a known slowdown of every deterministic step, the tax estimator's self-test.

The delay is a fraction of the arm's own step time (not a fixed time), spent inside the timed step after the
optimizer step. On CPU it is a busy wait of that fraction of the step's own unplanted time, so every planted step
takes exactly (1 + fraction) times what it would have, whatever the machine's drift. On GPU the step's time is not
known while it is being queued: a spin kernel (torch.cuda._sleep) on the step's stream runs for the fraction of the
run's running median step time. The true tax of an A/A pair (both arms on the baseline policy) is then the planted
fraction.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from typing import Any

import torch

WINDOW = 64  # unplanted step times the running median is taken over


def busy_wait(seconds: float) -> None:
    """Spin (not sleep: a sleeping thread would give its core away and change what is measured)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class SpinKernel:
    """torch.cuda._sleep spins for a number of GPU clock cycles; its rate is measured once with CUDA events."""

    CALIBRATION_CYCLES = 50_000_000

    def __init__(self, device: torch.device) -> None:
        self.device = device
        torch.cuda._sleep(1000)  # load the kernel before timing it
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(self.CALIBRATION_CYCLES)
        end.record()
        end.synchronize()
        self.cycles_per_s = self.CALIBRATION_CYCLES / (start.elapsed_time(end) / 1000.0)

    def spin(self, seconds: float) -> None:
        cycles = int(seconds * self.cycles_per_s)
        if cycles > 0:
            torch.cuda._sleep(cycles)


class PlantedDelay:
    """Adds `fraction` x this step's unplanted time (CPU) or x the running median of the run's unplanted step
    times (GPU: read from CUDA events when a block's records are flushed, so it lags by up to one block and the
    first block plants nothing) to every step it is asked to."""

    def __init__(self, fraction: float, device: torch.device) -> None:
        self.fraction = fraction
        self.unplanted: deque[float] = deque(maxlen=WINDOW)
        self.spinner = SpinKernel(device) if device.type == "cuda" else None

    def _median(self) -> float:
        return statistics.median(self.unplanted) if self.unplanted else 0.0

    def apply(self, started: Any) -> tuple[float, Any]:
        """Spin for the planted share of a step that began at `started` (the step timer's start); returns the
        planted seconds and a mark to read the unplanted time from (seconds on CPU, an event on GPU)."""
        if self.spinner is None:
            planted = self.fraction * (time.perf_counter() - started)
            busy_wait(planted)
            return planted, None
        mark = torch.cuda.Event(enable_timing=True)
        mark.record()
        planted = self.fraction * self._median()
        self.spinner.spin(planted)
        return planted, mark

    def observe(self, started: Any, mark: Any) -> None:
        """GPU: the unplanted time of a finished step (events from the step timer's start to the mark)."""
        if mark is not None:
            self.unplanted.append(started.elapsed_time(mark) / 1000.0)
