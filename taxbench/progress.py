"""Console progress for long work (rank 0 only): steps done, steps/s and time left.

A live bar on a terminal; a plain line every 10% when output goes to a log file.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, Task, TextColumn, TimeRemainingColumn
from rich.table import Column
from rich.text import Text


class StepRateColumn(ProgressColumn):
    """Units (steps) per second; rich has no speed until it has seen two updates, so the first frames show a
    placeholder."""

    def __init__(self, unit: str = "steps") -> None:
        super().__init__()
        self.unit = unit

    def render(self, task: Task) -> Text:
        speed = task.speed
        return Text(f"   --- {self.unit}/s" if speed is None else f"{speed:>6.1f} {self.unit}/s")


class StepProgress:
    """What the experiment reports: one step done, a grown total (a precision target adds rounds), and what runs."""

    def __init__(self, advance: Callable[[], None], grow_to: Callable[[int], None] = lambda total: None,
                 describe: Callable[[str], None] = lambda what: None) -> None:
        self.advance, self.grow_to, self.describe = advance, grow_to, describe


IDLE = StepProgress(lambda: None)


@contextmanager
def step_progress(total: int, description: str, enabled: bool = True, unit: str = "steps") -> Iterator[StepProgress]:
    """Progress over `total` units of work (steps of an experiment; ops of a scan)."""
    if not enabled or total <= 0:
        yield IDLE
        return
    console = Console(file=sys.stderr)
    if console.is_terminal:
        # The description gives way first (an ellipsis), so that counts, rate and ETA fit an 80-column terminal.
        columns = (
            TextColumn("{task.description}", table_column=Column(ratio=1, no_wrap=True, overflow="ellipsis")),
            BarColumn(bar_width=20),
            MofNCompleteColumn(),
            StepRateColumn(unit),
            TimeRemainingColumn(),
        )
        with Progress(*columns, console=console, transient=True, expand=True) as bar:
            task = bar.add_task(description, total=total)
            yield StepProgress(lambda: bar.advance(task), lambda grown: bar.update(task, total=grown),
                               lambda what: bar.update(task, description=f"{description}: {what}"))
        return

    start, done, next_report, running = time.perf_counter(), 0, max(1, total // 10), ""

    def advance() -> None:
        nonlocal done, next_report
        done += 1
        if done >= next_report or done == total:
            elapsed = time.perf_counter() - start
            rate = done / elapsed if elapsed > 0 else 0.0
            eta = (total - done) / rate if rate > 0 else 0.0
            line = f"{description}{running}: {done}/{total} {unit}, {rate:.1f} {unit}/s, ETA {eta:.0f}s"
            print(line, file=sys.stderr, flush=True)
            next_report += max(1, total // 10)

    def grow_to(grown: int) -> None:
        nonlocal total
        total = max(total, grown)

    def describe(what: str) -> None:
        nonlocal running
        running = f" ({what})"

    yield StepProgress(advance, grow_to, describe)
