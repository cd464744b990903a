"""How long does analysing a large sweep take? A synthetic sweep up to 1,000 ranks x 1,000 steps per run.

    python benchmarks/analysis_scale.py                       # points of 8, 64 and 1000 ranks, 1000 steps each
    python benchmarks/analysis_scale.py --world-sizes 64 --steps 200   # quick look

Prints, from one run: the time to analyse the whole sweep as the ranks leave it (JSONL streams and their columnar
mirrors, every mirror verified against its stream's bytes), and for the largest point's baseline run the loaders side
by side: the old per-line json.loads loader, pyarrow's JSON parse of every line (what a run without mirrors costs),
a first load that writes the missing mirrors, the load through each stream's mirror, and the load through the run
mirror (steps.arrow: every stream's rows in one file, left by the first analysis). Each point has five runs (the
experiment schedule), so the 1000-rank point alone holds 5 million step records. Last, it times
`python -m taxbench analyse <the largest point>` as a fresh process (imports included), with the mirrors present as a
finished launch leaves them: the ranks' own and, since a launch ends with its analysis (the sweep's analysis above
stands for it), each run's run mirror. It prints that process's CPU time and peak memory and, as the last line,
`cold analyse: <seconds> s`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

from taxbench.analysis.sweep import analyse_sweep
from taxbench.analysis.synthetic import SyntheticExperiment, write_experiment
from taxbench.design import REPEATABILITY
from taxbench.rundir.read import leave_mirrors, load_run
from taxbench.rundir.step_stream import run_mirror_file


def per_line_loader(run_dir: Path) -> pd.DataFrame:
    """The previous loader: json.loads per line, then DataFrame.from_records (the reference for the ratio)."""
    records = []
    for path in sorted(run_dir.glob("steps.rank*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                records.append(json.loads(line))
    return pd.DataFrame.from_records(records).sort_values(["step", "rank"], kind="stable").reset_index(drop=True)


def timed(label: str, fn):  # noqa: ANN001, ANN201
    start = time.perf_counter()
    result = fn()
    elapsed = time.perf_counter() - start
    print(f"{label:<70} {elapsed:8.2f} s", flush=True)
    return result, elapsed


# Started from a small process of its own: a child's peak memory (ru_maxrss) counts the memory of the process that
# forked it (Linux keeps the high-water mark across exec), and this benchmark holds gigabytes by then.
_MEASURE = """
import json, resource, subprocess, sys, time
began = time.perf_counter()
done = subprocess.run(sys.argv[2:], capture_output=True, text=True)
seconds = time.perf_counter() - began
child = resource.getrusage(resource.RUSAGE_CHILDREN)
json.dump({"seconds": seconds, "user": child.ru_utime, "system": child.ru_stime, "peak": child.ru_maxrss * 1024,
           "code": done.returncode, "stderr": done.stderr[-3000:]}, open(sys.argv[1], "w"))
"""


def cold_analyse(point: Path) -> tuple[float, dict]:
    """Wall seconds of `python -m taxbench analyse <point>` as a fresh process, and its CPU times and peak memory."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, "-c", _MEASURE, out.name, sys.executable, "-m", "taxbench", "analyse",
                        str(point)], check=True)
        child = json.loads(Path(out.name).read_text())
    if child["code"] not in (0, 3):
        raise SystemExit(f"taxbench analyse {point} exited {child['code']}:\n{child['stderr']}")
    return child["seconds"], child


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[8, 64, 1000])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--dir", type=Path, default=None, help="where to write the sweep (default: a temp folder)")
    parser.add_argument("--keep", action="store_true", help="keep the generated sweep")
    args = parser.parse_args()
    root = args.dir or Path(tempfile.mkdtemp(prefix="taxbench-scale-"))
    sweep = root / "sweep"
    try:
        def generate() -> None:
            for world in args.world_sizes:
                spec = SyntheticExperiment(ranks=world, steps=args.steps, block_steps=10, warmup_steps=20,
                                           resume_step=args.steps // 2, seed=world)
                write_experiment(sweep / f"ranks{world}", spec)

        records = 5 * args.steps * sum(args.world_sizes)
        timed(f"generate {len(args.world_sizes)} points, {records:,} records (setup)", generate)
        jsonl = sum(p.stat().st_size for p in sweep.rglob("*.jsonl"))
        mirrors = sum(p.stat().st_size for p in sweep.rglob("*.arrow"))
        print(f"  on disk: JSONL {jsonl / 2**30:.2f} GiB, mirrors {mirrors / 2**30:.2f} GiB")
        # as `taxbench analyse` does: the mirrors the ranks did not leave (the run mirrors) first, then the analysis
        result, sweep_s = timed("analyse the sweep (JSONL + mirrors as the ranks leave them)",
                                lambda: (leave_mirrors(sweep), analyse_sweep(sweep))[1])
        largest = sweep / f"ranks{max(args.world_sizes)}" / "baseline-0"
        print(f"one run ({largest.parent.name}/baseline-0, {args.steps * max(args.world_sizes):,} records):")
        _, old = timed("  old per-line json.loads loader", lambda: per_line_loader(largest))
        _, parsed = timed("  pyarrow JSON parse of every line (no mirrors)",
                          lambda: load_run(largest, use_mirrors=False))
        for mirror in largest.glob("*.arrow"):
            mirror.unlink()
        _, first = timed("  first load of a run without mirrors (parses, writes them)",
                         lambda: load_run(largest, leave_mirrors=True))
        run_mirror_file(largest).unlink()
        _, per_stream = timed("  load through each stream's mirror (verified, writes the run mirror)",
                              lambda: load_run(largest, leave_mirrors=True))
        _, mirrored = timed("  load through the run mirror (verified against every JSONL)", lambda: load_run(largest))
        print(f"  records/s, whole sweep: {records / sweep_s:,.0f}")
        print(f"  run mirror vs JSON parse: {parsed / mirrored:.1f}x; vs each stream's mirror: "
              f"{per_stream / mirrored:.1f}x; vs the per-line loader: {old / mirrored:.1f}x; "
              f"JSON parse vs per-line: {old / parsed:.1f}x; writing mirrors costs {first / parsed:.2f}x a parse")
        print(result.points[["world_size", "tax", "low", "high", REPEATABILITY.name]].to_string(index=False))
        point = sweep / f"ranks{max(args.world_sizes)}"
        cold, child = cold_analyse(point)
        print(f"cold analyse CPU: user {child['user']:.2f} s, system {child['system']:.2f} s")
        print(f"cold analyse peak memory: {child['peak'] / 2**30:.2f} GiB")
        print(f"cold analyse: {cold:.2f} s")
    finally:
        if not args.keep:
            shutil.rmtree(root if args.dir is None else sweep, ignore_errors=True)


if __name__ == "__main__":
    main()
