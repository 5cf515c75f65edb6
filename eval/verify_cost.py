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

from selfspec.dtypes import DTYPE_CHOICES, dtype_name
from selfspec.engine import sync_device
from selfspec.errors import SelfspecError
from selfspec.memory import model_dtype
from selfspec.target_pass import BACKENDS, make_target_pass
from selfspec.tree import chain
from selfspec.zoo import load_model


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


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="zoo name, folder or hub id")
    p.add_argument("--context", type=int, default=300, help="tokens already in the cache")
    p.add_argument("--k", default="1,2,4,8,16", help="new tokens per forward, comma-separated")
    p.add_argument("--reps", type=int, default=7, help="timed rounds (median reported)")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES)
    p.add_argument("--target-pass", default="eager", choices=BACKENDS, help="how the target runs (selfspec/target_pass.py)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = p.parse_args(argv)
    try:
        ks = parse_ks(args.k)
        if args.context < 1 or args.reps < 1:
            raise SelfspecError(f"--context and --reps must be >= 1, got {args.context} and {args.reps}")
        if args.threads:
            torch.set_num_threads(args.threads)
        model, _ = load_model(args.model, dtype=args.dtype, device=args.device)
    except SelfspecError as exc:
        print(f"verify_cost: error: {exc}", file=sys.stderr)
        return 2
    medians, first = measure(model, args.context, ks, args.reps, args.target_pass)
    print(f"{args.model}, {dtype_name(model_dtype(model))}, {args.target_pass} pass, {args.device}, cache "
          f"{args.context} tokens, {torch.get_num_threads()} threads, median of {args.reps}")
    print(table(medians))
    print("first pass per k (ms; includes compiling on the compiled pass): "
          + ", ".join(f"{k}: {ms:.0f}" for k, ms in first.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
