"""What one batched head draft costs as the context grows: ``propose_chains`` alone, timed per step.

    python -m selfspec_eval.draft_steps --model smollm2-135m-instruct \
        --heads checkpoints/smollm2-135m-instruct-eagle --rows 8 --contexts 256,1024,2048 --dtype bfloat16

``--rows`` sequences with ``--contexts`` pairs already fed to the head; each step commits ``--commit`` new pairs per
sequence (the target's features stood in by random ones of the same shape: the cost does not depend on their
values) and drafts every sequence a chain of ``--depth`` tokens in one ``propose_chains`` call. Prints the median
ms of a step per context length: a step whose cost grows with the context is copying the head's cache.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

import torch

from selfspec.checkpoint import load_heads
from selfspec.drafters.base import DraftContext
from selfspec.options import OneLineParser, add_model_options, load_target, positive_int, run_command


def contexts(text: str) -> list[int]:
    return [int(n) for n in text.split(",")]


def step_ms(drafter, rows: int, length: int, args: argparse.Namespace, hidden: int) -> list[float]:
    """ms of each timed step for ``rows`` sequences that start with ``length`` pairs fed."""
    gen = torch.Generator().manual_seed(0)
    vocab = drafter.embed.weight.shape[0]
    tokens = [torch.randint(0, vocab, (length + 1,), generator=gen) for _ in range(rows)]
    states = []
    for seq in tokens:
        feats = torch.randn(length, hidden, generator=gen).to(drafter.dtype)
        states.append(drafter.start(DraftContext(seq, length, (feats,))))
    times = []
    for step in range(args.warmup + args.steps):
        ctxs = [DraftContext(seq, seq.numel() - 1, None) for seq in tokens]
        t0 = time.perf_counter()
        out = drafter.propose_chains(states, ctxs, [args.depth] * rows)
        if step >= args.warmup:
            times.append((time.perf_counter() - t0) * 1e3)
        trees = out[0] if isinstance(out, tuple) else out
        for i, tree in enumerate(trees):  # commit the first ``--commit`` drafted tokens (or any tokens)
            new = tree.tokens[1:1 + args.commit].tolist()
            new += torch.randint(0, vocab, (args.commit - len(new),), generator=gen).tolist()
            tokens[i] = torch.cat([tokens[i], torch.tensor(new)])
            feats = torch.randn(args.commit, hidden, generator=gen).to(drafter.dtype)
            states[i] = drafter.observe(states[i], DraftContext(tokens[i], tokens[i].numel() - 1, (feats,)))
    for state in states:
        getattr(drafter, "release", lambda s: None)(state)
    return times


def run(args: argparse.Namespace) -> int:
    """Load the target and heads, time the draft steps at each context length, print the table."""
    model, tok = load_target(args)
    drafter = load_heads(model, args.heads, tokenizer=tok)[1]
    if not getattr(drafter, "drafts_batches", False):
        print(f"{args.heads}: these heads do not draft batches (propose_chains)")
        return 2
    hidden = model.config.get_text_config().hidden_size * len(getattr(drafter, "state_layers", (-1,)))
    print(f"{args.model}, heads {args.heads}, {args.rows} rows, chains of {args.depth}, {args.commit} pairs committed "
          f"a step, {torch.get_num_threads()} threads, {drafter.dtype}")
    print("| context (pairs) | draft step ms (median) | min | max |\n|---|---|---|---|")
    for length in args.contexts:
        ms = step_ms(drafter, args.rows, length, args, hidden)
        print(f"| {length} | {statistics.median(ms):.2f} | {min(ms):.2f} | {max(ms):.2f} |", flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m selfspec_eval.draft_steps``: the model options, the heads, rows, context lengths."""
    p = OneLineParser(prog="draft_steps", description=__doc__.split("\n")[0])
    add_model_options(p)
    p.add_argument("--heads", required=True, help="an eagle or eagle3 heads folder")
    p.add_argument("--rows", type=positive_int, default=8, help="sequences drafted together")
    p.add_argument("--contexts", type=contexts, default=[256, 1024, 2048], help="pairs fed before timing, "
                   "comma-separated (default: 256,1024,2048)")
    p.add_argument("--depth", type=positive_int, default=3, help="chain length drafted each step")
    p.add_argument("--commit", type=positive_int, default=2, help="pairs committed per sequence between steps")
    p.add_argument("--steps", type=positive_int, default=20, help="steps timed per context length")
    p.add_argument("--warmup", type=positive_int, default=3, help="steps run first, not timed (the first feeds the "
                   "whole context)")
    return run_command("draft_steps", run, p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
