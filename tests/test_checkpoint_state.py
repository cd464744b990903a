"""DCP checkpoints on real gloo processes: every rank writes its shards, and the checkpoint holds the unsplit model
(each parameter once, under its unsplit name, at its global shape, experts at their global offsets), so a layout other
than the one that wrote it (here: one process, no parallelism) reads it back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from helpers import compose_config

from taxbench.launchers.worker import rank_process
from taxbench.parallel.distributed import free_port
from taxbench.train.trainer import RunSpec, Trainer
from taxbench.workloads import build_model

MOE = ("+recipe=moe_tiny", "recipe.model.n_layers=4", "recipe.model.n_experts=8", "recipe.parallel.data_parallel=fsdp",
       "experiment.name=dcp", "recipe.micro_batch_size=2")
LAYOUTS = {
    # the moe_1t proxy's layout: pp=2 x dp=2 (ep=2 carved out of it, so each expert slice lives on one rank)
    "pp_ep_fsdp": (*MOE, "recipe.parallel.pp=2", "recipe.parallel.ep=2", "cluster.cpu_ranks=4",
                   "recipe.global_batch_size=16"),
    # edp=2 x ep=2: FSDP2 shards each ep rank's experts again over its two edp ranks
    "edp_ep_fsdp": (*MOE, "recipe.parallel.ep=2", "cluster.cpu_ranks=4", "recipe.global_batch_size=16"),
    # two stages on each of two ranks: one state dict over both stage parts, names unique across them
    "interleaved": ("recipe.model.n_layers=4", "recipe.parallel.pp=2", "recipe.parallel.pp_schedule=Interleaved1F1B",
                    "recipe.parallel.virtual_stages=2", "cluster.cpu_ranks=2", "recipe.global_batch_size=16",
                    "experiment.name=dcp"),
}


def _save_at_init(rank: int, world: int, overrides: tuple[str, ...], out: str, port: int) -> None:
    cfg = compose_config(*overrides)
    with rank_process([cfg], rank, world, rank, "127.0.0.1", port) as ctx:
        trainer = Trainer(RunSpec.of(cfg, "deterministic", "0", cfg.arms["deterministic"], Path(out) / "run"), ctx)
        files = trainer.save_checkpoint(Path(out) / "ckpt")
        trainer.close()
    (Path(out) / f"files.rank{rank}").write_text("\n".join(sorted(f.name for f in files)))


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_sharded_checkpoint_reads_back_as_the_unsplit_model(layout: str, tmp_path: Path) -> None:
    overrides = LAYOUTS[layout]
    cfg = compose_config(*overrides)
    world = cfg.cluster.cpu_ranks
    mp.start_processes(_save_at_init, args=(world, overrides, str(tmp_path), free_port()), nprocs=world, join=True,
                       start_method="spawn")
    reference = build_model(cfg.recipe.model, deterministic_kernels=True, seed=cfg.recipe.seed).state_dict()

    metadata = dcp.FileSystemReader(tmp_path / "ckpt").read_metadata()
    saved = {key.removeprefix("model."): meta.size for key, meta in metadata.state_dict_metadata.items()
             if key.startswith("model.")}
    assert saved == {name: tensor.shape for name, tensor in reference.items()}
    loaded = {"model": {name: torch.full_like(tensor, float("nan")) for name, tensor in reference.items()}}
    dcp.load(loaded, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    differing = [name for name, tensor in reference.items() if not torch.equal(loaded["model"][name], tensor)]
    assert differing == []
    # Each rank lists what it wrote: its own data file and per-rank state; rank 0 also DCP's metadata.
    for rank in range(world):
        files = (tmp_path / f"files.rank{rank}").read_text().split()
        assert f"rank{rank}.pt" in files and (".metadata" in files) == (rank == 0)
        assert all(name.startswith(f"__{rank}_") for name in files if name.endswith(".distcp"))
