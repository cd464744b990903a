"""`taxbench build-shards TEXT OUT_DIR`: tokenize a text file into the token shards that recipe.data reads."""

from __future__ import annotations

import argparse
from pathlib import Path

from taxbench import exit_codes
from taxbench.commands.help_format import subcommand_parser
from taxbench.commands.input_errors import one_line_input_errors
from taxbench.datasets.build import build_shards_command
from taxbench.datasets.shards import ShardError


def parser() -> argparse.ArgumentParser:
    parser = subcommand_parser(
        "build-shards",
        "Tokenize a text file (one token per byte) into a folder of token shards that recipe.data reads.",
        "exit codes: 0 written, 2 bad input")
    parser.add_argument("text_file", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--tokens-per-shard", type=int, default=1 << 24)
    parser.add_argument("--dtype", choices=["uint16", "uint32"], default="uint16")
    return parser


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    with one_line_input_errors(ShardError, FileNotFoundError):
        return build_shards_command(args.text_file, args.out_dir, args.tokens_per_shard, args.dtype)
    return exit_codes.CONFIG_ERROR
