"""What one rank of a big world materialises, measured on this CPU: rank r of N simulated with torch's fake process
group, built through the trainer's own code path (taxbench.train.build: meta-device model, stage split, experts over
ep, FSDP2 shards, then this rank's share materialised) up to and including the optimizer's state.

    python benchmarks/rank_build.py +recipe=moe_1t cluster.gpus=2432 --ranks 0,1215,2431

Per rank (each in a fresh process, so its peak RSS is its own): parameters materialised, bytes of weights, gradients
and AdamW state, the peak RSS of the process, and the plan's figures for that rank's pipeline stage
(taxbench.parallel.plan) beside them. Exit 1 when any rank holds more than 10% above the plan's weights + grads +
optimizer state, 2 on bad input. Activations are not built (no step runs): the plan's activation figure is shown for
reference only. Collectives of the fake process group move no data, so the values are not those of a real run; the
shapes and the bytes are.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch
from hydra import compose, initialize_config_module
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from torch.distributed.tensor import DTensor

from taxbench.config.schema import ConfigError, TaxbenchConfig, register_configs, to_typed
from taxbench.parallel import distributed
from taxbench.parallel.layout import layout_for
from taxbench.parallel.plan import make_plan
from taxbench.train.build import build_optimizer, build_pipeline

TOLERANCE = 0.10
MIB = 1024**2


def compose_config(overrides: list[str]) -> TaxbenchConfig:
    register_configs()
    with initialize_config_module("taxbench.conf", version_base="1.3"):
        raw = compose("config", overrides=overrides)
    return to_typed(OmegaConf.to_container(raw, resolve=True))  # type: ignore[arg-type]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _bytes(tensors: list[torch.Tensor]) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


def build_rank(cfg: TaxbenchConfig, rank: int) -> dict[str, float]:
    """Build rank `rank`'s share as the trainer does, allocate its gradients and optimizer state, and measure it."""
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
        state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        return {
            "rank": rank, "stage": layout.pp_rank, "params": sum(_local(p).numel() for p in params),
            "weights": _bytes(params), "grads": _bytes([p.grad for p in params if p.grad is not None]),
            "optimizer": _bytes(state), "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "build_s": built_s,
        }
    finally:
        distributed.shutdown()


def _mib(value: float) -> str:
    return f"{value / MIB:9.1f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="0", help="comma-separated ranks to build (default: 0)")
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
        print(json.dumps(build_rank(cfg, args.one_rank)))
        return 0

    print(f"{cfg.recipe.name} at {world} ranks (layout {plan.layout}); {plan.total_params / 1e9:.1f}B parameters in "
          "the whole model. MiB per rank, built by taxbench.train.build on a simulated rank (fake process group):")
    print(f"{'rank':>6} {'stage':>5} {'params':>13} {'weights':>9} {'grads':>9} {'optim':>9} {'held':>9} "
          f"{'plan':>9} {'ratio':>6} {'peak RSS':>9} {'build s':>7}")
    worst = 0.0
    for rank in ranks:
        child = subprocess.run([sys.executable, __file__, *overrides, "--one-rank", str(rank)], capture_output=True,
                               text=True)
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
    print("plan: weights, grads and optimizer state of the heaviest rank of that stage; FSDP2 cuts dim 0 into "
          "ceil-sized chunks, so later ranks of a shard group may hold less (or no experts at all). Activations are "
          f"not built here ({_mib(plan.stages[0].activations).strip()} MiB on stage 0 by the plan).")
    if worst > 1 + TOLERANCE:
        print(f"FAIL: a rank holds {worst:.3f}x the plan's figure (more than {1 + TOLERANCE:.2f}x)", file=sys.stderr)
        return 1
    print(f"ok: every rank within {TOLERANCE:.0%} of the plan (worst {worst:.3f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
