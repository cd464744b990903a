"""What a verdict costs on this machine (a benchmark, not a test): for each recipe, the default experiment at a short
and a long length, each timed as a fresh `python -m taxbench` process (short and long in turn, --repeats pairs), and
from each pair (the figures are the pairs' medians: one wall-clock difference moves with every slow second):

- the timed share of the wall clock (the long run's summary.json cost_split, and the rest of its split);
- the marginal wall time per added step and run, (wall(long) - wall(short)) / (long - short) / runs that grow with
  the steps, as a ratio to the median timed step (1.0 would be a loop that costs nothing around the step).

    python benchmarks/cost_to_verdict.py                          # dense_tiny and moe_tiny, 60 and 300 steps, 3 pairs
    python benchmarks/cost_to_verdict.py experiment.checkpoint_every_steps=10 --recipes dense_tiny  # overrides first
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run(recipe: str, steps: int, out: Path, extra: list[str]) -> tuple[float, dict, dict]:
    """Wall seconds of one default experiment of `steps` steps, its summary and its cost.json."""
    name = f"{recipe}-{steps}"
    command = [sys.executable, "-m", "taxbench", f"+recipe={recipe}", f"experiment.steps={steps}",
               f"experiment.out_dir={out}", f"experiment.name={name}", "report.wandb=false", "report.html=false",
               *extra]
    began = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=out)
    wall = time.perf_counter() - began
    if done.returncode not in (0, 3):
        raise SystemExit(f"{' '.join(command)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return wall, *(json.loads((out / name / file).read_text()) for file in ("summary.json", "cost.json"))


def in_loop_overhead_s(summary: dict, cost: dict) -> float:
    """Seconds per timed step that the rounds spend around the steps (checkpoints, fingerprints, data, records, the
    round's all-reduce): the rounds' wall clock from their first step, less the timed steps, per step and run."""
    rounds = cost["rounds_s"] - (cost["first_step_unix"] - cost["schedule_start_unix"])
    return (rounds - cost["timed_steps_s"]) / (summary["steps"] * summary["tax"]["timed_runs"])


def growing_runs(summary: dict) -> int:
    """Runs whose length follows experiment.steps: the timed runs, and the gate-only runs when gate_steps follows it."""
    timed = summary["tax"]["timed_runs"]
    gate_only = 5 - timed if summary["interleave"] != "policy" else 5
    return timed + (gate_only if summary.get("gate_steps", summary["steps"]) == summary["steps"] else 0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", nargs="+", default=["dense_tiny", "moe_tiny"])
    parser.add_argument("--short", type=int, default=60)
    parser.add_argument("--long", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3,
                        help="short and long runs in turn, this many pairs; the figures are the pairs' medians")
    parser.add_argument("overrides", nargs="*", help="config overrides for every run, e.g. experiment.gate_steps=40")
    args = parser.parse_args()
    for recipe in args.recipes:
        pairs = []  # (short wall, long wall, the long run's summary and cost.json), short and long run in turn
        with tempfile.TemporaryDirectory(prefix="cost_to_verdict-") as folder:
            for repeat in range(args.repeats):
                out = Path(folder) / str(repeat)
                out.mkdir()
                short_wall, _, _ = run(recipe, args.short, out, args.overrides)
                pairs.append((short_wall, *run(recipe, args.long, out, args.overrides)))
        ratios, marginals, overheads = [], [], []
        for short_wall, long_wall, summary, cost in pairs:
            tax = summary["tax"]
            median = statistics.fmean([tax["baseline_median_s"], tax["deterministic_median_s"]])
            marginal = (long_wall - short_wall) / (args.long - args.short) / growing_runs(summary)
            marginals.append(marginal)
            ratios.append(marginal / median)
            overheads.append(in_loop_overhead_s(summary, cost) / median)
        # The pair whose ratio is the median stands for the rest in the lines below.
        short_wall, long_wall, summary, cost = pairs[ratios.index(statistics.median_low(ratios))]
        runs = growing_runs(summary)
        tax = summary["tax"]
        median = statistics.fmean([tax["baseline_median_s"], tax["deterministic_median_s"]])
        split = summary.get("cost_split") or {"share": {}, "wall_s": float("nan")}
        shares = " ".join(f"{part} {share:.0%}" for part, share in split["share"].items())
        print(f"{recipe}: wall {short_wall:.1f} s at {args.short} steps, {long_wall:.1f} s at {args.long}; "
              f"{runs} runs grow with the steps; {args.repeats} pairs, the median pair shown")
        print(f"  timed share {split['share'].get('timed_steps', float('nan')):.0%} of {split['wall_s']:.1f} s "
              f"({shares})")
        if split.get("startup_s"):
            parts = " ".join(f"{part} {seconds:.1f} s" for part, seconds in split["startup_s"].items())
            print(f"  startup {sum(split['startup_s'].values()):.1f} s: {parts}")
        overhead = in_loop_overhead_s(summary, cost)
        print(f"  in-loop overhead in the rounds {overhead * 1e3:.2f} ms per timed step ({overhead / median:.2f}x "
              f"the median step; pairs {' '.join(f'{r:.2f}' for r in overheads)})")
        print(f"  marginal wall per added step and run {statistics.median(marginals) * 1e3:.2f} ms = "
              f"{statistics.median(ratios):.2f}x the median timed step (median of pairs; pairs "
              f"{' '.join(f'{r:.2f}' for r in ratios)}; this pair's median step {median * 1e3:.2f} ms)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
