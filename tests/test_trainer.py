"""Trainer in one process (world size 1): seeded init, RNG isolation between interleaved runs, bitwise resume,
verified restores and fault events."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import compose_config
from torch import nn

from taxbench.checkpoint.store import CheckpointError
from taxbench.config.schema import FaultKind, TaxbenchConfig
from taxbench.parallel.distributed import DistContext
from taxbench.rundir.read import load_run
from taxbench.rundir.records import METRICS, SCHEMA_VERSION, faults_file, steps_file
from taxbench.rundir.step_stream import read_stream
from taxbench.train.trainer import RunSpec, Trainer


def tiny_config() -> TaxbenchConfig:
    cfg = compose_config("cluster=inprocess", "recipe.global_batch_size=4", "recipe.model.d_model=32",
                            "recipe.model.n_heads=2", "recipe.model.seq_len=16", "experiment.name=t")
    return cfg


CTX = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")


def make(cfg: TaxbenchConfig, run_dir: Path, arm: str = "deterministic") -> Trainer:
    return Trainer(RunSpec.of(cfg, arm, "0", cfg.arms[arm], run_dir), CTX)


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
    first.save_checkpoint(tmp_path / "ckpt")
    first.run_block(2, 0)
    first.close()
    second = make(cfg, tmp_path / "resumed")
    second.load_checkpoint(tmp_path / "ckpt")
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
    left.save_checkpoint(tmp_path / "ckpt")
    left.close()
    random.random(), np.random.rand(), torch.rand(1)  # anything else the process does meanwhile
    resumed = make(cfg, tmp_path / "left")
    resumed.load_checkpoint(tmp_path / "ckpt")
    resumed.run_block(3, 1)
    resumed.close()
    right.close()
    assert fingerprints(tmp_path / "alone").equals(fingerprints(tmp_path / "left"))


def test_records_carry_exact_bits_and_timing(tmp_path: Path) -> None:
    cfg = tiny_config()
    trainer = make(cfg, tmp_path / "run")
    trainer.run_block(3, 0)
    trainer.close()
    assert read_stream(steps_file(tmp_path / "run", 0)).mirror_current  # the rank mirrored its records on close
    frame = load_run(tmp_path / "run")
    assert frame.equals(load_run(tmp_path / "run", use_mirrors=False))
    row = frame.iloc[-1]
    assert row["schema_version"] == SCHEMA_VERSION and row["arm"] == "deterministic" and row["replica"] == "0"
    assert len(row["loss_bits"]) == 8 and len(row["params"]) == 16
    loss = torch.tensor([int(row["loss_bits"], 16)], dtype=torch.int64).to(torch.int32).view(torch.float32)
    assert float(loss) == row["loss"]
    assert row["time_s"] > 0 and row["data_s"] >= 0 and row["tokens"] == 4 * 16
    assert frame["params"].nunique() == 3  # parameters change every step


def test_a_restore_that_does_not_reproduce_the_recorded_step_is_an_error_naming_the_file(tmp_path: Path) -> None:
    cfg = tiny_config()
    first = make(cfg, tmp_path / "run")
    first.run_block(3, 0)
    first.save_checkpoint(tmp_path / "ckpt")
    # A checkpoint that loads fine but holds other parameters than the run had at that step.
    with torch.no_grad():
        next(first.raw_model.parameters()).view(-1)[0] += 1
    first.save_checkpoint(tmp_path / "ckpt")
    before = (tmp_path / "run" / "steps.rank0.jsonl").read_text()
    with pytest.raises(CheckpointError, match=r"ckpt: restored state does not reproduce the record of step 3 in "
                                              r".*steps.rank0.jsonl \(params "):
        make(cfg, tmp_path / "run").load_checkpoint(tmp_path / "ckpt")
    first.close()
    assert (tmp_path / "run" / "steps.rank0.jsonl").read_text() == before  # nothing was dropped


def test_an_unreadable_checkpoint_is_named(tmp_path: Path) -> None:
    cfg = tiny_config()
    first = make(cfg, tmp_path / "run")
    first.run_block(1, 0)
    first.save_checkpoint(tmp_path / "ckpt")
    first.close()
    (shards,) = (tmp_path / "ckpt").glob("*.distcp")
    data = shards.read_bytes()
    shards.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"ckpt: unreadable checkpoint \("):
        make(cfg, tmp_path / "run").load_checkpoint(tmp_path / "ckpt")


def faulty(cfg: TaxbenchConfig, run_dir: Path, **fault: object) -> Trainer:
    settings = replace(cfg.experiment.fault, enabled=True, **fault)
    return Trainer(RunSpec.of(cfg, "deterministic", "1", cfg.arms["deterministic"], run_dir, settings), CTX)


def fault_events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in faults_file(run_dir, 0).read_text().splitlines()]


def test_a_fired_fault_is_recorded_once_with_where_it_acted(tmp_path: Path) -> None:
    cfg = tiny_config()
    trainer = faulty(cfg, tmp_path / "flip", step=2)
    trainer.run_block(3, 0)
    trainer.close()
    first_param = next(trainer.raw_model.named_parameters())[0]
    assert fault_events(tmp_path / "flip") == [
        {"schema_version": SCHEMA_VERSION, "kind": "flip_param_bit", "step": 2, "rank": 0, "where": first_param}]

    trainer = faulty(cfg, tmp_path / "op", step=2, kind=FaultKind.nondeterministic_op, module="blocks.1.ffn",
                     op="aten.mm.default")
    trainer.run_block(3, 0)
    trainer.close()
    assert fault_events(tmp_path / "op") == [{"schema_version": SCHEMA_VERSION, "kind": "nondeterministic_op",
                                              "step": 2, "rank": 0, "where": "aten.mm.default in blocks.1.ffn"}]


def test_a_fault_that_never_matches_leaves_an_empty_event_file(tmp_path: Path) -> None:
    cfg = tiny_config()
    trainer = faulty(cfg, tmp_path / "run", step=2, kind=FaultKind.nondeterministic_op, module="blocks.1.ffn",
                     op="aten.matmull.default")
    trainer.run_block(3, 0)
    trainer.close()
    assert faults_file(tmp_path / "run", 0).exists() and fault_events(tmp_path / "run") == []


def test_a_resumed_run_drops_fault_events_past_its_checkpoint(tmp_path: Path) -> None:
    cfg = tiny_config()
    first = faulty(cfg, tmp_path / "run", step=3)
    first.run_block(2, 0)
    first.save_checkpoint(tmp_path / "ckpt")
    first.run_block(2, 0)  # the fault fires at step 3, after the checkpoint
    first.close()
    assert [e["step"] for e in fault_events(tmp_path / "run")] == [3]
    resumed = faulty(cfg, tmp_path / "run", step=3)
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert fault_events(tmp_path / "run") == []
    resumed.run_block(2, 0)  # fires again
    resumed.close()
    assert [e["step"] for e in fault_events(tmp_path / "run")] == [3]


def _perturbing_rank(rank: int, world: int, cfg: TaxbenchConfig, run_dir: str, port: int) -> None:
    from taxbench.launchers.worker import rank_process

    with rank_process([cfg], rank, world, rank, "127.0.0.1", port) as ctx:
        fault = replace(cfg.experiment.fault, enabled=True, kind=FaultKind.perturb_collective, step=2, rank=1)
        trainer = Trainer(RunSpec.of(cfg, "deterministic", "1", cfg.arms["deterministic"], Path(run_dir), fault), ctx)
        trainer.run_block(3, 0)
        trainer.close()


@pytest.mark.slow
def test_a_perturbed_collective_is_recorded_on_its_rank_with_its_bucket(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    from taxbench.parallel.distributed import free_port

    cfg = compose_config("cluster.cpu_ranks=2", "recipe.global_batch_size=4", "recipe.model.d_model=32",
                            "recipe.model.n_heads=2", "recipe.model.seq_len=16", "recipe.micro_batch_size=2",
                            "experiment.name=t")
    mp.start_processes(_perturbing_rank, args=(2, cfg, str(tmp_path), free_port()), nprocs=2, join=True,
                       start_method="spawn")
    assert fault_events(tmp_path) == []  # rank 0: the fault was armed elsewhere
    events = [json.loads(line) for line in faults_file(tmp_path, 1).read_text().splitlines()]
    assert events == [{"schema_version": SCHEMA_VERSION, "kind": "perturb_collective", "step": 2, "rank": 1,
                       "where": "gradient all-reduce bucket 0"}]


def test_a_parameter_that_gets_no_gradient_fails_the_first_step(tmp_path: Path) -> None:
    trainer = make(tiny_config(), tmp_path)
    name, lost = list(trainer.raw_model.named_parameters())[-1]
    # As a schedule whose weight-gradient pass never reaches a parameter: its gradient is dropped on arrival.
    lost.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    with pytest.raises(RuntimeError, match=rf"1 trainable parameters got no gradient \({name}\)"):
        trainer.run_block(1, 0)
