"""The ``selfspec`` command: models, generate, demo, info, bench, serve, export.

Every user mistake ends as one line ``selfspec <command>: error: ...`` and exit status 2, never a
stack trace: a bad value while the line is parsed (before any model loads), a SelfspecError after.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from selfspec.options import OneLineParser, run_command
from selfspec_eval import bench

from . import demo, export, generate, info, models, serve

# A subcommand is a module with HELP (one line), add_arguments(parser) and run(args) -> exit status;
# its docstring is its --help description. Adding one is such a module plus an entry here.
COMMANDS = {"models": models, "generate": generate, "demo": demo, "info": info, "bench": bench, "serve": serve,
            "export": export}


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``selfspec`` command."""
    parser = OneLineParser(prog="selfspec", description="Self-speculative decoding for Hugging Face LMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module in COMMANDS.items():
        module.add_arguments(sub.add_parser(name, help=module.HELP, description=module.__doc__,
                                            formatter_class=argparse.RawDescriptionHelpFormatter))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``selfspec`` console script."""
    args = build_parser().parse_args(argv)
    return run_command(f"selfspec {args.command}", COMMANDS[args.command].run, args)
