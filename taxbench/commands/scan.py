"""`taxbench scan`: one training step of a recipe under each policy, every ATen op replayed on identical inputs.

For each arm (baseline, then deterministic) a trainer is built exactly as a run builds it (seeded init, the arm's
policy and MoE kernels, the recipe's data), on one rank in this process, and its first step (forward, backward,
gradient reduction, clipping and, unless `scan.optimizer_step=false`, the optimizer step) runs under
taxbench.tracing.op_scan.OpRepeatScan. In the deterministic arm an op without a deterministic implementation is
listed and run on the warn_only path instead of stopping the step.

Exit 3 when the deterministic policy has an op whose replays differed or that has no deterministic implementation,
0 when it has none (the baseline's findings are reported, never a failure). A step runs one rank: collectives and a
layout's sharding are out of the scan's sight (see the op_scan docstring for the other blind spots).
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import textwrap
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from taxbench import exit_codes
from taxbench.config.schema import ConfigError, FaultKind, TaxbenchConfig, TraceConfig
from taxbench.config.shape import ParallelShape
from taxbench.launchers.worker import rank_process
from taxbench.parallel.distributed import free_port
from taxbench.progress import StepProgress, step_progress
from taxbench.tracing.capture import OPTIMIZER_SCOPE, ModuleScope
from taxbench.tracing.op_scan import NO_DETERMINISTIC_IMPLEMENTATION, OpRepeatScan, PolicyScan, scanned
from taxbench.train.trainer import RunSpec, Trainer

SCAN_FILE = "scan.json"
DEFAULT_REPEATS = 3
BLIND_SPOTS = (
    "single rank in one process: collectives (all-reduce, all-to-all) and layout sharding are not scanned",
    "only ops that reach the ATen dispatcher: a fused custom kernel called directly (Triton, C++/CUDA extensions "
    "without a registered op) is invisible or one opaque op",
    "ops on tensor subclasses without storage (DTensor, FSDP2, torchao's float8 tensors) run unreplayed (counted in "
    "not_replayed), and the ops such a subclass runs inside its own dispatch (float8 GEMMs) are not seen",
    "one step: nondeterminism that needs other data, sizes or thread timing to show may be missed",
)


@dataclass(frozen=True)
class ScanSettings:
    repeats: int = DEFAULT_REPEATS
    optimizer_step: bool = True
    out: Path | None = None  # the JSON file; default <experiment.out_dir>/scan-<experiment.name>/scan.json


class _OpCounter(TorchDispatchMode):
    """Counts the ops of a step (a first, unscanned step sizes the progress bar)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops += scanned(func)
        return func(*args, **(kwargs or {}))


def check_scan(cfg: TaxbenchConfig, settings: ScanSettings) -> None:
    """Refuse what the scan cannot do, before anything runs (one line each, exit 2)."""
    if settings.repeats < 1:
        raise ConfigError(f"scan.repeats={settings.repeats} must be >= 1 (replays per op; default {DEFAULT_REPEATS})")
    parallel = cfg.recipe.parallel
    replica = ParallelShape.of(parallel, 1).model_parallel
    if replica > 1:
        raise ConfigError(f"taxbench scan runs one rank, but recipe {cfg.recipe.name} needs tp*pp = "
                          f"{replica} ranks per replica; scan it with recipe.parallel.tp=1 "
                          "recipe.parallel.pp=1")
    if parallel.ep > 1:
        raise ConfigError(f"taxbench scan runs one rank, but recipe {cfg.recipe.name} has recipe.parallel.ep="
                          f"{parallel.ep} (experts on {parallel.ep} ranks); scan it with recipe.parallel.ep=1")
    fault = cfg.experiment.fault
    if fault.enabled and fault.kind is not FaultKind.nondeterministic_op:
        raise ConfigError(f"experiment.fault.kind={fault.kind.value} acts between steps or on collectives; a scan "
                          "runs one step on one rank: plant experiment.fault.kind=nondeterministic_op")


def _scan_fault(cfg: TaxbenchConfig, arm: str) -> Any:
    """The planted nondeterministic_op fault, moved to the scanned step, for the arm it names."""
    fault = cfg.experiment.fault
    if not fault.enabled or fault.arm != arm:
        return None
    return dataclasses.replace(fault, step=1, rank=0)


@contextmanager
def _trainer(cfg: TaxbenchConfig, arm: str, ctx: Any, scratch: Path) -> Iterator[Trainer]:
    spec = RunSpec.of(cfg, arm, "scan", cfg.arms[arm], scratch / arm)
    spec = dataclasses.replace(spec, trace=TraceConfig(), fault=_scan_fault(cfg, arm))
    trainer = Trainer(spec, ctx)
    try:
        yield trainer
    finally:
        trainer.close()


@contextmanager
def _warn_only() -> Iterator[None]:
    """Strict deterministic mode relaxed to warn_only, quietly: the counting pass runs every op, also those without
    a deterministic implementation (the scan itself notes them)."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(enabled, warn_only=True)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=f".*{NO_DETERMINISTIC_IMPLEMENTATION}")
            yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


def _count_ops(cfg: TaxbenchConfig, arm: str, ctx: Any, scratch: Path, settings: ScanSettings) -> int:
    with _trainer(cfg, arm, ctx, scratch / "count") as trainer, trainer.activated():
        batches = trainer.next_batches()
        with _warn_only(), _OpCounter() as counter:
            trainer.optimize(batches, settings.optimizer_step)
    return counter.ops


def _check_writable(out: Path) -> None:
    """Refuse an output path the scan could not write, before the scan runs."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"scan output {out}: {exc.strerror or exc}; choose another scan.out") from exc
    if not os.access(out.parent, os.W_OK) or out.is_dir():
        raise ConfigError(f"scan output {out}: not writable; choose another scan.out")


def scan_arm(cfg: TaxbenchConfig, arm: str, ctx: Any, scratch: Path, settings: ScanSettings,
             progress: StepProgress) -> PolicyScan:
    """One step of `arm` under the op repeat scan."""
    arm_policy = cfg.arms[arm]
    with _trainer(cfg, arm, ctx, scratch) as trainer, trainer.activated():
        scope = ModuleScope()
        handles = scope.install(trainer.raw_model.named_modules())
        handles.append(trainer.optimizer.register_step_pre_hook(lambda *_: scope.enter(OPTIMIZER_SCOPE)))
        handles.append(trainer.optimizer.register_step_post_hook(lambda *_: scope.leave(OPTIMIZER_SCOPE)))
        batches = trainer.next_batches()
        mode = OpRepeatScan(arm_policy.name, arm_policy.deterministic, settings.repeats, scope, progress.advance)
        try:
            with trainer.step_scope(), mode:
                trainer.optimize(batches, settings.optimizer_step)
        finally:
            for handle in handles:
                handle.remove()
    return mode.finish()


def run_scan(cfg: TaxbenchConfig, settings: ScanSettings) -> tuple[list[PolicyScan], Path]:
    """Scan every arm (one rank, in this process); the results and the JSON file they were written to."""
    out = settings.out or Path(cfg.experiment.out_dir) / f"scan-{cfg.experiment.name}" / SCAN_FILE
    _check_writable(out)
    scans: list[PolicyScan] = []
    with tempfile.TemporaryDirectory(prefix="taxbench-scan-") as tmp, \
            rank_process([cfg], 0, 1, 0, cfg.cluster.master_addr, free_port(cfg.cluster.master_addr)) as ctx:
        scratch = Path(tmp)
        arms = list(cfg.arms)
        total = sum(_count_ops(cfg, arm, ctx, scratch, settings) for arm in arms)
        with step_progress(total, f"scan {cfg.recipe.name}", unit="ops") as progress:
            for arm in arms:
                progress.describe(arm)
                scans.append(scan_arm(cfg, arm, ctx, scratch / "scan", settings, progress))
    write_scan(out, cfg, settings, scans)
    return scans, out


def exit_code(scans: list[PolicyScan]) -> int:
    """3 when a deterministic policy has a differing op or one without a deterministic implementation; 4 when a
    deterministic policy replayed no op (no evidence either way); else 0."""
    deterministic = [scan for scan in scans if scan.deterministic]
    if any(scan.nondeterministic or scan.no_deterministic_implementation for scan in deterministic):
        return exit_codes.NOT_DETERMINISTIC
    if not deterministic or any(scan.ops_replayed == 0 for scan in deterministic):
        return exit_codes.INCOMPLETE
    return exit_codes.OK


def write_scan(out: Path, cfg: TaxbenchConfig, settings: ScanSettings, scans: list[PolicyScan]) -> None:
    document = {
        "recipe": cfg.recipe.name,
        "device": cfg.cluster.device.value,
        "ranks": 1,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "repeats": settings.repeats,
        "optimizer_step": settings.optimizer_step,
        "exit_code": exit_code(scans),
        "policies": [scan.to_dict() for scan in scans],
        "blind_spots": list(BLIND_SPOTS),
    }
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(document, indent=2) + "\n")
    except OSError as exc:
        raise ConfigError(f"scan output {out}: {exc.strerror or exc}; choose another scan.out") from exc


def _shapes(shapes: list[list[int]]) -> str:
    return " ".join("x".join(map(str, shape)) or "scalar" for shape in shapes)


def render(scans: list[PolicyScan], out: Path) -> str:
    """The console tables, one per policy."""
    lines: list[str] = []
    for scan in scans:
        if scan.ops_replayed == 0:
            verdict = "NO OP REPLAYED: no evidence"
        elif scan.clean:
            verdict = "clean"
        else:
            verdict = "NONDETERMINISTIC OPS" if scan.deterministic else "nondeterministic ops"
        lines.append(f"policy {scan.policy}: {scan.ops_seen} ops, {scan.ops_replayed} replayed {scan.repeats}x: "
                     f"{verdict}")
        for op in scan.nondeterministic:  # two lines each, not a table: op and module names run long
            lines.extend(_wrapped(f"{op.op} in {op.scope or '<top>'}", indent=2))
            lines.extend(_wrapped(f"differed in {op.most_differed}/{op.repeats} replays, {op.calls_differed}/"
                                  f"{op.calls} calls; inputs {_shapes(op.shapes)} "
                                  f"{op.dtypes[0] if op.dtypes else '-'}", indent=4))
        for entry in scan.no_deterministic_implementation:
            lines.extend(_wrapped(f"no deterministic implementation: {entry.op} in {entry.scope or '<top>'} "
                                  f"({entry.calls} calls)", indent=2))
        if scan.not_replayed:
            lines.extend(_wrapped(f"not replayed (inputs without plain storage): {sum(scan.not_replayed.values())} "
                                  f"calls of {len(scan.not_replayed)} ops", indent=2))
    lines.append(f"details: {out}")  # a path is never broken: it is copied whole
    return "\n".join(lines)


def _wrapped(text: str, indent: int) -> list[str]:
    """`text` wrapped to 80 columns, its continuation lines indented two more (long words are not broken)."""
    return textwrap.wrap(text, width=80, initial_indent=" " * indent, subsequent_indent=" " * (indent + 2),
                         break_long_words=False, break_on_hyphens=False)
