"""Dense GPT in plain torch (pre-norm, causal self-attention, GELU MLP)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from taxbench.config.schema import ModelConfig


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.head_dim = d_model // n_heads
        # Output features are laid out head-major, [head][q|k|v][head_dim], so that tensor parallelism (column-wise
        # sharding of qkv) gives every rank whole heads; the head count is read from the (local) output width.
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        qkv = self.qkv(x).view(batch, seq, -1, 3, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(dim=3))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.up = nn.Linear(d_model, d_ff, bias=False)
        self.down = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, ffn: nn.Module) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads)
        self.norm2 = nn.LayerNorm(d_model)
        self.ffn = ffn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.ffn(self.norm2(x))


class GPT(nn.Module):
    """Maps token ids [batch, seq] to logits [batch, seq, vocab]."""

    def __init__(self, cfg: ModelConfig, ffn_factory=None) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        make_ffn = ffn_factory or (lambda: MLP(cfg.d_model, cfg.d_ff))
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg.d_model, cfg.n_heads, make_ffn()) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens to logits; a pipeline stage (taxbench.parallel.pipeline.split_model) lacks the embeddings (it gets
        hidden states) or the head (it returns hidden states) and holds identities in place of the blocks it does not
        own."""
        if self.embed is not None:
            positions = torch.arange(x.shape[1], device=x.device)
            x = self.embed(x) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)) if self.head is not None else x


def build_dense(cfg: ModelConfig, deterministic_kernels: bool) -> nn.Module:
    del deterministic_kernels  # no custom kernels with a fast nondeterministic path
    return GPT(cfg)
