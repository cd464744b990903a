"""Whether a forward is activation recompute's replay: what a model with once-per-forward side effects asks.

Activation recompute (taxbench.parallel.recompute) is applied from outside the model; a forward that accumulates a
statistic (the MoE aux loss) must still count it once, so it asks `recomputing()`. The flag lives beside the models
that read it, below the parallel layer that sets it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

_RECOMPUTING: ContextVar[bool] = ContextVar("taxbench_recomputing", default=False)


def recomputing() -> bool:
    """True while the backward reruns a checkpointed block's forward (its side effects already happened once)."""
    return _RECOMPUTING.get()


@contextmanager
def recompute_flag(value: bool) -> Iterator[None]:
    token = _RECOMPUTING.set(value)
    try:
        yield
    finally:
        _RECOMPUTING.reset(token)
