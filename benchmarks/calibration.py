"""Is the tax estimate right? Bias and coverage on a planted tax, idle and loaded, and what timing every run buys.

Runs `python -m taxbench` as an A/A calibration pair (experiment.calibration=true: both arms on the baseline policy,
so the true tax is exactly experiment.planted_tax) N times at each planted value under each interleave mode (all:
four models timed in rounds; policy: one model whose policy switches per block), and N times as the schedule was
before this instrument was calibrated (only the *-0 pair timed, 6-step blocks, automatic GC:
experiment.interleave=pair experiment.block_steps=6 experiment.manual_gc=false) at the same steps per run. Every
configuration runs once per load level (--load: that many busy processes beside it, as other jobs on a shared
machine), and the configurations take turns within each repeat, so drift over the benchmark lands on all alike.
Prints per configuration the bias (median estimate - planted), the coverage (share of the intervals holding the
planted value), the median half-width and what the plant delivered (the deterministic runs' waits over their own
unplanted time, from the records: the estimate's truth as far as the arms train at the same speed without it), and
the half-width ratio before / all.

    python benchmarks/calibration.py                      # 20 repeats, 120 steps per run, one in-process rank
    python benchmarks/calibration.py --repeats 30 --ranks 2 --steps 180 --load 0 2
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def experiment(out: Path, name: str, overrides: list[str]) -> dict:
    command = [sys.executable, "-m", "taxbench", f"experiment.out_dir={out}", f"experiment.name={name}",
               "experiment.calibration=true", "report.wandb=false", "report.html=false", *overrides]
    done = subprocess.run(command, capture_output=True, text=True, cwd=out)
    if done.returncode != 0:
        raise SystemExit(f"{name}: exit {done.returncode}\n{done.stderr[-3000:]}")
    summary = json.loads((out / name / "summary.json").read_text())
    summary["delivered"] = delivered(out / name)
    return summary


def delivered(root: Path) -> float:
    """What the plant delivered, measured from the records apart from the estimator: the time the deterministic runs'
    waits added over those steps' own unplanted time (a ratio of sums; a wait's last overrun is never paid back)."""
    planted = unplanted = 0.0
    for stream in root.glob("deterministic-*/steps.rank*.jsonl"):
        for line in stream.read_text().splitlines():
            record = json.loads(line)
            planted += record.get("planted_s", 0.0)
            unplanted += record["time_s"] - record.get("planted_s", 0.0)
    return planted / unplanted if unplanted else float("nan")


class Load:
    """`processes` busy loops beside the benchmark while it is entered (none for 0)."""

    def __init__(self, processes: int) -> None:
        self.processes = processes
        self.running: list[subprocess.Popen] = []

    def __enter__(self) -> Load:
        self.running = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(self.processes)]
        return self

    def __exit__(self, *exc: object) -> None:
        for process in self.running:
            process.kill()
            process.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--steps", type=int, default=120, help="steps per run (a multiple of --block)")
    parser.add_argument("--block", type=int, default=1)
    parser.add_argument("--planted", type=float, nargs="+", default=[0.0, 0.02])
    parser.add_argument("--interleave", nargs="+", default=["all", "policy"], choices=["all", "pair", "policy"])
    parser.add_argument("--load", type=int, nargs="+", default=[0, 2],
                        help="busy processes beside the benchmark, per load level")
    parser.add_argument("--ranks", type=int, default=1, help="gloo ranks (1 runs in-process)")
    args = parser.parse_args()
    cluster = ["cluster=inprocess"] if args.ranks == 1 else ["cluster=local", f"cluster.cpu_ranks={args.ranks}"]
    common = [*cluster, f"experiment.steps={args.steps}", "experiment.resume_step=6"]
    last = args.planted[-1]
    configs = {f"{mode}@{p:g}": [f"experiment.interleave={mode}", f"experiment.planted_tax={p}",
                                 f"experiment.block_steps={args.block}"]
               for mode in args.interleave for p in args.planted}
    configs[f"before@{last:g}"] = [f"experiment.planted_tax={last}", "experiment.interleave=pair",
                                   "experiment.block_steps=6", "experiment.manual_gc=false"]
    results: dict[tuple[int, str], list[dict]] = {(load, name): [] for load in args.load for name in configs}
    with tempfile.TemporaryDirectory(prefix="calibration-") as tmp:
        for repeat in range(args.repeats):
            for load in args.load:
                with Load(load):
                    for name, overrides in configs.items():
                        folder = f"{name.replace('@', '_')}_load{load}_{repeat}"
                        results[load, name].append(experiment(Path(tmp), folder, [*common, *overrides]))
                        shutil.rmtree(Path(tmp) / folder, ignore_errors=True)
            print(f"repeat {repeat + 1}/{args.repeats} done", file=sys.stderr, flush=True)

    print(f"{args.repeats} repeats, {args.steps} steps per run, {args.ranks} rank(s), A/A calibration pair")
    print(f"{'load':>4} {'config':<12} {'planted':>8} {'median est':>11} {'bias':>8} {'coverage':>9} "
          f"{'median +/-':>11} {'HL coverage':>12} {'delivered':>10}")
    half_widths = {}
    for (load, name), summaries in results.items():
        planted = float(name.split("@")[1])
        taxes = [s["tax"]["tax"] for s in summaries]
        held = [s["tax"]["low"] <= planted <= s["tax"]["high"] for s in summaries]
        held_hl = [s["tax"]["hl_low"] <= planted <= s["tax"]["hl_high"] for s in summaries]
        half_widths[load, name] = statistics.median(s["tax"]["half_width"] for s in summaries)
        median = statistics.median(taxes)
        print(f"{load:>4} {name:<12} {planted * 100:>7.2f}% {median * 100:>+10.2f}% {(median - planted) * 100:>+7.2f}p "
              f"{sum(held) / len(held) * 100:>8.0f}% {half_widths[load, name] * 100:>10.2f}% "
              f"{sum(held_hl) / len(held_hl) * 100:>11.0f}% "
              f"{statistics.median(s['delivered'] for s in summaries) * 100:>9.2f}%")
    if "all" in args.interleave:
        for load in args.load:
            ratio = half_widths[load, f"before@{last:g}"] / half_widths[load, f"all@{last:g}"]
            print(f"load {load}: half-width before (the *-0 pair timed, 6-step blocks) / now (every run timed, "
                  f"{args.block}-step blocks), same steps per run: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
