"""The parallel shape: the degrees a parallel config takes on a world of ranks, computed in one place.

Like torchtitan's ParallelDims: world = pp * dp * tp, with the expert-parallel group carved out of data parallel
(dp = edp * ep, as in Megatron). The schema's layout rules, the plan, the trainer's layout, preflight and the stacks
read dp, edp and the model-parallel size from here rather than dividing the world themselves. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class ParallelDegrees(Protocol):
    """What the shape reads of a parallel config (taxbench.config.schema.ParallelConfig)."""

    tp: int
    pp: int
    ep: int


@dataclass(frozen=True)
class ParallelShape:
    world: int
    tp: int
    pp: int
    ep: int

    @classmethod
    def of(cls, parallel: ParallelDegrees, world: int) -> ParallelShape:
        return cls(world, parallel.tp, parallel.pp, parallel.ep)

    @property
    def model_parallel(self) -> int:
        """Ranks one model replica spans: tp * pp."""
        return self.tp * self.pp

    @property
    def stage_world(self) -> int:
        """Ranks of one pipeline stage: dp * tp."""
        return self.world // self.pp

    @property
    def dp(self) -> int:
        """Data-parallel degree: world / (tp * pp) (0 when the world holds no whole replica)."""
        return self.world // self.model_parallel

    @property
    def edp(self) -> int:
        """Expert-data-parallel degree: the data-parallel ranks that hold the same experts (dp / ep)."""
        return self.dp // self.ep

    @property
    def fits_world(self) -> bool:
        """Whether the world splits into whole replicas."""
        return self.world % self.model_parallel == 0

    @property
    def fits(self) -> bool:
        """Whether the world splits into whole replicas and ep divides dp."""
        return self.fits_world and self.dp % self.ep == 0

    def micro_batches(self, global_batch: int, micro_batch: int) -> int | None:
        """Micro-batches per step on each data-parallel rank, or None when the global batch does not split evenly."""
        per_step = micro_batch * self.dp
        if not self.fits_world or not per_step or global_batch % per_step:
            return None
        return global_batch // per_step
