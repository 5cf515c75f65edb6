"""What one batched target pass costs by its shape: ``RowPass.verify_batch`` timed for (requests x nodes) shapes.

    python -m selfspec_eval.pass_shapes --model smollm2-135m-instruct --shapes 16x1,12x1,9x8,16x8,16x16,5x4

Prefills ``--rows`` requests of ~200-300 random tokens into one batch cache, then times a pass over the first
``requests`` of them, each verifying a chain of ``nodes`` nodes, for each shape (median of ``--repeats`` after two
warm-ups; the cache is not advanced, so every repeat is the same pass). Prints, per shape, the shape the exact pass
really ran (rows padded onto the self-tested row grid) and its ms: how padding and parts cost. ``--compare-loop``:
each repeat runs the pass through transformers' forward, then through the decoder loop (``selfspec/target/decoder.py``),
and both medians are printed (``transformers_ms``, ``ms``) with their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence

import torch

from selfspec.errors import SelfspecError
from selfspec.target import RowPass
from selfspec.options import (
    OneLineParser,
    add_model_options,
    load_target,
    positive_int,
    run_command,
)
from selfspec.tree import chain


def shapes(text: str) -> list[tuple[int, int]]:
    try:
        return [(int(a), int(b)) for a, b in (s.split("x") for s in text.split(","))]
    except ValueError:
        raise argparse.ArgumentTypeError(f"shapes are REQUESTSxNODES, comma-separated, got {text}") from None


def run(args: argparse.Namespace) -> int:
    model, _ = load_target(args)
    rows = max(r for r, _ in args.shapes)
    target = RowPass(model, rows, 1024, exact=args.exact)
    gen = torch.Generator().manual_seed(0)
    slots = []
    for i in range(rows):
        slot = target.new_cache(1024)
        target.prefill(slot, torch.randint(0, min(1000, model.config.vocab_size), (200 + 7 * i,), generator=gen))
        slots.append(slot)
    loop = target.target.loop
    if args.compare_loop and loop is None:
        raise SelfspecError("--compare-loop: this model's exact pass does not run through the decoder loop "
                            "(not exact, SELFSPEC_DECODER_LOOP=0, or layers of another form)")
    ways = (False, True) if args.compare_loop else (None,)  # through transformers' forward, then the loop
    out = {}
    for n, nodes in args.shapes:
        times = {way: [] for way in ways}
        for _ in range(args.repeats + 2):
            for way in ways:
                if way is not None:
                    loop.trusted = way
                items = [(slot, chain(5, [7] * (nodes - 1))) for slot in slots[:n]]
                start = time.perf_counter()
                target.verify_batch(items)
                times[way].append(time.perf_counter() - start)
        ms = {way: round(1000 * statistics.median(t[2:]), 2) for way, t in times.items()}
        out[f"{n}x{nodes}"] = {"ms": ms[ways[-1]], "ran": list(target.last_shape)}
        if args.compare_loop:
            out[f"{n}x{nodes}"].update(transformers_ms=ms[False], speedup=round(ms[False] / ms[True], 2))
    print(json.dumps(out))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m selfspec_eval.pass_shapes``."""
    p = OneLineParser(prog="pass_shapes", description=__doc__.split("\n")[0])
    add_model_options(p)
    p.add_argument("--shapes", type=shapes, default=shapes("16x1,12x1,9x8,16x8,16x16,5x4"))
    p.add_argument("--repeats", type=positive_int, default=5)
    p.add_argument("--compare-loop", action="store_true",
                   help="time each pass through transformers' forward and through the decoder loop, interleaved")
    return run_command("pass_shapes", run, p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
