"""What one rank of a big world materialises, measured on this CPU: rank r of N simulated with torch's fake process
group, built through the trainer's own code path (taxbench.stacks.native: meta-device model, stage split, experts over
ep, FSDP2 shards, then this rank's share materialised) up to and including the optimizer's state.

    python benchmarks/rank_build.py +recipe=moe_1t cluster.gpus=2432 --ranks 0,1215,2431

Per rank (each in a fresh process, so its peak RSS is its own): parameters materialised, bytes of weights, gradients
and AdamW state, the peak RSS of the process, and the plan's figures for that rank's pipeline stage
(taxbench.parallel.plan) beside them. Exit 1 when any rank holds more than 10% above the plan's weights + grads +
optimizer state, 2 on bad input. Activations are not built (no step runs): the plan's activation figure is shown for
reference only. Collectives of the fake process group move no data, so the values are not those of a real run; the
shapes and the bytes are.

With --checkpoint DIR each rank then checkpoints its share as the trainer does (taxbench.checkpoint.state: DCP files
and the rank's extras, in DIR/rank<R>/checkpoints/step1, deleted afterwards) and prints the bytes written, the time to
write them, to record their sha256 (taxbench.checkpoint.store), to verify them (the resume check: stat and rehash),
an xxh3-128 of the same files for comparison, and the time and bytes (the process's rchar) of restoring them into the
live share. The simulated rank writes alone (DCP without collectives): it also writes the replicated tensors a real
run writes once, on the lowest rank, so its bytes are an upper bound. Exit 1 also when a restore reads more than 10%
above what the rank wrote.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
import xxhash
from hydra import compose, initialize_config_module
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException
from torch.distributed.tensor import DTensor

from taxbench.checkpoint import state
from taxbench.checkpoint.store import RunCheckpoints
from taxbench.config.schema import ConfigError, TaxbenchConfig, load_config, register_configs
from taxbench.parallel import distributed
from taxbench.parallel.layout import ParallelModel, layout_for
from taxbench.parallel.plan import make_plan
from taxbench.stacks.native import build_optimizer, build_pipeline

TOLERANCE = 0.10
MIB = 1024**2


def compose_config(overrides: list[str]) -> TaxbenchConfig:
    register_configs()
    with initialize_config_module("taxbench.conf", version_base="1.3"):
        raw = compose("config", overrides=overrides)
    return load_config(raw)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _bytes(tensors: list[torch.Tensor]) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


def _bytes_read() -> int:
    """Bytes this process has read through system calls so far (Linux /proc/self/io rchar)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no rchar line")


def _xxh3_s(files: list[Path]) -> float:
    started = time.perf_counter()
    for path in files:
        digest = xxhash.xxh3_128()
        with path.open("rb") as handle:
            while chunk := handle.read(1 << 24):
                digest.update(chunk)
    return time.perf_counter() - started


def checkpoint_rank(root: Path, rank: int, parallel: ParallelModel, optimizer: torch.optim.Optimizer) -> dict:
    """Write, hash, verify and restore this rank's share as the trainer's checkpoints do; the bytes and seconds."""
    checkpoints = RunCheckpoints(root / f"rank{rank}", rank)
    directory = checkpoints.path(1)
    try:
        started = time.perf_counter()
        files = state.save(directory, parallel, optimizer, {"step": 1}, rank, alone=True)
        written = time.perf_counter()
        size = sum(path.stat().st_size for path in files)
        checkpoints.record_checksums(1, files)
        hashed = time.perf_counter()
        problem = checkpoints.problem(1)
        verified = time.perf_counter()
        if problem is not None:
            raise RuntimeError(f"a checkpoint just written does not verify: {problem}")
        xxh3_s = _xxh3_s(files)
        load_started = time.perf_counter()
        state.load(directory, parallel, optimizer, rank, torch.device("cpu"), alone=True)
        loaded = time.perf_counter()
        read_before = _bytes_read()  # a second restore: the first one's bytes include the modules it imported
        state.load(directory, parallel, optimizer, rank, torch.device("cpu"), alone=True)
        read = _bytes_read() - read_before
    finally:
        shutil.rmtree(checkpoints.dir.parent, ignore_errors=True)
    return {"ckpt_bytes": size, "write_s": written - started, "sha256_s": hashed - written,
            "verify_s": verified - hashed, "xxh3_s": xxh3_s, "load_s": loaded - load_started, "read_bytes": read}


def build_rank(cfg: TaxbenchConfig, rank: int, checkpoint_root: Path | None = None) -> dict[str, float]:
    """Build rank `rank`'s share as the trainer does, allocate its gradients and optimizer state, and measure it
    (and its checkpoint, under `checkpoint_root`)."""
    recipe, world = cfg.recipe, cfg.cluster.gpus
    ctx = distributed.simulate(rank, world)
    try:
        layout = layout_for(recipe.parallel, world, rank)
        micro_batches = recipe.global_batch_size // (recipe.micro_batch_size * layout.dp)
        started = time.perf_counter()
        built = build_pipeline(recipe, cfg.arms["deterministic"], ctx, micro_batches)
        params = list(built.parts.parameters())
        built_s = time.perf_counter() - started
        for param in params:
            param.grad = torch.zeros_like(param)
        optimizer = build_optimizer(recipe, params)
        optimizer.step()  # AdamW allocates its moments at the first step
        moments = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        measured = {
            "rank": rank, "stage": layout.pp_rank, "params": sum(_local(p).numel() for p in params),
            "weights": _bytes(params), "grads": _bytes([p.grad for p in params if p.grad is not None]),
            "optimizer": _bytes(moments), "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "build_s": built_s,
        }
        if checkpoint_root is not None:
            measured |= checkpoint_rank(checkpoint_root, rank, built.parallel, optimizer)
        return measured
    finally:
        distributed.shutdown()


def _mib(value: float) -> str:
    return f"{value / MIB:9.1f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="0", help="comma-separated ranks to build (default: 0)")
    parser.add_argument("--checkpoint", type=Path, default=None, metavar="DIR",
                        help="also checkpoint each rank's share under DIR (deleted after) and time it")
    parser.add_argument("--one-rank", type=int, default=None, help=argparse.SUPPRESS)  # the per-rank child process
    args, overrides = parser.parse_known_args()
    try:
        cfg = compose_config(overrides)
        ranks = [int(r) for r in args.ranks.split(",")]
        world = cfg.cluster.gpus
        plan = make_plan(cfg)
        if not plan.valid:
            raise ConfigError(f"the layout does not fit cluster.gpus={world}: {'; '.join(plan.problems)}")
        bad = [r for r in ranks if not 0 <= r < world]
        if bad:
            raise ConfigError(f"--ranks {bad} outside the world of cluster.gpus={world} ranks (0..{world - 1})")
    except (ConfigError, HydraException, OmegaConfBaseException, ValueError) as exc:  # bad input: one line, exit 2
        print(f"rank_build: error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    if args.one_rank is not None:
        print(json.dumps(build_rank(cfg, args.one_rank, args.checkpoint)))
        return 0
    extra = [] if args.checkpoint is None else ["--checkpoint", str(args.checkpoint)]

    print(f"{cfg.recipe.name} at {world} ranks (layout {plan.layout}); {plan.total_params / 1e9:.1f}B parameters in "
          "the whole model. MiB per rank, built by taxbench.stacks.native on a simulated rank (fake process group):")
    print(f"{'rank':>6} {'stage':>5} {'params':>13} {'weights':>9} {'grads':>9} {'optim':>9} {'held':>9} "
          f"{'plan':>9} {'ratio':>6} {'peak RSS':>9} {'build s':>7}")
    worst, worst_read = 0.0, 0.0
    checkpoints = []
    for rank in ranks:
        child = subprocess.run([sys.executable, __file__, *overrides, *extra, "--one-rank", str(rank)],
                               capture_output=True, text=True)
        if child.returncode != 0:
            print(f"rank {rank}: build failed (exit {child.returncode}):\n{child.stderr.strip()[-2000:]}",
                  file=sys.stderr)
            return 1
        got = json.loads(child.stdout.strip().splitlines()[-1])
        stage = plan.stages[got["stage"]]
        held = got["weights"] + got["grads"] + got["optimizer"]
        planned = stage.weights + stage.grads + stage.optimizer
        ratio = held / planned
        worst = max(worst, ratio)
        print(f"{rank:>6} {got['stage']:>5} {got['params']:>13,} {_mib(got['weights'])} {_mib(got['grads'])} "
              f"{_mib(got['optimizer'])} {_mib(held)} {_mib(planned)} {ratio:6.3f} {_mib(got['peak_rss'])}  "
              f"{got['build_s']:6.1f}")
        if "ckpt_bytes" in got:
            checkpoints.append(got)
            worst_read = max(worst_read, got["read_bytes"] / got["ckpt_bytes"])
    print("plan: weights, grads and optimizer state of the heaviest rank of that stage; FSDP2 cuts dim 0 into "
          "ceil-sized chunks, so later ranks of a shard group may hold less (or no experts at all). Activations are "
          f"not built here ({_mib(plan.stages[0].activations).strip()} MiB on stage 0 by the plan).")
    if checkpoints:
        print("checkpoint of each rank's share (written alone: an upper bound of a real rank's bytes), MiB and s:")
        print(f"{'rank':>6} {'bytes':>9} {'write':>7} {'sha256':>7} {'verify':>7} {'xxh3':>7} {'load':>7} "
              f"{'read':>9} {'read/written':>12}")
        for got in checkpoints:
            print(f"{got['rank']:>6} {_mib(got['ckpt_bytes'])} {got['write_s']:7.1f} {got['sha256_s']:7.1f} "
                  f"{got['verify_s']:7.1f} {got['xxh3_s']:7.1f} {got['load_s']:7.1f} {_mib(got['read_bytes'])} "
                  f"{got['read_bytes'] / got['ckpt_bytes']:12.3f}")
    sys.stdout.flush()
    if worst_read > 1 + TOLERANCE:
        print(f"FAIL: a restore read {worst_read:.3f}x what its rank wrote (more than {1 + TOLERANCE:.2f}x)",
              file=sys.stderr)
        return 1
    if worst > 1 + TOLERANCE:
        print(f"FAIL: a rank holds {worst:.3f}x the plan's figure (more than {1 + TOLERANCE:.2f}x)", file=sys.stderr)
        return 1
    print(f"ok: every rank within {TOLERANCE:.0%} of the plan (worst {worst:.3f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
