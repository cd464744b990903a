"""A rank's step records: the fingerprints of each step, kept on the device until the block ends, written as one
flushed JSONL line per step (taxbench.rundir.step_stream), and the check that a restored state reproduces the record
of its step.

Digests are taken after the timed step stops (the gates' own cost is recorded beside it as fingerprint_s), stacked on
the device, and copied to the host once per block on GPU (once per step on CPU), so the harness adds one sync per
block to a GPU run.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from taxbench import fingerprint
from taxbench.checkpoint.store import CheckpointError
from taxbench.rundir.records import step_record
from taxbench.rundir.step_record import (
    DEVICE_S,
    FINGERPRINT_S,
    GRAD_NORM,
    GRAD_NORM_BITS,
    GRADS,
    LOSS,
    LOSS_BITS,
    OPTIM,
    PARAMS,
    TIME_S,
    TRAJECTORY_STEP,
    WINDOW_S,
)
from taxbench.rundir.step_stream import StepWriter
from taxbench.train.planted import PlantedDelay
from taxbench.train.timer import StepTimer


class StepRecorder:
    def __init__(self, path: Path, timer: StepTimer, device: torch.device, planted: PlantedDelay | None) -> None:
        self.writer = StepWriter(path)
        self.timer, self.device, self.planted = timer, device, planted
        # (record, step time, fingerprint time, planted-delay mark, digests) per step not yet written
        self._pending: list[tuple[dict[str, Any], Any, Any, Any, torch.Tensor]] = []
        self._times: list[float] = []  # step times of the steps written since the last take_times()

    def digest(self, tensors: Iterable[torch.Tensor]) -> fingerprint.Digest:
        found = fingerprint.collection_digest(tensors)
        return found if found is not None else 0

    def fingerprints(self, loss: torch.Tensor, grads: Iterable[torch.Tensor], grad_norm: torch.Tensor,
                     params: Iterable[torch.Tensor], optimizer: Iterable[torch.Tensor]) -> torch.Tensor:
        """The step's digests in taxbench.rundir.records.METRICS order, on the device (host digests are ints until
        here: one tensor of five, not five tensors stacked)."""
        values = [fingerprint.float_bits(loss.float()), self.digest(grads), fingerprint.float_bits(grad_norm.float()),
                  self.digest(params), self.digest(optimizer)]
        if all(isinstance(value, int) for value in values):
            return torch.tensor([fingerprint.signed64(value) for value in values], dtype=torch.int64)
        return torch.stack([fingerprint.as_tensor(value).to(self.device, non_blocking=True) for value in values])

    def add(self, record: dict[str, Any], measured: Any, fingerprint_measured: Any, planted_mark: Any,
            digests: torch.Tensor) -> None:
        self._pending.append((record, measured, fingerprint_measured, planted_mark, digests))
        if self.device.type == "cpu":
            self.flush(None)

    def take_times(self) -> list[float]:
        """Step times (seconds) of the steps written since the last call."""
        times, self._times = self._times, []
        return times

    def flush(self, window_per_step: float | None) -> None:
        """Turn pending steps into records: one host copy of all digests, then one line per step."""
        if not self._pending:
            return
        digests = torch.stack([d for *_, d in self._pending]).cpu().tolist()
        for (record, measured, fingerprint_measured, planted_mark, _), values in zip(self._pending, digests,
                                                                                      strict=True):
            seconds = self.timer.seconds(measured)
            self._times.append(seconds)
            if self.planted is not None and self.timer.cuda:
                self.planted.observe(measured[0], planted_mark)
            loss_bits, grads, norm_bits, params, optim = values
            record.update({
                TIME_S: seconds,  # the analysed step time: CUDA events on GPU, perf_counter on CPU
                DEVICE_S: seconds if self.timer.cuda else None,
                # GPU: the block's synchronized wall-clock window per step (data loading and the harness's own work
                # included), a cross-check on the event times. On CPU time_s is already wall-clock.
                WINDOW_S: window_per_step,
                FINGERPRINT_S: self.timer.seconds(fingerprint_measured),
                LOSS: _bits_to_float(loss_bits),
                LOSS_BITS: fingerprint.bits_hex(loss_bits, torch.float32),
                GRAD_NORM: _bits_to_float(norm_bits),
                GRAD_NORM_BITS: fingerprint.bits_hex(norm_bits, torch.float32),
                GRADS: fingerprint.to_hex(grads),
                PARAMS: fingerprint.to_hex(params),
                OPTIM: fingerprint.to_hex(optim),
            })
            # Flushed per line (a killed process loses none); fsynced only where a checkpoint commits and at close:
            # a resume drops every record past its checkpoint, so syncing each block bought nothing a restart keeps.
            self.writer.write(record)
        self._pending.clear()

    def check_restored(self, checkpoint: Path, step: int, model_step: int, params: Iterable[torch.Tensor],
                       optimizer: Iterable[torch.Tensor]) -> None:
        """A restore that does not reproduce the recorded parameters and optimizer state is an error, never a
        divergence for the gates to find later. `step` is this run's step, `model_step` the restored model's (they
        differ for a lane of a shared model, whose record of `step` describes the model only when it was the last
        to train it). Runs without a record of that step (a replay elsewhere) pass."""
        record = step_record(self.writer.path, step)
        if record is None or record.get(TRAJECTORY_STEP, step) != model_step:
            return
        restored = {
            PARAMS: fingerprint.to_hex(int(self.digest(params))),
            OPTIM: fingerprint.to_hex(int(self.digest(optimizer))),
        }
        differing = [f"{metric} {value} vs recorded {record.get(metric)}" for metric, value in restored.items()
                     if record.get(metric) != value]
        if differing:
            raise CheckpointError(
                f"{checkpoint}: restored state does not reproduce the record of step {step} in {self.writer.path} "
                f"({'; '.join(differing)})"
            )

    def truncate_after(self, step: int) -> None:
        self.writer.truncate_after(step)

    def sync(self) -> None:
        self.writer.sync()

    def close(self) -> None:
        self.flush(None)
        self.writer.close()


def _bits_to_float(bits: int) -> float:
    return struct.unpack("<f", (bits & 0xFFFFFFFF).to_bytes(4, "little"))[0]
