"""The moe_1t proxy's tax and step time per pipeline schedule, measured side by side in one run.

    python benchmarks/pipeline_schedules.py [--steps 24] [--schedules 1F1B GPipe Interleaved1F1B]

Each schedule runs the proxy (4 gloo ranks: pp=2 x dp=2 with ep=2, FSDP2, bf16, full recompute) as one taxbench
experiment; the table gives the baseline's median step time, its ratio to 1F1B's, the tax with its interval and the
gates. Interleaved schedules use 2 virtual stages per rank (so 4 stages of one block each). On a 2-core machine the
4 ranks share the cores: read ratios, not absolute times.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

VIRTUAL = {"Interleaved1F1B": 2, "InterleavedZeroBubble": 2, "ZBVZeroBubble": 2}


def run(schedule: str, steps: int, out: Path) -> dict:
    overrides = [
        "+recipe=moe_1t_proxy", f"recipe.parallel.pp_schedule={schedule}",
        f"recipe.parallel.virtual_stages={VIRTUAL.get(schedule, 1)}", f"experiment.steps={steps}",
        "experiment.block_steps=1", "experiment.warmup_steps=6", "experiment.resume_step=6",
        "report.wandb=false", "report.html=false", f"experiment.out_dir={out}", f"experiment.name={schedule}",
    ]
    done = subprocess.run([sys.executable, "-m", "taxbench", *overrides], capture_output=True, text=True)
    if done.returncode not in (0, 3):
        raise SystemExit(f"{schedule}: exit {done.returncode}\n{done.stderr[-2000:]}")
    return json.loads((out / schedule / "summary.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--schedules", nargs="+", default=["1F1B", "GPipe", "Interleaved1F1B"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = {schedule: run(schedule, args.steps, Path(tmp)) for schedule in args.schedules}
    reference = results[args.schedules[0]]["tax"]["baseline_median_s"]
    print(f"{'schedule':<22} {'baseline ms':>11} {'vs ' + args.schedules[0]:>9} {'tax':>8} {'95% CI':>20}  gates")
    for schedule, summary in results.items():
        tax = summary["tax"]
        gates = "identical" if summary["deterministic_ok"] else summary["outcome"]
        interval = f"[{tax['low'] * 100:+.1f}%, {tax['high'] * 100:+.1f}%]"
        print(f"{schedule:<22} {tax['baseline_median_s'] * 1e3:>11.1f} {tax['baseline_median_s'] / reference:>9.2f} "
              f"{tax['tax'] * 100:>+7.1f}% {interval:>20}  {gates}")


if __name__ == "__main__":
    main()
