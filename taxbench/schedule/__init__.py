"""The experiment schedule every rank runs: interleaved timed rounds, gate runs, and when the rounds stop."""
