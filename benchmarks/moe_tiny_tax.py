"""Determinism tax of moe_tiny on this CPU, arms interleaved in one allocation (a benchmark, not a test).

Runs `python -m taxbench +recipe=moe_tiny` with one rank and 2 threads (the fast MoE combine is nondeterministic only
with 2+ threads), then prints the step-time ratio deterministic/baseline with its paired-t interval, the
Hodges-Lehmann cross-check and the three gate verdicts.

    python benchmarks/moe_tiny_tax.py                 # 120 steps per arm in blocks of 12
    python benchmarks/moe_tiny_tax.py --steps 240 --ranks 2
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=120, help="steps per arm (a multiple of --block)")
    parser.add_argument("--block", type=int, default=12, help="steps per interleaved block")
    parser.add_argument("--warmup", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2, help="threads per rank (>= 2 for CPU nondeterminism)")
    parser.add_argument("--ranks", type=int, default=1, help="gloo ranks (1 runs in-process)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="moe_tiny_tax-") as out:
        cluster = ["cluster=inprocess"] if args.ranks == 1 else ["cluster=local", f"cluster.cpu_ranks={args.ranks}"]
        command = [
            sys.executable, "-m", "taxbench", "+recipe=moe_tiny", *cluster, f"cluster.threads_per_rank={args.threads}",
            f"experiment.steps={args.steps}", f"experiment.block_steps={args.block}",
            f"experiment.warmup_steps={args.warmup}", f"experiment.resume_step={args.steps // 2}",
            f"experiment.out_dir={out}", "experiment.name=moe_tiny_tax", "report.wandb=false", "report.html=false",
        ]
        done = subprocess.run(command, capture_output=True, text=True, cwd=out)
        if done.returncode not in (0, 3):
            print(done.stderr[-4000:], file=sys.stderr)
            return done.returncode
        summary = json.loads((Path(out) / "moe_tiny_tax" / "summary.json").read_text())
    tax = summary["tax"]
    ratio = 1 + tax["tax"]
    print(f"moe_tiny on CPU, {args.ranks} rank(s) x {args.threads} threads, {args.steps} steps/arm, "
          f"{tax['pairs']} interleaved block pairs")
    print(f"median step  baseline {tax['baseline_median_s'] * 1e3:.2f} ms (CV {tax['baseline_cv']:.1%})  "
          f"deterministic {tax['deterministic_median_s'] * 1e3:.2f} ms (CV {tax['deterministic_cv']:.1%})")
    print(f"ratio det/base {ratio:.4f}  tax {tax['tax']:+.2%}  {tax['confidence']:.0%} CI "
          f"[{tax['low']:+.2%}, {tax['high']:+.2%}]  Hodges-Lehmann {tax['hl_tax']:+.2%} "
          f"[{tax['hl_low']:+.2%}, {tax['hl_high']:+.2%}]{'  (still drifting)' if tax['drifting'] else ''}")
    for verdict in summary["verdicts"]:
        state = "bitwise identical" if verdict["agree"] else f"differs: {verdict['first_mismatch']}"
        print(f"{verdict['gate']:16} {state}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
