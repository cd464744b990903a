"""Sample order and read position of a token-shard stream, shared by every loader backend.

Epoch e visits a permutation of all samples drawn from numpy's PCG64 seeded with (seed, e). The permutation is cut
into global batches of micro_batch*dp_size slots (a ragged tail is dropped for that epoch only, since the next epoch
permutes again); data-parallel rank r takes every dp_size-th slot starting at r. So the samples of a batch depend only
on (seed, epoch, batch, dp_rank, dp_size): never on timing, worker counts or the backend that reads them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from taxbench.datasets.shards import ShardError, TokenShards


class SampleOrder:
    def __init__(self, num_samples: int, seed: int, micro_batch: int, dp_rank: int, dp_size: int) -> None:
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
        self.num_samples, self.seed = num_samples, seed
        self.micro_batch, self.dp_rank, self.dp_size = micro_batch, dp_rank, dp_size
        self.global_batch = micro_batch * dp_size
        self.batches_per_epoch = num_samples // self.global_batch
        if self.batches_per_epoch < 1:
            raise ValueError(f"{num_samples} samples cannot fill one batch of micro_batch*dp_size={self.global_batch}")
        self._cached: tuple[int, np.ndarray] | None = None

    def permutation(self, epoch: int) -> np.ndarray:
        if self._cached is None or self._cached[0] != epoch:
            generator = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, epoch])))
            self._cached = (epoch, generator.permutation(self.num_samples))
        return self._cached[1]

    def batch(self, epoch: int, batch: int) -> np.ndarray:
        """Sample indices of this rank's micro-batch `batch` of `epoch`."""
        if not 0 <= batch < self.batches_per_epoch:
            raise IndexError(f"batch {batch} outside epoch of {self.batches_per_epoch} batches")
        start = batch * self.global_batch
        return self.permutation(epoch)[start + self.dp_rank : start + self.global_batch : self.dp_size]

    def batch_at(self, step: int) -> np.ndarray:
        """Sample indices of the rank's `step`-th micro-batch counted from the start of epoch 0."""
        return self.batch(*divmod(step, self.batches_per_epoch))


def shard_order(shards: TokenShards, seed: int, seq_len: int, micro_batch: int, dp_rank: int,
                dp_size: int) -> SampleOrder:
    samples = shards.require_samples(seq_len, micro_batch * dp_size,
                                     f"one batch of micro_batch*dp_size = {micro_batch}*{dp_size} per epoch")
    return SampleOrder(samples, seed, micro_batch, dp_rank, dp_size)


class StreamCursor:
    """How many micro-batches a rank has consumed, as the checkpointed (epoch, position) state.

    `position` counts permutation slots consumed by all dp ranks together within the epoch (like the synthetic
    stream's position), so every rank saves the same state.
    """

    def __init__(self, order: SampleOrder, shards: TokenShards, seq_len: int, loader: str) -> None:
        self.order, self.seq_len, self.loader = order, seq_len, loader
        self.dataset, self.directory = shards.digest, str(shards.directory)
        self.consumed = 0  # micro-batches since the start of epoch 0

    @property
    def epoch(self) -> int:
        return self.consumed // self.order.batches_per_epoch

    @property
    def position(self) -> int:
        return (self.consumed % self.order.batches_per_epoch) * self.order.global_batch

    def state_dict(self) -> dict[str, Any]:
        order = self.order
        return {
            "kind": "shards",
            "loader": self.loader,
            "dataset": self.dataset,
            "seed": order.seed,
            "seq_len": self.seq_len,
            "micro_batch": order.micro_batch,
            "dp_size": order.dp_size,
            "num_samples": order.num_samples,
            "epoch": self.epoch,
            "position": self.position,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != "shards":
            raise ValueError(f"data state of kind {state.get('kind')!r} cannot resume a token-shard stream; the "
                             "checkpoint was written with another recipe.data.kind")
        if state.get("dataset") != self.dataset:
            raise ShardError(f"the checkpoint's data state belongs to dataset {state.get('dataset')}, but "
                             f"{self.directory} is dataset {self.dataset}; resume with the same shard folder")
        mine = self.state_dict()
        for key in ("seed", "seq_len", "micro_batch", "dp_size", "num_samples"):
            if state.get(key) != mine[key]:
                raise ValueError(f"the checkpoint's data state has {key}={state.get(key)} but this run has "
                                 f"{key}={mine[key]}; resume with the same recipe and data-parallel size")
        epoch, position = int(state["epoch"]), int(state["position"])
        batch, ragged = divmod(position, self.order.global_batch)
        if ragged or epoch < 0 or not 0 <= batch < self.order.batches_per_epoch:
            raise ValueError(f"data state epoch={epoch} position={position} is not a batch boundary of this stream")
        self.consumed = epoch * self.order.batches_per_epoch + batch
