"""recipe.data.kind=shards: open and check the shard folder, pick the loader backend, build the rank's reader."""

from __future__ import annotations

import torch

from taxbench.config.schema import ConfigError, DataConfig, DataLoaderKind
from taxbench.datasets.dali_reader import DaliShardReader, dali_available, require_dali
from taxbench.datasets.order import shard_order
from taxbench.datasets.shards import INDEX_FILE, ShardError, TokenShards
from taxbench.datasets.torch_reader import TorchShardReader


def _cuda_in_use() -> bool:
    # The trainer moves the model to its device before building the data source, so CUDA is initialized on GPU ranks.
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def resolve_loader(loader: DataLoaderKind, cuda: bool) -> DataLoaderKind:
    """auto picks DALI only on GPU ranks where it is installed (on CPU it brings nothing over torch)."""
    if loader == DataLoaderKind.auto:
        return DataLoaderKind.dali if cuda and dali_available() else DataLoaderKind.torch
    if loader == DataLoaderKind.dali:
        require_dali()
    return loader


def open_shards(cfg: DataConfig, vocab_size: int) -> TokenShards:
    if not cfg.path:
        raise ConfigError("recipe.data.kind=shards needs recipe.data.path=<folder>; build one with "
                          "`taxbench build-shards TEXT_FILE OUT_DIR`")
    shards = TokenShards(cfg.path)
    if shards.index.max_token >= vocab_size:
        raise ShardError(f"{shards.directory / INDEX_FILE}: token ids reach {shards.index.max_token} "
                         f"({shards.index.tokenizer} tokenizer) but recipe.model.vocab_size={vocab_size}; use "
                         f"recipe.model.vocab_size>={shards.index.max_token + 1}")
    return shards


def check_shard_recipe(cfg: DataConfig, vocab_size: int, seq_len: int, micro_batch: int, dp_size: int) -> None:
    """Everything a rank would reject, checked once before ranks start (plus checksums if asked)."""
    shards = open_shards(cfg, vocab_size)
    shard_order(shards, cfg.seed, seq_len, micro_batch, 0, dp_size)
    resolve_loader(cfg.loader, cuda=False)
    if cfg.verify_checksums:
        shards.verify_checksums()


def build_shard_source(cfg: DataConfig, vocab_size: int, seq_len: int, micro_batch: int, dp_rank: int,
                       dp_size: int) -> TorchShardReader | DaliShardReader:
    shards = open_shards(cfg, vocab_size)
    order = shard_order(shards, cfg.seed, seq_len, micro_batch, dp_rank, dp_size)
    cuda = _cuda_in_use()
    if resolve_loader(cfg.loader, cuda) == DataLoaderKind.dali:
        return DaliShardReader(shards, order, seq_len, torch.cuda.current_device() if cuda else None,
                               num_threads=cfg.num_workers)
    return TorchShardReader(shards, order, seq_len, num_workers=cfg.num_workers)
