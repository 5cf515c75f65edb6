"""What a suffix draft costs: one proposal against an index of many earlier answers, timed.

    python -m selfspec_eval.suffix_cost --model smollm2-135m-instruct --answers 10000 --tokens 200

Fills a ``SuffixIndex`` with ``--answers`` ShareGPT assistant replies (train split, cut to ``--tokens`` tokens, in
order), then times ``SuffixDrafter.propose`` on ``--contexts`` contexts from held-out replies (their first 32-256
tokens: each proposal matches against the whole index and the context itself), one thread. Prints the index's size,
how long filling it took, and the median and 99th percentile of a proposal in ms, beside the share of proposals
that found an earlier match.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Sequence

import torch

from selfspec.data import load_chat_dataset
from selfspec.drafters.base import DraftContext, DraftRequest
from selfspec.drafters.suffix import SuffixDrafter, SuffixIndex
from selfspec.options import OneLineParser, positive_int, run_command
from selfspec.sampling import SamplingConfig
from selfspec.zoo import load_tokenizer


def replies(source: str, split: str, n: int, tokenizer, tokens: int) -> list[list[int]]:
    """The first assistant reply of up to ``n`` conversations, as at most ``tokens`` token ids each."""
    out = []
    for ex in load_chat_dataset(source, split=split, limit=n):
        answer = next((m["content"] for m in ex["messages"] if m["role"] == "assistant"), "")
        ids = tokenizer.encode(answer, add_special_tokens=False)[:tokens]
        if len(ids) > 8:
            out.append(ids)
    return out


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    tok = load_tokenizer(args.model)
    answers = replies("sharegpt", "train", args.answers, tok, args.tokens)
    held = replies("sharegpt", "heldout", args.contexts, tok, 256)
    index = SuffixIndex(int(args.max_mib * 2**20))
    start = time.perf_counter()
    for ids in answers:
        index.add(ids)
    fill_s = time.perf_counter() - start
    drafter = SuffixDrafter(index)
    rng = random.Random(0)
    req = DraftRequest(args.depth, args.nodes, SamplingConfig())
    times, hits = [], index.hits
    for ids in held:
        cut = rng.randrange(min(32, len(ids) - 1), len(ids))
        ctx = DraftContext(torch.tensor(ids[:cut]), cut - 1)
        t0 = time.perf_counter()
        drafter.propose(None, ctx, req)
        times.append(time.perf_counter() - t0)
    times.sort()
    print(f"{len(answers):,} answers indexed ({index.tokens:,} tokens, {index.nbytes / 2**20:.1f} MiB by its "
          f"accounting, {len(index.seqs):,} kept) in {fill_s:.1f} s; {len(times)} proposals (depth {args.depth}, "
          f"{args.nodes} nodes): median {1000 * statistics.median(times):.3f} ms, p99 "
          f"{1000 * times[int(0.99 * (len(times) - 1))]:.3f} ms; {index.hits - hits} found an earlier match")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m selfspec_eval.suffix_cost``."""
    p = OneLineParser(prog="suffix_cost", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="whose tokenizer")
    p.add_argument("--answers", type=positive_int, default=10_000)
    p.add_argument("--tokens", type=positive_int, default=200, help="tokens per answer at most")
    p.add_argument("--contexts", type=positive_int, default=200, help="proposals timed")
    p.add_argument("--depth", type=positive_int, default=8)
    p.add_argument("--nodes", type=positive_int, default=16)
    p.add_argument("--max-mib", type=float, default=256.0, help="the index's bound")
    return run_command("suffix_cost", run, p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
