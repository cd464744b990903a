"""One training run on one rank: the trainer (the step loop), step execution, data, planted tax, op profiles, FLOPs."""
