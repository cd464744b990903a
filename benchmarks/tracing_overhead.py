"""Tracing overhead per rung, as a ratio to the untraced step.

Four trainers of the same recipe (untraced, rung 1, rung 2, rung 3; every step traced) advance in interleaved blocks,
in a seeded random order per round, on one in-process rank. Each block's wall time per step (capture, host copy and
trace write included) is divided by the untraced block of the same round; the script prints the median ratio per
rung and the median step times.

    python benchmarks/tracing_overhead.py --rounds 8 --block-steps 3
    python benchmarks/tracing_overhead.py --override recipe.model.d_model=256 --override recipe.model.n_layers=4
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from taxbench.config.schema import load_config, register_configs
from taxbench.parallel.distributed import DistContext
from taxbench.train.trainer import RunSpec, Trainer

ARMS = {"untraced": None, "rung1": 1, "rung2": 2, "rung3": 3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--block-steps", type=int, default=3)
    parser.add_argument("--override", action="append", default=[], help="hydra override for the recipe")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    register_configs()
    with initialize_config_module("taxbench.conf", version_base="1.3"):
        raw = compose("config", overrides=["experiment.name=tracing-overhead", "cluster.cpu_ranks=1", *args.override])
    base = OmegaConf.to_container(raw, resolve=True)
    torch.set_num_threads(1)
    ctx = DistContext(0, 1, 0, torch.device("cuda" if torch.cuda.is_available() else "cpu"), "none")
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {}
        for name, rung in ARMS.items():
            cfg = load_config(base)
            if rung is not None:
                cfg.experiment.trace.enabled = True
                cfg.experiment.trace.rung = rung
            spec = RunSpec.of(cfg, "deterministic", name, cfg.arms["deterministic"], Path(tmp) / name)
            trainers[name] = Trainer(spec, ctx)
        for trainer in trainers.values():  # warm up every arm once
            trainer.run_block(1, 0)
        per_step: dict[str, list[float]] = {name: [] for name in ARMS}
        ratios: dict[str, list[float]] = {name: [] for name in ARMS if name != "untraced"}
        order = list(ARMS)
        rng = random.Random(args.seed)
        for block in range(args.rounds):
            rng.shuffle(order)
            times = {}
            for name in order:
                start = time.perf_counter()
                trainers[name].run_block(args.block_steps, block + 1)
                times[name] = (time.perf_counter() - start) / args.block_steps
                per_step[name].append(times[name])
            for name in ratios:
                ratios[name].append(times[name] / times["untraced"])
        records = {name: sum(1 for _ in (Path(tmp) / name / "trace").glob("*.jsonl")) for name in ARMS}
        lines = {name: sum(len(p.read_text().splitlines()) for p in (Path(tmp) / name / "trace").glob("*.jsonl"))
                 for name in ARMS if records[name]}
        for trainer in trainers.values():
            trainer.close()
    print(f"{args.rounds} interleaved rounds x {args.block_steps} steps, device {ctx.device}")
    print(f"{'arm':<10} {'median step s':>14} {'ratio to untraced (median)':>28} {'records/step':>13}")
    steps_traced = (args.rounds * args.block_steps + 1)
    for name in ARMS:
        ratio = f"{statistics.median(ratios[name]):.2f}x" if name in ratios else "1.00x"
        count = f"{lines[name] / steps_traced:.0f}" if name in lines else "-"
        print(f"{name:<10} {statistics.median(per_step[name]):>14.4f} {ratio:>28} {count:>13}")


if __name__ == "__main__":
    main()
