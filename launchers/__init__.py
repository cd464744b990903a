"""How ranks get started: in-process (debug), local multi-process, and submitit on Slurm."""
