"""The subcommands, one module each, run by taxbench.cli's dispatch table through their `main(argv) -> int`, and
what they share: one-line input errors (input_errors), Hydra overrides (overrides, hydra_job), starting ranks
(launch) and the parser of a subcommand's --help (help_format). Where a subcommand's work imports torch, its command
line is a module of its own (scan_cli, verify_cli, localize_cli) beside that work (scan, verify, localize)."""
