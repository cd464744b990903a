"""The zero-code probe of `taxbench run -- COMMAND`: loaded into every Python process of the user's command
(boot/sitecustomize.py), it applies the arm's policy and writes step records (runtime.py). Nothing else of taxbench
imports it: the launcher only puts its boot folder on the command's PYTHONPATH."""
