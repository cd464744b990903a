"""A planted tax: a known slowdown of every deterministic step, the tax estimator's self-test.

The delay is a fraction of the arm's own step time (not a fixed time), spent inside the timed step after the
optimizer step: a wait on CPU, a spin kernel (torch.cuda._sleep) on the step's stream on GPU. Its length is the
fraction of the step's own unplanted time on CPU (known when the wait starts); on GPU, whose step times are read
from CUDA events only when a block's records are flushed, the fraction of the run's running median unplanted step
time, agreed by all ranks at the start of each block (the mean of their medians), so every rank spins the same
duration and none waits in the next collective for another's longer spin; the first block plants nothing. (A running
median on CPU overplanted while steps still got faster: +54% for a planted 50% over 60 steps.)

On CPU the wait must last what it is asked, also on a loaded machine. A busy wait to a deadline does not: a process
spinning through its time slice is preempted by the other jobs and resumes after its deadline (a 3 ms spin took
4.8-5.0 ms, median, with two other busy processes on this 2-core machine; a planted 10% came out as +14-18%). So the
wait sleeps and spins only its last WAIT_SPIN_S (a woken sleeper is scheduled promptly, and holds no core it does not
use), and what a wait still overruns is taken off the following waits, so that the planted time adds up to what was
asked. planted_s records the time actually waited. The true tax of an A/A pair (both arms on the baseline policy) is
then the planted fraction.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from typing import Any

import torch
import torch.distributed as dist

WINDOW = 64  # unplanted step times the running median is taken over


WAIT_SPIN_S = 0.0005  # the end of a CPU wait is spun: sleeping to the deadline would end late by a wake-up


def wait_for(seconds: float) -> None:
    """Sleep, then spin the last WAIT_SPIN_S, until `seconds` have passed (see the module docstring)."""
    end = time.perf_counter() + seconds
    if seconds > WAIT_SPIN_S:
        time.sleep(seconds - WAIT_SPIN_S)
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
    """Adds `fraction` x the step's own unplanted time (CPU) or x the running median of the run's unplanted step
    times as agreed for the block (GPU, `agree`) to every step it is asked to (see the module docstring)."""

    def __init__(self, fraction: float, device: torch.device) -> None:
        self.fraction = fraction
        self.device = device
        self.unplanted: deque[float] = deque(maxlen=WINDOW)  # GPU: the last steps' unplanted times (observe)
        self.spinner = SpinKernel(device) if device.type == "cuda" else None
        self.agreed: float | None = None  # this block's median unplanted step time, the same on every rank
        self.overrun = 0.0  # CPU: seconds waited beyond what was planted so far (taken off the next waits)

    def _median(self) -> float:
        return statistics.median(self.unplanted) if self.unplanted else 0.0

    def agree(self, world_size: int) -> None:
        """Fix the median this block plants from: the mean over ranks of their running medians (a collective of the
        default group when world_size > 1; call it on every rank, outside the timed steps)."""
        if self.spinner is None or not self.unplanted:  # CPU plants from each step's own time
            self.agreed = None
            return
        median = self._median()
        if world_size > 1 and dist.is_initialized():
            total = torch.tensor([median], dtype=torch.float64, device=self.device)
            dist.all_reduce(total)
            median = float(total.item()) / world_size
        self.agreed = median

    def apply(self, started: Any) -> tuple[float, Any]:
        """Wait (CPU) or spin (GPU) for the planted share of a step that began at `started` (the step timer's
        start); returns the planted seconds (CPU: as waited) and a mark to read the unplanted time from (None on CPU,
        an event on GPU)."""
        if self.spinner is None:
            began = time.perf_counter()
            planted = self.fraction * (began - started)  # exact on CPU: the step's own time, known here
            wait_for(max(planted - self.overrun, 0.0))
            waited = time.perf_counter() - began
            self.overrun += waited - planted
            return waited, None
        mark = torch.cuda.Event(enable_timing=True)
        mark.record()
        planted = self.fraction * (self.agreed or 0.0)
        self.spinner.spin(planted)
        return planted, mark

    def observe(self, started: Any, mark: Any) -> None:
        """GPU: the unplanted time of a finished step (events from the step timer's start to the mark)."""
        if mark is not None:
            self.unplanted.append(started.elapsed_time(mark) / 1000.0)
