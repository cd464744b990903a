"""Trainer in one process (world size 1): seeded init, RNG isolation between interleaved runs, bitwise resume."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from conftest import compose_config
from torch import nn

from taxbench.analysis.records import load_run
from taxbench.config import TaxbenchConfig
from taxbench.distributed import DistContext
from taxbench.records import METRICS
from taxbench.trainer import Trainer


def tiny_config() -> TaxbenchConfig:
    cfg, _ = compose_config("cluster=inprocess", "recipe.global_batch_size=4", "recipe.model.d_model=32",
                            "recipe.model.n_heads=2", "recipe.model.seq_len=16", "experiment.name=t")
    return cfg


CTX = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")


def make(cfg: TaxbenchConfig, run_dir: Path, arm: str = "deterministic") -> Trainer:
    return Trainer(cfg, arm, "0", cfg.arms[arm], CTX, run_dir)


def fingerprints(run_dir: Path):
    return load_run(run_dir)[["step", *METRICS]].reset_index(drop=True)


def test_resume_from_checkpoint_is_bitwise_identical(tmp_path: Path) -> None:
    cfg = tiny_config()
    straight = make(cfg, tmp_path / "straight")
    straight.run_block(8, 0)
    straight.close()

    first = make(cfg, tmp_path / "resumed")
    first.run_block(3, 0)
    first.run_block(1, 0)  # extra records past the checkpoint, as a crash after it would leave
    first.save_checkpoint(tmp_path / "ckpt.pt")
    first.run_block(2, 0)
    first.close()
    second = make(cfg, tmp_path / "resumed")
    second.load_checkpoint(tmp_path / "ckpt.pt")
    second.run_block(4, 0)
    second.close()

    a, b = fingerprints(tmp_path / "straight"), fingerprints(tmp_path / "resumed")
    assert list(b["step"]) == list(range(1, 9)), "records past the checkpoint must not be duplicated"
    assert a.equals(b)


def test_interleaving_does_not_perturb_either_run(tmp_path: Path) -> None:
    """RNG streams and policy flags are per run, so alternating blocks leaves each run as if it ran alone."""
    cfg = tiny_config()
    alone = make(cfg, tmp_path / "alone")
    alone.run_block(6, 0)
    alone.close()
    left, right = make(cfg, tmp_path / "left"), make(cfg, tmp_path / "right", arm="baseline")
    for block in range(3):
        left.run_block(2, block)
        right.run_block(2, block)
    left.close()
    right.close()
    assert fingerprints(tmp_path / "alone").equals(fingerprints(tmp_path / "left"))


class NoisyLM(nn.Module):
    """Draws from the python, numpy and torch global RNGs every forward, like dropout or stochastic rounding would."""

    def __init__(self, vocab_size: int, width: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.head = nn.Linear(width, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        scale = 1 + 1e-3 * (random.random() + float(np.random.rand()))
        hidden = nn.functional.dropout(self.embed(tokens) * scale, p=0.1, training=True)
        return self.head(hidden)


def build_noisy_lm(vocab_size: int, width: int) -> nn.Module:
    return NoisyLM(vocab_size, width)


def noisy_config() -> TaxbenchConfig:
    cfg = tiny_config()
    factory = {"_target_": f"{__name__}.build_noisy_lm", "vocab_size": cfg.recipe.model.vocab_size, "width": 16}
    return replace(cfg, recipe=replace(cfg.recipe, model=replace(cfg.recipe.model, kind="custom", factory=factory)))


def test_global_rng_streams_are_per_run_and_restored_by_checkpoints(tmp_path: Path) -> None:
    """A model drawing from every global RNG: interleaving and resuming must leave its random streams untouched."""
    cfg = noisy_config()
    alone = make(cfg, tmp_path / "alone")
    alone.run_block(6, 0)
    alone.close()

    left, right = make(cfg, tmp_path / "left"), make(cfg, tmp_path / "right", arm="baseline")
    left.run_block(3, 0)
    right.run_block(3, 0)  # draws from the same global RNGs in between
    left.save_checkpoint(tmp_path / "ckpt.pt")
    left.close()
    random.random(), np.random.rand(), torch.rand(1)  # anything else the process does meanwhile
    resumed = make(cfg, tmp_path / "left")
    resumed.load_checkpoint(tmp_path / "ckpt.pt")
    resumed.run_block(3, 1)
    resumed.close()
    right.close()
    assert fingerprints(tmp_path / "alone").equals(fingerprints(tmp_path / "left"))


def test_records_carry_exact_bits_and_timing(tmp_path: Path) -> None:
    cfg = tiny_config()
    trainer = make(cfg, tmp_path / "run")
    trainer.run_block(3, 0)
    trainer.close()
    frame = load_run(tmp_path / "run")
    row = frame.iloc[-1]
    assert row["schema_version"] == 1 and row["arm"] == "deterministic" and row["replica"] == "0"
    assert len(row["loss_bits"]) == 8 and len(row["params"]) == 16
    loss = torch.tensor([int(row["loss_bits"], 16)], dtype=torch.int64).to(torch.int32).view(torch.float32)
    assert float(loss) == row["loss"]
    assert row["time_s"] > 0 and row["data_s"] >= 0 and row["tokens"] == 4 * 16
    assert frame["params"].nunique() == 3  # parameters change every step
