"""What verifying k tokens in one target pass costs on this machine: the curve that bounds a draft's size.

    python -m selfspec_eval.verify_cost --model smollm2-135m-instruct --context 300 --k 1,2,4,8,16
    python -m selfspec_eval.verify_cost --model qwen2.5-coder-1.5b-instruct --target-pass static,compiled

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
from selfspec.target import make_target_pass
from selfspec.tree import chain


def pass_ms(target, cache, context: int, k: int, vocab: int) -> float:
    """Milliseconds of one pass over a k-token chain appended at ``context`` (rolled back afterwards)."""
    ids = torch.randint(0, vocab, (k,)).tolist()
    sync_device(target.device)
    start = time.perf_counter()
    target.verify(cache, chain(ids[0], ids[1:]), context)
    sync_device(target.device)
    elapsed = time.perf_counter() - start
    target.keep(cache, context, [])
    return elapsed * 1e3


def measure(model, context: int, ks: list[int], reps: int, backend: str = "eager") -> tuple[dict, dict]:
    """Median ms per k over ``reps`` rounds, each round timing every k once, after a first round that
    warms kernels and builds compiled graphs; also returns that first round's ms per k (compile time)."""
    medians, first = measure_backends(model, context, ks, reps, [backend])
    return medians[backend], first[backend]


def measure_backends(model, context: int, ks: list[int], reps: int, backends: list[str]) -> tuple[dict, dict]:
    """:func:`measure` for several backends at once, interleaved (every round times each k on each backend in
    turn, so they share the machine's noise); the passes share the model's (packed) weights. Per backend:
    median ms per k, and the first round's ms per k."""
    vocab = model.get_input_embeddings().weight.shape[0]
    prompt = torch.randint(0, vocab, (context,))
    targets = {b: make_target_pass(model, b) for b in backends}
    caches = {b: t.new_cache(context + max(ks)) for b, t in targets.items()}
    for b, t in targets.items():
        t.prefill(caches[b], prompt)
    times = {b: {k: [] for k in ks} for b in backends}
    first: dict[str, dict[int, float]] = {b: {} for b in backends}
    for rep in range(reps + 1):
        for k in ks:
            for b, t in targets.items():
                ms = pass_ms(t, caches[b], context, k, vocab)
                if rep:
                    times[b][k].append(ms)
                else:
                    first[b][k] = ms
    return {b: {k: sorted(v)[len(v) // 2] for k, v in per.items()} for b, per in times.items()}, first


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
    """Load the target, time every k on each pass, print the tables."""
    ks = parse_ks(args.k)
    backends = args.target_pass.split(",")
    model, _ = load_target(args)
    medians, first = measure_backends(model, args.context, ks, args.reps, backends)
    for b in backends:
        print(f"{args.model}, {dtype_name(model_dtype(model))}, {b} pass, {args.device}, cache "
              f"{args.context} tokens, {torch.get_num_threads()} threads, median of {args.reps}")
        print(table(medians[b]))
        print("first pass per k (ms; includes compiling on the compiled pass): "
              + ", ".join(f"{k}: {ms:.0f}" for k, ms in first[b].items()))
    if len(backends) > 1:
        base = backends[0]
        print(f"interleaved, ms relative to {base}: " + "; ".join(
            f"{b} " + ", ".join(f"k={k} {medians[b][k] / medians[base][k]:.2f}" for k in ks) for b in backends[1:]))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m selfspec_eval.verify_cost``: the shared model options, the cache length, the ks."""
    p = OneLineParser(prog="verify_cost", description=__doc__.split("\n")[0])
    add_model_options(p, several_passes=True)
    p.set_defaults(target_pass="eager")
    p.add_argument("--context", type=positive_int, default=300, help="tokens already in the cache")
    p.add_argument("--k", default="1,2,4,8,16", help="new tokens per forward, comma-separated")
    p.add_argument("--reps", type=positive_int, default=7, help="timed rounds (median reported)")
    return run_command("verify_cost", run, p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
