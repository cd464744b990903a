"""Statistics of step times: warmup detection and the determinism-tax estimator, shared by the schedule and analysis."""
