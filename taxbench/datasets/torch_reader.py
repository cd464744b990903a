"""Token shards through torch.utils.data.DataLoader: the fallback backend, available wherever torch is.

The DataLoader reads a map-style dataset with a batch sampler that walks `SampleOrder` from the cursor, so worker
processes only fetch by index and never decide the order. Workers prefetch ahead of what the trainer consumed; the
cursor counts consumed batches only, and restoring a state rebuilds the loader from there.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from taxbench.datasets.order import SampleOrder, StreamCursor
from taxbench.datasets.shards import TokenShards


class ShardSamples(Dataset[torch.Tensor]):
    """Sample i as int64 tokens of length seq_len+1."""

    def __init__(self, shards: TokenShards, seq_len: int) -> None:
        self.shards, self.seq_len = shards, seq_len

    def __len__(self) -> int:
        return self.shards.num_samples(self.seq_len)

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.from_numpy(self.shards.sample(index, self.seq_len).astype("int64"))


class OrderedBatches(Sampler[list[int]]):
    """Endless micro-batches of sample indices, from micro-batch `start` on (counted from epoch 0)."""

    def __init__(self, order: SampleOrder, start: int) -> None:
        self.order, self.start = order, start

    def __iter__(self) -> Iterator[list[int]]:
        step = self.start
        while True:
            yield self.order.batch_at(step).tolist()
            step += 1


class TorchShardReader:
    loader = "torch"

    def __init__(self, shards: TokenShards, order: SampleOrder, seq_len: int, num_workers: int = 0) -> None:
        self.shards, self.order, self.seq_len, self.num_workers = shards, order, seq_len, num_workers
        self.cursor = StreamCursor(order, shards, seq_len, self.loader)
        self._batches: Iterator[torch.Tensor] | None = None

    def _start(self) -> Iterator[torch.Tensor]:
        loader = DataLoader(
            ShardSamples(self.shards, self.seq_len),
            batch_sampler=OrderedBatches(self.order, self.cursor.consumed),
            num_workers=self.num_workers,
        )
        return iter(loader)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._batches is None:
            self._batches = self._start()
        tokens = next(self._batches)
        self.cursor.consumed += 1
        return tokens[:, :-1], tokens[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        return self.cursor.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cursor.load_state_dict(state)
        self._batches = None  # drops prefetched batches (and shuts down workers)
