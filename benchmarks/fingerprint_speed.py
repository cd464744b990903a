"""Fingerprint speed against the physical limit: a sum() over the same bytes.

Each round times every arm once, in a seeded random order, over the same tensor; the script prints each arm's
median time and its median ratio to the same round's sum(). Arms: torch's sum() and hash_tensor(), the digest with
each kernel available here ("c" and "torch" on the host, "triton" and "torch" on CUDA), and optionally the digest of
another git revision (`--against REV`, e.g. the commit before a change).

    python benchmarks/fingerprint_speed.py --mib 64 --threads 1 2 --rounds 9
    python benchmarks/fingerprint_speed.py --against HEAD~1
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

from taxbench import fingerprint

REPO = Path(__file__).resolve().parents[1]


def module_at(revision: str) -> ModuleType:
    """taxbench/fingerprint.py as it was at `revision`, imported under another name."""
    source = subprocess.run(["git", "show", f"{revision}:taxbench/fingerprint.py"], cwd=REPO, check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "fingerprint_then.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("fingerprint_then", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def arms(tensor: torch.Tensor, against: ModuleType | None, revision: str) -> dict[str, Callable[[], object]]:
    device = tensor.device
    out: dict[str, Callable[[], object]] = {"sum()": tensor.sum}
    if hasattr(torch, "hash_tensor"):
        out["hash_tensor()"] = lambda: torch.hash_tensor(tensor)
    kernels = ["c", "torch"] if device.type == "cpu" else (["triton"] if fingerprint.triton else []) + ["torch"]
    for kernel in kernels:
        if device.type == "cpu" and kernel == "c" and fingerprint.c_kernel() is None:
            continue
        out[f"digest[{kernel}]"] = lambda kernel=kernel: fingerprint.tensor_digest(tensor, kernel=kernel)
    if against is not None:
        out[f"digest@{revision}"] = lambda: against.tensor_digest(tensor)
    return out


def measure(tensor: torch.Tensor, rounds: int, seed: int, against: ModuleType | None, revision: str) -> None:
    sync = torch.cuda.synchronize if tensor.device.type == "cuda" else (lambda: None)
    timed = arms(tensor, against, revision)
    for run in timed.values():  # warm up: builds and caches kernels
        run()
    sync()
    times: dict[str, list[float]] = {name: [] for name in timed}
    rng = random.Random(seed)
    order = list(timed)
    for _ in range(rounds):
        rng.shuffle(order)
        for name in order:
            start = time.perf_counter()
            timed[name]()
            sync()
            times[name].append(time.perf_counter() - start)
    ratios = {name: statistics.median(t / s for t, s in zip(times[name], times["sum()"], strict=True))
              for name in timed}
    print(f"{'arm':<24} {'median ms':>10} {'GB/s':>7} {'x sum() (median of rounds)':>28}")
    for name in timed:
        median = statistics.median(times[name])
        print(f"{name:<24} {median * 1e3:>10.2f} {tensor.nbytes / median / 1e9:>7.2f} {ratios[name]:>27.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=64, help="tensor size in MiB (fp32)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, torch.get_num_threads()])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--against", metavar="REV", help="also time the digest of this git revision")
    args = parser.parse_args()

    against = module_at(args.against) if args.against else None
    tensor = torch.randn(args.mib << 18, generator=torch.Generator().manual_seed(args.seed)).to(args.device)
    for threads in dict.fromkeys(args.threads):
        torch.set_num_threads(threads)
        print(f"\n{args.mib} MiB fp32 on {args.device}, torch threads {threads}, {args.rounds} rounds")
        measure(tensor, args.rounds, args.seed, against, args.against or "")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
