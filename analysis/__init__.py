"""Analysis of run directories: step records (pandas), warmup, tax statistics, verdicts and summaries."""
