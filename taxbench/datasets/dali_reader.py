"""Token shards through NVIDIA DALI (optional extra `dali`: `pip install 'taxbench[dali]'`).

`fn.readers.numpy` wants one file per sample, so the pipeline reads the memory-mapped shards through
`fn.external_source` fed by the same `SampleOrder` as the torch backend: both yield identical batches for a seed. The
source is a single-argument callable of the batch index, the kind whose position DALI's `enable_checkpointing`
saves; `state_dict()` stores `pipe.checkpoint()` beside the (epoch, position) cursor. Every batch carries its sample
ids as a second output, checked against the cursor, so a restored pipeline that drifted from the cursor fails loudly
instead of silently feeding other data. With `device_id=None` the pipeline runs on CPU; with a GPU id the tokens are
copied to and cast on that GPU.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np
import torch

from taxbench.datasets.order import SampleOrder, StreamCursor
from taxbench.datasets.shards import TokenShards

INSTALL_HINT = "pip install 'taxbench[dali]'"


class DaliUnavailable(ImportError):
    pass


def dali_available() -> bool:
    try:
        return importlib.util.find_spec("nvidia.dali") is not None
    except ModuleNotFoundError:  # no `nvidia` namespace package at all
        return False


def require_dali() -> None:
    if not dali_available():
        raise DaliUnavailable(f"recipe.data.loader=dali needs NVIDIA DALI, which is not installed: {INSTALL_HINT} "
                              "(or use recipe.data.loader=torch, or auto to pick DALI only where it is installed)")


class ShardBatchSource:
    """The external_source callback: batch `iteration` of the pipeline is the rank's micro-batch `base + iteration`."""

    def __init__(self, shards: TokenShards, order: SampleOrder, seq_len: int, base: int) -> None:
        self.shards, self.order, self.seq_len, self.base = shards, order, seq_len, base

    def batch(self, iteration: int) -> tuple[np.ndarray, np.ndarray]:
        ids = self.order.batch_at(self.base + iteration)
        tokens = np.stack([self.shards.sample(int(i), self.seq_len) for i in ids])
        return tokens, ids.astype(np.int64).reshape(-1, 1)


class DaliShardReader:
    loader = "dali"

    def __init__(self, shards: TokenShards, order: SampleOrder, seq_len: int, device_id: int | None,
                 num_threads: int = 1, prefetch_queue_depth: int = 2) -> None:
        require_dali()
        self.shards, self.order, self.seq_len, self.device_id = shards, order, seq_len, device_id
        self.num_threads, self.prefetch_queue_depth = max(1, num_threads), prefetch_queue_depth
        self.cursor = StreamCursor(order, shards, seq_len, self.loader)
        self._pipe: Any = None
        self._base = 0
        self._restore: tuple[int, Any] | None = None  # (base, DALI checkpoint) to build the next pipeline from

    def _build(self, base: int, checkpoint: Any) -> Any:
        from nvidia.dali import fn, pipeline_def, types

        dtype = {"uint16": types.UINT16, "uint32": types.UINT32}[self.shards.index.dtype]
        source = ShardBatchSource(self.shards, self.order, self.seq_len, base)
        gpu = self.device_id is not None

        @pipeline_def(batch_size=self.order.micro_batch, num_threads=self.num_threads, device_id=self.device_id,
                      seed=self.order.seed % (1 << 31), prefetch_queue_depth=self.prefetch_queue_depth,
                      enable_checkpointing=True)
        def shard_pipeline() -> Any:
            tokens, ids = fn.external_source(source=source.batch, num_outputs=2, batch=True,
                                             dtype=[dtype, types.INT64], ndim=[1, 1])
            return fn.cast(tokens.gpu() if gpu else tokens, dtype=types.INT64), ids

        pipe = shard_pipeline(checkpoint=checkpoint)
        pipe.build()
        self._base = base
        return pipe

    def _to_torch(self, output: Any) -> torch.Tensor:
        from nvidia.dali.backend import TensorGPU
        from nvidia.dali.plugin.pytorch import feed_ndarray

        tensor = output.as_tensor()
        on_gpu = isinstance(tensor, TensorGPU)
        device = torch.device("cuda", self.device_id) if on_gpu else torch.device("cpu")
        out = torch.empty(tuple(tensor.shape()), dtype=torch.int64, device=device)
        if on_gpu:
            return feed_ndarray(tensor, out, cuda_stream=torch.cuda.current_stream(device))
        return feed_ndarray(tensor, out)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._pipe is None:
            base, checkpoint = self._restore or (self.cursor.consumed, None)
            self._pipe, self._restore = self._build(base, checkpoint), None
        tokens_out, ids_out = self._pipe.run()
        ids = np.asarray(ids_out.as_array()).reshape(-1)
        expected = self.order.batch_at(self.cursor.consumed)
        if not np.array_equal(ids, expected):
            raise RuntimeError(
                f"DALI pipeline returned samples {ids.tolist()} where the stream cursor (epoch {self.cursor.epoch}, "
                f"position {self.cursor.position}) expects {expected.tolist()}: the restored DALI checkpoint and the "
                "data state disagree; resume with recipe.data.loader=torch to replay from the cursor alone"
            )
        tokens = self._to_torch(tokens_out)
        self.cursor.consumed += 1
        return tokens[:, :-1], tokens[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        state = self.cursor.state_dict()
        if self._pipe is not None:
            state["dali"] = {"base": self._base, "checkpoint": self._pipe.checkpoint()}
        elif self._restore is not None:
            state["dali"] = {"base": self._restore[0], "checkpoint": self._restore[1]}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cursor.load_state_dict(state)
        self._pipe = None
        saved = state.get("dali") if state.get("loader") == self.loader else None
        # A state saved by the torch backend (or before the first batch) has no DALI checkpoint: start at the cursor.
        self._restore = (int(saved["base"]), saved["checkpoint"]) if saved else None
