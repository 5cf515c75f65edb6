"""selfspec info FOLDER: a heads checkpoint's parameters and bytes next to its base model (no weights loaded)."""

from __future__ import annotations

import argparse
import json

from selfspec.options import heads_folder

HELP = "parameters and bytes of a heads checkpoint vs its base model"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """A folder (checked as it is parsed) and ``--json``."""
    p.add_argument("folder", type=heads_folder)
    p.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    """Print ``heads_info`` as aligned rows or JSON."""
    from selfspec.checkpoint import heads_info

    info = heads_info(args.folder)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    for key, value in info.items():
        print(f"{key:>24}: {value}")
    return 0
