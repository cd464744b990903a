"""The GPU check's table (scripts/gpu_check.sh runs it after every step, so that a cut run leaves a usable one):
`OUT/gpu_table.md`, the device and, per step, its exit code, seconds against its limit, and where the step ran an
experiment, its tax, interval and gate verdicts (from `OUT/runs/<step>/summary.json`).

    python scripts/gpu_table.py OUT

Reads `OUT/device.txt` (written before the first step) and `OUT/steps.txt` (one line per finished step,
`<name> rc=<code> <seconds>s limit=<limit>s`, or `skip <name>: <why>`). Plain JSON and text: no torch, no taxbench.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from pathlib import Path

STEP = re.compile(r"^(?P<name>\S+)\s+rc=(?P<rc>\d+)\s+(?P<seconds>\d+)s(?:\s+limit=(?P<limit>\d+)s)?")
SKIP = re.compile(r"^skip (?P<name>\S+): (?P<why>.*)$")


def _figure(summary: dict) -> tuple[str, str, str]:
    """(tax +/- half-width, the gates, the outcome) of one experiment's summary."""
    tax = summary.get("tax") or {}
    value, half = tax.get("tax"), tax.get("half_width")
    if isinstance(value, float) and math.isfinite(value):
        shown = f"{value * 100:+.1f}%" + (f" +/-{half * 100:.1f}%" if isinstance(half, float) else "")
        medians = (tax.get("baseline_median_s"), tax.get("deterministic_median_s"))
        if all(isinstance(m, float) and math.isfinite(m) for m in medians):
            shown += f" ({medians[0] * 1e3:.1f} vs {medians[1] * 1e3:.1f} ms)"
    else:
        shown = "n/a"
    gates = ", ".join(f"{v.get('gate')} {v.get('outcome')}" for v in summary.get("verdicts", []))
    return shown, gates or "-", str(summary.get("outcome", "-"))


def rows(out: Path) -> list[list[str]]:
    steps = out / "steps.txt"
    lines = steps.read_text().splitlines() if steps.is_file() else []
    table = []
    for line in lines:
        if (skipped := SKIP.match(line)) is not None:
            table.append([skipped["name"], "skipped", "-", "-", "-", skipped["why"]])
            continue
        if (done := STEP.match(line)) is None:
            continue
        name, rc = done["name"], int(done["rc"])
        seconds = f"{done['seconds']} / {done['limit']}" if done["limit"] else done["seconds"]
        status = "ok" if rc == 0 else "TIMED OUT" if rc in (124, 137) else f"rc={rc}"
        summary_path = out / "runs" / name / "summary.json"
        try:
            tax, gates, outcome = _figure(json.loads(summary_path.read_text()))
        except (OSError, ValueError, AttributeError):
            tax, gates, outcome = "-", "-", f"see {name}.log"
        table.append([name, status, seconds, tax, gates, outcome])
    return table


def render(out: Path) -> str:
    device = out / "device.txt"
    lines = ["# scripts/gpu_check.sh", "",
             f"Device: {device.read_text().strip() if device.is_file() else 'unknown (device.txt missing)'}", "",
             "| step | status | seconds / limit | tax (baseline vs deterministic median step) | gates | outcome |",
             "|---|---|---|---|---|---|"]
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in rows(out)]
    return "\n".join(lines) + "\n"


def main(out: Path) -> int:
    target = out / "gpu_table.md"
    partial = target.with_suffix(".md.part")
    partial.write_text(render(out))
    os.replace(partial, target)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python scripts/gpu_table.py OUT")
    sys.exit(main(Path(sys.argv[1])))
