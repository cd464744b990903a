"""Checkpoints: what a run's checkpoint holds (DCP state) and which checkpoints of an experiment are complete."""
