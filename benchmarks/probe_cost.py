"""What the probe of `taxbench run -- COMMAND` costs a training step: the step with the probe on over the step with
it off, measured side by side.

A user-style training script (an MLP whose step takes about --step-ms on this machine, AdamW) reports its own median
step time (perf_counter around each iteration, after a warmup); it runs A B A B: without the probe, then with it
(as in a baseline run: no flags changed, so that only the probe differs; hooks and a digest of gradients,
parameters and optimizer state every step), --repeats
times. Prints each pair's ratio and the median ratio. The target: at most 1.02 on a step of 50 ms or more.

    python benchmarks/probe_cost.py                      # 5 pairs, 80 steps per run
    python benchmarks/probe_cost.py --repeats 9 --steps 120 --width 2048
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import taxbench

SCRIPT = r'''
import statistics, sys, time
import torch
torch.manual_seed(0)
torch.set_num_threads(int(sys.argv[3]))
width, steps = int(sys.argv[1]), int(sys.argv[2])
model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)])
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
x = torch.randn(256, width)
times = []
for _ in range(steps):
    began = time.perf_counter()
    loss = model(x).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    times.append(time.perf_counter() - began)
print(statistics.median(times[steps // 4:]))
'''


def run(script: Path, args: argparse.Namespace, probe_dir: Path | None) -> float:
    env = {k: v for k, v in os.environ.items() if k not in ("TAXBENCH_PROBE", "PYTHONPATH")}
    if probe_dir is not None:
        for stale in probe_dir.glob("steps.rank*"):
            stale.unlink()
        settings = {"run_dir": str(probe_dir), "arm": "deterministic", "replica": "0", "block": 0, "policy": None,
                    "fingerprint_every": 1, "resume": False, "format": 1}
        (probe_dir / "probe.json").write_text(json.dumps(settings))
        env["TAXBENCH_PROBE"] = str(probe_dir / "probe.json")
        env["PYTHONPATH"] = str(Path(taxbench.__file__).parent / "probe" / "boot")
    out = subprocess.run([sys.executable, str(script), str(args.width), str(args.steps), str(args.threads)],
                         capture_output=True, text=True, env=env, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--width", type=int, default=1536, help="the MLP's width (sets the step time)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "train.py"
        script.write_text(SCRIPT)
        probe_dir = Path(folder) / "run"
        probe_dir.mkdir()
        ratios = []
        for repeat in range(args.repeats):
            off = run(script, args, None)
            on = run(script, args, probe_dir)
            ratios.append(on / off)
            print(f"pair {repeat + 1}: step {off * 1e3:.1f} ms without the probe, {on * 1e3:.1f} ms with it: "
                  f"{on / off:.3f}x", flush=True)
    print(f"probe cost: median {statistics.median(ratios):.3f}x the step without it "
          f"(pairs {min(ratios):.3f}-{max(ratios):.3f}, width {args.width}, {args.steps} steps)")


if __name__ == "__main__":
    main()
