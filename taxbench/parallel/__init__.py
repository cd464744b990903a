"""How a model is laid over ranks: process groups, mesh layout and wrapping, pipeline split, recompute, the plan."""
