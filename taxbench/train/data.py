"""Deterministic, resumable token sources.

A source yields (inputs, targets) micro-batches for one data-parallel rank. Its order depends only on the seed and
its position, never on timing or thread counts, and `state_dict()` captures the position so that a checkpoint
resumes the exact stream.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from taxbench.config.schema import DataConfig, DataKind
from taxbench.datasets.source import build_shard_source


class TokenSource(Protocol):
    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class SyntheticTokens:
    """Learnable synthetic sequences: arithmetic progressions mod vocab with 10% noise tokens.

    Sample i (global index) is generated from its own seeded generator, so any rank can produce any sample and the
    stream resumes exactly from `position`.
    """

    def __init__(self, seed: int, vocab_size: int, seq_len: int, micro_batch: int, dp_rank: int, dp_size: int) -> None:
        self.seed, self.vocab_size, self.seq_len = seed, vocab_size, seq_len
        self.micro_batch, self.dp_rank, self.dp_size = micro_batch, dp_rank, dp_size
        self.position = 0  # global samples consumed by all dp ranks together

    def sample(self, index: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        start = int(torch.randint(self.vocab_size, (1,), generator=gen))
        stride = int(torch.randint(1, 8, (1,), generator=gen))
        tokens = (start + stride * torch.arange(self.seq_len + 1)) % self.vocab_size
        noise = torch.rand(self.seq_len + 1, generator=gen) < 0.1
        return torch.where(noise, torch.randint(self.vocab_size, (self.seq_len + 1,), generator=gen), tokens)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        first = self.position + self.dp_rank * self.micro_batch
        batch = torch.stack([self.sample(first + j) for j in range(self.micro_batch)])
        self.position += self.dp_size * self.micro_batch
        return batch[:, :-1], batch[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "synthetic", "seed": self.seed, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != "synthetic" or state.get("seed") != self.seed:
            raise ValueError(f"data state {state} does not belong to a synthetic stream with seed {self.seed}")
        self.position = int(state["position"])


def build_source(
    cfg: DataConfig, vocab_size: int, seq_len: int, micro_batch: int, dp_rank: int, dp_size: int
) -> TokenSource:
    if cfg.kind == DataKind.synthetic:
        return SyntheticTokens(cfg.seed, vocab_size, seq_len, micro_batch, dp_rank, dp_size)

    return build_shard_source(cfg, vocab_size, seq_len, micro_batch, dp_rank, dp_size)
