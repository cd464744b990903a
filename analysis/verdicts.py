"""Bitwise gates: compare two runs' fingerprint streams and name the first mismatch.

A gate has three outcomes. "identical" needs positive evidence: both runs complete (see
taxbench.rundir.read.check_run) and every record equal. "differs" needs a record both runs hold, once each,
with a different fingerprint. Anything else, a gate over runs with missing, duplicated or stray records where what
they share agrees, is "incomplete": never identical.

Where the records say whether the stack skipped a step (`skipped`, taxbench run's probe), that is compared too, in
the order it is decided (after the gradients, before the parameters): both runs skipping the same step agree there,
and one skipping a step the other took differs. A record without it is a step that was taken.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import numpy as np
import pandas as pd

from taxbench.rundir.hex_columns import alike, hex_text, unpacked
from taxbench.rundir.records import METRICS
from taxbench.rundir.step_record import RANK, SKIPPED, STEP


@dataclass(frozen=True)
class Mismatch:
    step: int
    rank: int
    metric: str  # one of METRICS, SKIPPED, or "missing_record" when one run has a step the other lacks
    expected: str | None
    actual: str | None


@dataclass(frozen=True)
class Verdict:
    gate: str
    reference: str
    candidate: str
    agree: bool
    compared_steps: int
    first_mismatch: Mismatch | None
    from_step: int = 0
    problems: tuple[str, ...] = ()  # why either run is incomplete (see records.check_run); agree is then False

    @property
    def outcome(self) -> str:
        if self.agree:
            return IDENTICAL
        return DIFFERS if self.first_mismatch is not None else INCOMPLETE

    def to_dict(self) -> dict:
        return asdict(self) | {"outcome": self.outcome, "problems": list(self.problems)}


IDENTICAL, DIFFERS, INCOMPLETE = "identical", "differs", "incomplete"


def compare_runs(
    gate: str, reference_name: str, reference: pd.DataFrame, candidate_name: str, candidate: pd.DataFrame,
    from_step: int = 0, problems: tuple[str, ...] = (), through: int | None = None,
) -> Verdict:
    """Bitwise agreement on every step > from_step (and <= `through`, the last step both runs take: None, every
    step); the first mismatch by (step, rank, metric order).

    Both frames are sorted alike (analysis.records.load_run: by rank, then step). With `problems` (either run
    is incomplete) the gate cannot agree: only records both runs hold exactly once are compared, and a fingerprint
    that differs there is still a real mismatch; otherwise the outcome is "incomplete".
    """
    metrics = _compared(reference, candidate)
    if SKIPPED in metrics:
        reference, candidate = (_with_skipped(frame) for frame in (reference, candidate))
    columns = [STEP, RANK, *metrics]
    ref, cand = _comparable(_after(reference, from_step, columns, through), _after(candidate, from_step, columns,
                                                                                   through))
    if problems:
        return _compare_shared(gate, reference_name, ref, candidate_name, cand, from_step, problems, metrics)
    if _same_keys(ref, cand):
        return _compare_aligned(gate, reference_name, ref, candidate_name, cand, from_step, metrics)
    # As text: an outer merge turns a packed column with a missing row into floats, which lose a digest's low bits.
    ref, cand = (frame.assign(**{m: unpacked(frame[m]) for m in METRICS}) for frame in (ref, cand))
    merged = ref.merge(cand, on=[STEP, RANK], how="outer", suffixes=("_ref", "_cand"), indicator=True)
    merged = merged.sort_values([STEP, RANK], kind="stable")
    candidates: list[Mismatch] = []
    missing = merged[merged["_merge"] != "both"]
    if not missing.empty:
        row = missing.iloc[0]
        present = "reference" if row["_merge"] == "left_only" else "candidate"
        candidates.append(Mismatch(int(row[STEP]), int(row[RANK]), "missing_record",
                                   "present" if present == "reference" else None,
                                   "present" if present == "candidate" else None))
    both = merged[merged["_merge"] == "both"]
    differs = pd.DataFrame({m: both[f"{m}_ref"] != both[f"{m}_cand"] for m in metrics})
    bad_rows = differs.any(axis=1)
    if bad_rows.any():
        index = bad_rows[bad_rows].index[0]
        row = both.loc[index]
        metric = next(m for m in metrics if differs.loc[index, m])
        candidates.append(Mismatch(int(row[STEP]), int(row[RANK]), metric,
                                   _text(metric, row[f"{metric}_ref"]), _text(metric, row[f"{metric}_cand"])))
    first = min(candidates, key=lambda m: (m.step, m.rank)) if candidates else None
    return Verdict(gate, reference_name, candidate_name, first is None, int(both[STEP].nunique()), first, from_step)


def _compared(reference: pd.DataFrame, candidate: pd.DataFrame) -> tuple[str, ...]:
    """The fields a gate compares, in the order a step produces them: SKIPPED too where either run records it."""
    if SKIPPED not in reference and SKIPPED not in candidate:
        return METRICS
    at = METRICS.index("params")
    return (*METRICS[:at], SKIPPED, *METRICS[at:])


def _with_skipped(frame: pd.DataFrame) -> pd.DataFrame:
    """SKIPPED as booleans, a record without it being a step that was taken."""
    skipped = frame[SKIPPED].fillna(False).astype(bool) if SKIPPED in frame else False
    return frame.assign(**{SKIPPED: skipped})


def _text(metric: str, value: object) -> str:
    if metric == SKIPPED:
        return "skipped" if value else "stepped"
    return str(value)


def _after(frame: pd.DataFrame, from_step: int, columns: list[str], through: int | None = None) -> pd.DataFrame:
    steps = frame[STEP].to_numpy()
    after = steps > from_step
    if through is not None:
        after &= steps <= through
    return frame[columns] if after.all() else frame.loc[after, columns]


def _comparable(ref: pd.DataFrame, cand: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The two runs' fingerprints in one representation (taxbench.rundir.hex_columns): packed alike, or as text."""
    mixed = [m for m in METRICS if not alike(ref[m], cand[m])]
    if not mixed:
        return ref, cand
    return ref.assign(**{m: unpacked(ref[m]) for m in mixed}), cand.assign(**{m: unpacked(cand[m]) for m in mixed})


def _same_keys(ref: pd.DataFrame, cand: pd.DataFrame) -> bool:
    return (
        len(ref) == len(cand)
        and bool((ref[STEP].to_numpy() == cand[STEP].to_numpy()).all())
        and bool((ref[RANK].to_numpy() == cand[RANK].to_numpy()).all())
    )


def _compare_aligned(
    gate: str, reference_name: str, ref: pd.DataFrame, candidate_name: str, cand: pd.DataFrame, from_step: int,
    metrics: tuple[str, ...] = METRICS,
) -> Verdict:
    """Fast path for the usual case (same steps and ranks in the same order): column-wise comparison, no merge."""
    if ref.empty:  # agreement needs evidence: nothing compared is no pass
        return Verdict(gate, reference_name, candidate_name, False, 0, None, from_step,
                       (f"{reference_name} and {candidate_name} hold no records to compare after step {from_step}",))
    # Comparing the columns' own arrays keeps arrow-backed strings in pyarrow (40x faster than object arrays).
    differs = np.column_stack([np.asarray(ref[m].array != cand[m].array, dtype=bool) for m in metrics])
    compared = int(ref[STEP].nunique())
    bad = np.flatnonzero(differs.any(axis=1))
    if bad.size == 0:
        return Verdict(gate, reference_name, candidate_name, True, compared, None, from_step)
    steps, ranks = ref[STEP].to_numpy()[bad], ref[RANK].to_numpy()[bad]
    row = int(bad[np.lexsort((ranks, steps))[0]])  # the first mismatch: the earliest step, then the lowest rank
    metric = metrics[int(np.argmax(differs[row]))]
    if metric == SKIPPED:
        expected, actual = _text(metric, ref[metric].iat[row]), _text(metric, cand[metric].iat[row])
    else:
        expected = hex_text(ref[metric].iat[row], ref[metric].dtype)
        actual = hex_text(cand[metric].iat[row], cand[metric].dtype)
    mismatch = Mismatch(int(ref[STEP].iat[row]), int(ref[RANK].iat[row]), metric, expected, actual)
    return Verdict(gate, reference_name, candidate_name, False, compared, mismatch, from_step)


def _compare_shared(
    gate: str, reference_name: str, ref: pd.DataFrame, candidate_name: str, cand: pd.DataFrame, from_step: int,
    problems: tuple[str, ...], metrics: tuple[str, ...] = METRICS,
) -> Verdict:
    """Incomplete runs: compare the (step, rank) records both hold exactly once; never agree."""
    keys = [STEP, RANK]
    # a record without step, rank or fingerprints, or held twice, is no evidence either way
    ref = ref.dropna(subset=[*keys, *metrics]).drop_duplicates(keys, keep=False)
    cand = cand.dropna(subset=[*keys, *metrics]).drop_duplicates(keys, keep=False)
    shared = ref.merge(cand[keys], on=keys).sort_values(keys, kind="stable")
    ref = shared.reset_index(drop=True)
    cand = cand.merge(shared[keys], on=keys).sort_values(keys, kind="stable").reset_index(drop=True)
    verdict = _compare_aligned(gate, reference_name, ref, candidate_name, cand, from_step, metrics)
    return replace(verdict, agree=False, problems=problems)
