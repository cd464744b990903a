"""The step record's field names: one JSON object per step and rank in steps.rank<R>.jsonl (taxbench.rundir.records
writes the lines, taxbench.rundir.step_stream gives the fields their column types, taxbench.rundir.read loads them
into frames whose columns are these names).

Writers (the trainer's recorder, the probe of `taxbench run`) and readers (analysis, the stopping rule, the
statistics) name a field through these constants, never by a string of their own, so a field is renamed or retyped
in one place. Records are versioned as a whole by records.SCHEMA_VERSION.
"""

from __future__ import annotations

from taxbench.rundir.records import METRICS

SCHEMA_VERSION_FIELD = "schema_version"
# Identity: which run and rank the record is of, and its step.
ARM = "arm"
REPLICA = "replica"
RANK = "rank"
STEP = "step"
BLOCK = "block"  # the interleaved round's block the step ran in
# Timing: the analysed step time (CUDA events on GPU, perf_counter on CPU), the wall-clock window cross-check, the
# events' own time, the fingerprints' cost outside the timed step, a planted tax's share, the data loading.
TIME_S = "time_s"
WINDOW_S = "window_s"
DEVICE_S = "device_s"
FINGERPRINT_S = "fingerprint_s"
PLANTED_S = "planted_s"
DATA_S = "data_s"
TOKENS = "tokens"
MEM_PEAK_BYTES = "mem_peak_bytes"
MEM_RESERVED_BYTES = "mem_reserved_bytes"
# Values and their fingerprints (METRICS: the bitwise fingerprints, in the order a step produces them).
LOSS = "loss"
GRAD_NORM = "grad_norm"
LOSS_BITS, GRADS, GRAD_NORM_BITS, PARAMS, OPTIM = METRICS
# Written by some writers only: a pipeline rank's stages, a shared model's own step (interleave=policy), the probe's
# flags as applied, its optimizer step count and folded calls.
STAGES = "stages"
TRAJECTORY_STEP = "trajectory_step"
FLAGS = "flags"
OPTIMIZER_STEP = "optimizer_step"
CALLS = "calls"
# A step whose optimizer update the stack skipped (a loss scaler's overflow), as `taxbench run`'s probe records it:
# true or false. Optional: a record without it (the trainer's, an older probe's) is a step that was taken, so the
# schema version stays. The gates compare it beside the fingerprints (analysis.verdicts).
SKIPPED = "skipped"
