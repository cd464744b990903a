"""What Hydra says about the job this process runs: a multirun or not, its point number, the overrides given."""

from __future__ import annotations

from hydra.core.hydra_config import HydraConfig


def is_multirun() -> bool:
    return HydraConfig.initialized() and HydraConfig.get().mode.name == "MULTIRUN"


def overridden(key: str) -> bool:
    """Whether the command line sets `key` (as key=..., +key=... or ++key=...)."""
    return any(o.lstrip("+~").partition("=")[0] == key for o in HydraConfig.get().overrides.task)


def multirun_point() -> int | None:
    """The point number of this job in a multirun (its points share experiment.name), else None."""
    return HydraConfig.get().job.num if is_multirun() else None
