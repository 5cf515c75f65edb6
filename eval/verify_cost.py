"""What verifying k tokens in one target pass costs on this machine: the curve that bounds a draft's size.

    python -m selfspec_eval.verify_cost --model smollm2-135m-instruct --context 300 --k 1,2,4,8,16

A forward of k new tokens over a ``--context``-token KV cache, timed for every k in turn within
each repetition (so the ks share the machine's noise), the cache cropped back after each. Prints
the median milliseconds and the ratio to k = 1: speculation pays only when τ exceeds that ratio
plus the drafting time. The adaptive controller (``selfspec/adaptive.py``) learns the same slope
online; this measures it up front, e.g. to choose ``--max-nodes`` for a machine.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import torch

from selfspec.dtypes import dtype_name
from selfspec.engine import sync_device
from selfspec.errors import SelfspecError
from selfspec.memory import model_dtype
from selfspec.options import OneLineParser, add_model_options, load_target, positive_int, run_command
from selfspec.target_pass import make_target_pass
from selfspec.tree import chain


def pass_ms(target, cache, context: int, k: int, vocab: int) -> float:
    """Milliseconds of one pass over a k-token chain appended at ``context`` (rolled back afterwards)."""
    ids = torch.randint(0, vocab, (k,)).tolist()
    sync_device(target.device)
    start = time.perf_counter()
    target.verify(cache, chain(ids[0], ids[1:]), context, False)
    sync_device(target.device)
    elapsed = time.perf_counter() - start
    target.keep(cache, context, [])
    return elapsed * 1e3


def measure(model, context: int, ks: list[int], reps: int, backend: str = "eager") -> tuple[dict, dict]:
    """Median ms per k over ``reps`` rounds, each round timing every k once, after a first round that
    warms kernels and builds compiled graphs; also returns that first round's ms per k (compile time)."""
    vocab = model.get_input_embeddings().weight.shape[0]
    target = make_target_pass(model, backend)
    cache = target.new_cache(context + max(ks))
    target.prefill(cache, torch.randint(0, vocab, (context,)), False)
    times: dict[int, list[float]] = {k: [] for k in ks}
    first: dict[int, float] = {}
    for rep in range(reps + 1):
        for k in ks:
            ms = pass_ms(target, cache, context, k, vocab)
            if rep:
                times[k].append(ms)
            else:
                first[k] = ms
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}, first


def table(medians: dict[int, float]) -> str:
    """Markdown: k, median ms, ratio to the smallest k."""
    first = min(medians)
    lines = [f"| k | ms | x k={first} |", "|---|---|---|"]
    base = medians[first]
    lines += [f"| {k} | {ms:.1f} | {ms / base:.2f} |" for k, ms in medians.items()]
    return "\n".join(lines)


def parse_ks(text: str) -> list[int]:
    """``"1,2,4"`` -> [1, 2, 4]; positive integers only."""
    try:
        ks = [int(k) for k in text.split(",")]
    except ValueError:
        ks = []
    if not ks or min(ks) < 1:
        raise SelfspecError(f"--k takes positive integers separated by commas, got '{text}'")
    return ks


def run(args: argparse.Namespace) -> int:
    """Load the target, time every k, print the table."""
    ks = parse_ks(args.k)
    model, _ = load_target(args)
    medians, first = measure(model, args.context, ks, args.reps, args.target_pass)
    print(f"{args.model}, {dtype_name(model_dtype(model))}, {args.target_pass} pass, {args.device}, cache "
          f"{args.context} tokens, {torch.get_num_threads()} threads, median of {args.reps}")
    print(table(medians))
    print("first pass per k (ms; includes compiling on the compiled pass): "
          + ", ".join(f"{k}: {ms:.0f}" for k, ms in first.items()))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m selfspec_eval.verify_cost``: the shared model options, the cache length, the ks."""
    p = OneLineParser(prog="verify_cost", description=__doc__.split("\n")[0])
    add_model_options(p)
    p.set_defaults(target_pass="eager")
    p.add_argument("--context", type=positive_int, default=300, help="tokens already in the cache")
    p.add_argument("--k", default="1,2,4,8,16", help="new tokens per forward, comma-separated")
    p.add_argument("--reps", type=positive_int, default=7, help="timed rounds (median reported)")
    return run_command("verify_cost", run, p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
