"""Synthetic experiment directories in the run-directory contract, for benchmarks, tests and report demos.

The step times follow a model (a decaying warmup, lognormal noise, a per-rank offset, and the deterministic arm
slower by `tax`); fingerprints are per-(step, rank) hashes shared by the deterministic runs, so the gates agree
unless a mismatch is injected. Records are written with vectorized pandas, one JSONL stream per rank with its
columnar mirror, exactly as the trainer's StepWriter lays them out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from taxbench.design import ALL_RUNS
from taxbench.rundir.provenance import config_hash
from taxbench.rundir.records import MANIFEST, METRICS, SCHEMA_VERSION, steps_file
from taxbench.rundir.run_manifest import Manifest, load_manifest
from taxbench.rundir.step_record import (
    ARM,
    BLOCK,
    DATA_S,
    DEVICE_S,
    GRAD_NORM,
    LOSS,
    RANK,
    REPLICA,
    SCHEMA_VERSION_FIELD,
    STEP,
    TIME_S,
    TOKENS,
    WINDOW_S,
)
from taxbench.rundir.step_stream import refresh_mirror
from taxbench.rundir.stop_file import STEPS, Stop

_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)


@dataclass(frozen=True)
class Injection:
    """A fingerprint that differs in one run from `step` on, starting at `rank` (later steps differ on all ranks)."""

    run: str  # e.g. "deterministic-1"
    step: int
    rank: int
    metric: str = "params"


@dataclass(frozen=True)
class SyntheticExperiment:
    ranks: int = 4
    steps: int = 60
    block_steps: int = 6
    warmup_steps: int = 6
    resume_step: int = 20
    step_time_s: float = 0.1
    tax: float = 0.05
    cv: float = 0.01
    recipe: str = "synthetic"
    seed: int = 0
    baseline_deterministic: bool = False  # baseline-1 repeats baseline-0's fingerprints (and loss)
    loss_noise: float = 0.0  # loss scatter between trajectories (the deterministic runs share one), growing with steps
    loss_offset: float = 0.0  # added to the deterministic runs' loss


def _hex(values: np.ndarray) -> np.ndarray:
    return np.char.mod("%016x", values)


def _fingerprints(steps: np.ndarray, ranks: np.ndarray, salt: int) -> dict[str, np.ndarray]:
    base = steps.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) ^ ranks.astype(np.uint64) * np.uint64(0xBF58476D)
    out = {}
    for i, metric in enumerate(METRICS):
        mixed = (base + np.uint64(salt * 1_000_003 + i)) * np.uint64(0x94D049BB133111EB) & _MASK
        out[metric] = _hex(mixed)
    return out


def _loss(spec: SyntheticExperiment, arm: str, replica: str, steps: np.ndarray) -> np.ndarray:
    """5/sqrt(step), plus the noise of the run's trajectory (its own generator, so step times do not change)."""
    trajectory = 0 if arm == "deterministic" else 1 if spec.baseline_deterministic or replica == "0" else 2
    scatter = np.random.default_rng([spec.seed, trajectory]).standard_normal(spec.steps)[steps - 1]
    offset = spec.loss_offset if arm == "deterministic" else 0.0
    return 5.0 / np.sqrt(steps) + spec.loss_noise * np.sqrt(steps / spec.steps) * scatter + offset


def _run_frame(spec: SyntheticExperiment, arm: str, replica: str, rng: np.random.Generator,
               injection: Injection | None) -> pd.DataFrame:
    steps = np.repeat(np.arange(1, spec.steps + 1), spec.ranks)
    ranks = np.tile(np.arange(spec.ranks), spec.steps)
    warmup = 1 + 2.0 * np.exp(-(steps - 1) / max(spec.warmup_steps / 3, 1))
    slowdown = 1 + spec.tax if arm == "deterministic" else 1.0
    rank_offset = 1 + 0.002 * (ranks % 7)
    noise = rng.lognormal(0.0, spec.cv, size=len(steps))
    time_s = spec.step_time_s * warmup * slowdown * rank_offset * noise
    salt = 1 if arm == "deterministic" or spec.baseline_deterministic or replica == "0" else 2
    frame = pd.DataFrame({
        SCHEMA_VERSION_FIELD: SCHEMA_VERSION, ARM: arm, REPLICA: replica, RANK: ranks, STEP: steps,
        BLOCK: (steps - 1) // spec.block_steps, DATA_S: 1e-4, TOKENS: 4096, TIME_S: time_s,
        WINDOW_S: time_s * 1.02, DEVICE_S: time_s * 0.98, LOSS: _loss(spec, arm, replica, steps),
        GRAD_NORM: 1.0,
        **_fingerprints(steps, ranks, salt),
    })
    if injection is not None and injection.run == f"{arm}-{replica}":
        hit = (steps > injection.step) | ((steps == injection.step) & (ranks >= injection.rank))
        frame.loc[hit, injection.metric] = "f" * len(frame[injection.metric].iloc[0])
    return frame


def _manifest(spec: SyntheticExperiment, name: str, arm: str, replica: str) -> Manifest:
    deterministic = arm == "deterministic"
    policy = {"name": arm, "deterministic": deterministic, "cudnn_benchmark": not deterministic,
              "allow_tf32": not deterministic, "cublas_workspace_config": ":4096:8" if deterministic else None,
              "nccl_algo": "Ring" if deterministic else None}
    config = {
        "recipe": {"name": spec.recipe, "micro_batch_size": 1, "global_batch_size": spec.ranks, "precision": "bf16"},
        "cluster": {"name": "synthetic", "device": "cuda", "gpus": spec.ranks},
        "experiment": {"name": name, "steps": spec.steps, "block_steps": spec.block_steps,
                       "warmup_steps": spec.warmup_steps, "resume_step": spec.resume_step, "confidence": 0.95,
                       "checkpoint_every_steps": 0},
        "arm_overrides": {},
    }
    return Manifest(
        experiment=name, run=f"{arm}-{replica}", arm=arm, replica=replica,
        config=config,
        provenance={"config_sha256": config_hash(config)},
        policy=policy,
        policy_applied={"device": "cuda", "use_deterministic_algorithms": deterministic,
                        "env": {"NCCL_ALGO": "Ring"} if deterministic else {}},
        layout={"world_size": spec.ranks, "backend": "nccl", "data_parallel": "fsdp"},
        stack={"hostname": "synthetic", "torch": "synthetic", "gpu": "synthetic GPU", "nccl": "2.0"},
    )


def write_experiment(root: Path, spec: SyntheticExperiment, injection: Injection | None = None) -> Path:
    """Write the five runs of one experiment under root (root/<run>/manifest.json, steps.rank<R>.jsonl)."""
    rng = np.random.default_rng(spec.seed)
    for ref in ALL_RUNS:
        run_dir = root / ref.name
        _manifest(spec, root.name, ref.arm, ref.replica).write(run_dir)
        frame = _run_frame(spec, ref.arm, ref.replica, rng, injection)
        for rank, part in frame.groupby(RANK, sort=True):
            stream = steps_file(run_dir, int(rank))
            part.to_json(stream, orient="records", lines=True)
            refresh_mirror(stream)  # what a rank's StepWriter leaves behind when it closes
    Stop(spec.steps, STEPS, None).write(root)
    return root


def change_config(root: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """Apply `change` to the config in every run's manifest and hash it again: the experiment as if it had run with
    that config (a fault, a calibration pair), for tests and demos."""
    for path in root.glob(f"*/{MANIFEST}"):
        manifest = load_manifest(path.parent)
        change(manifest.run_config)
        provenance = {**(manifest.provenance or {}), "config_sha256": config_hash(manifest.run_config)}
        dataclasses.replace(manifest, provenance=provenance).write(path.parent)
