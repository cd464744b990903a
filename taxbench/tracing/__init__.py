"""The tracing ladder: localize where two runs diverge, from step metrics down to the responsible op.

capture (scoped rung 1-3 capture), trace_io (per-rank JSONL), diff (alignment and the origin rules),
localize (replay the first diverging step with deeper rungs), faults (injected divergence for self-tests).
"""
