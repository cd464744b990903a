"""What one run's checkpoint holds and how it is written: torch.distributed.checkpoint (DCP), as torchtitan does.

A checkpoint is a directory, `<run>/checkpoints/step<S>/`:
- the model and optimizer, sharded: DCP's `.distcp` files (each rank writes the shards it holds, a replicated tensor
  is written once) and its `.metadata` (written by rank 0). Keys are the unsplit model's parameter names, read through
  torch.distributed.checkpoint.state_dict from all of this rank's pipeline stages at once (so blocks.3.* is blocks.3.*
  under any pipeline split), and FSDP2/tensor-parallel DTensors keep their global shape. Experts, which each ep rank
  holds a different slice of under the same name (as Megatron-Core's tensor-parallel weights), are saved as one
  DTensor over the whole parameter (ParallelModel.global_view), so every rank's slice lands at its own offsets.
- what is per rank and not a tensor shard: the step, the data-loader position and the RNG streams, in
  `rank<R>.pt` beside the DCP files; so is the state of an LR schedule that a stack's optimizer carries
  (`optimizer.lr_scheduler`: torchtitan's).

`save` returns the files this rank wrote (taxbench.checkpoint.store records their checksums); `load` restores all of it.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from taxbench.parallel.layout import ParallelModel
from taxbench.rundir.records import RunWriteError, write_atomically, write_error

METADATA = ".metadata"  # DCP's global metadata file, written by rank 0
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def extras_path(directory: Path, rank: int) -> Path:
    return directory / f"rank{rank}.pt"


class _RecordingWriter(FileSystemWriter):
    """DCP's file-system writer that remembers which files this rank wrote (for their checksums)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, overwrite=True)
        self.written: list[str] = []

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        future = super().write_data(plan, planner)
        self.written = sorted({result.storage_data.relative_path for result in future.wait()})
        return future


@dataclass
class _States:
    """The model and optimizer state dicts of this rank (tensors shared with the live ones), and the same dicts as
    DCP sees them (sliced parameters as global DTensors over the same local data)."""

    model: dict[str, Any]
    optimizer: dict[str, Any]

    def for_dcp(self, parallel: ParallelModel) -> dict[str, Any]:
        sliced = parallel.sliced_names()
        if not sliced:
            return {"model": self.model, "optimizer": self.optimizer}
        shapes = {name: self.model[name].shape for name in sliced}
        model = {k: parallel.global_view(k, v) if k in sliced else v for k, v in self.model.items()}
        optimizer = {}
        for key, value in self.optimizer.items():
            name = _param_of_state(key, sliced)
            is_slice = name is not None and isinstance(value, torch.Tensor) and value.shape == shapes[name]
            optimizer[key] = parallel.global_view(name, value) if is_slice and name is not None else value
        return {"model": model, "optimizer": optimizer}


def _param_of_state(key: str, names: set[str]) -> str | None:
    """The parameter a flattened optimizer-state key (`state.<name>.<what>`) belongs to, when it is one of `names`."""
    if not key.startswith("state."):
        return None
    name = key[len("state."):].rpartition(".")[0]
    return name if name in names else None


def optimizer_parts(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """The optimizers that hold the state: torchtitan's OptimizersContainer subclasses Optimizer but keeps its state
    in the optimizers it holds (one per model part and optimizer type), which DCP's state-dict functions take as a
    list; any other optimizer is its own."""
    held = getattr(optimizer, "optimizers", None)
    return list(held) if held is not None else [optimizer]


def _states(parallel: ParallelModel, optimizer: torch.optim.Optimizer) -> _States:
    model, optim = get_state_dict(parallel.parts.joined(), optimizer_parts(optimizer), options=OPTIONS)
    return _States(model, optim)


def save(directory: Path, parallel: ParallelModel, optimizer: torch.optim.Optimizer, extras: dict[str, Any],
         rank: int, alone: bool = False) -> list[Path]:
    """Write this rank's part of the checkpoint in `directory` (a collective: every rank calls it); the files it
    wrote, the DCP metadata included on rank 0. `alone`: this rank writes its shards and a metadata of its own
    without any collective (benchmarks/rank_build.py, whose simulated process group moves no data)."""
    directory.mkdir(parents=True, exist_ok=True)
    writer = _RecordingWriter(directory)
    with _reported(directory), _single_process_quiet():
        dcp.save(_states(parallel, optimizer).for_dcp(parallel), storage_writer=writer, no_dist=alone or _single())
    schedule = getattr(optimizer, "lr_scheduler", None)  # a stack's LR schedule stepping with its optimizer
    if schedule is not None:
        extras = {**extras, "lr_scheduler": schedule.state_dict()}
    write_atomically(extras_path(directory, rank), lambda handle: torch.save(extras, handle))
    files = [directory / name for name in writer.written] + [extras_path(directory, rank)]
    return files + [directory / METADATA] if rank == 0 or alone else files


def load(directory: Path, parallel: ParallelModel, optimizer: torch.optim.Optimizer, rank: int,
         map_location: torch.device, alone: bool = False) -> dict[str, Any]:
    """Restore the model and optimizer from `directory` in place (a collective, unless `alone`: see save); this
    rank's extras. DCP reads only the chunks of this rank's own shards."""
    states = _states(parallel, optimizer)  # initialises the optimizer's state, into which DCP then loads
    with _single_process_quiet():
        dcp.load(states.for_dcp(parallel), checkpoint_id=directory, no_dist=alone or _single())
    joined = parallel.parts.joined()
    set_model_state_dict(joined, states.model, options=OPTIONS)
    set_optimizer_state_dict(joined, optimizer_parts(optimizer), states.optimizer, options=OPTIONS)
    extras: dict[str, Any] = torch.load(extras_path(directory, rank), map_location=map_location, weights_only=False)
    schedule = getattr(optimizer, "lr_scheduler", None)
    if schedule is not None:
        schedule.load_state_dict(extras["lr_scheduler"])  # a checkpoint without it is unreadable (KeyError)
    return extras


def _single() -> bool:
    return not (dist.is_initialized() and dist.get_world_size() > 1)


@contextmanager
def _single_process_quiet() -> Iterator[None]:
    """One rank is a normal case here, not the mistake DCP warns about on every save and load."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


@contextmanager
def _reported(directory: Path) -> Iterator[None]:
    """A failed DCP write (any rank's) as the RunWriteError of the first rank that failed: "no space left on ..."."""
    try:
        yield
    except CheckpointException as exc:
        for failed_rank, (cause, _) in sorted(exc.failures.items()):
            error = write_error(directory, cause)
            if error is not None:
                mine = not dist.is_initialized() or failed_rank == dist.get_rank()
                raise (error if mine else RunWriteError(error.errno, f"rank {failed_rank}: {error}",
                                                        error.filename)) from None
        raise
