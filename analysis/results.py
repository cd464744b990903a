"""Writing analysis results (summary.json, sweep.csv, layouts.json, report/): whole files, and only where allowed.

One home for the write that every analysis and every report uses, so that none of them imports another just to write
a file: a result is written whole (a .tmp renamed into place), never in a folder a live launch holds
(taxbench.rundir.write_scope), and a failure is one line naming the path.
"""

from __future__ import annotations

import math

from taxbench.rundir.write_scope import may_write_result, write_result  # noqa: F401 (the results' writer lives there)


def finite_or_none(value: float) -> float | None:
    """A number for JSON: NaN and infinities as None (null), which JSON has no literal for."""
    return value if math.isfinite(value) else None

