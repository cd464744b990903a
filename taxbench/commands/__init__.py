"""Subcommands that work on finished experiments and may start ranks again (diff, localize)."""
