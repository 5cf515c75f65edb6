"""What the batch engine does alone, without a server: tokens/s and the draft size it chose at each step.

    python -m selfspec_eval.batch_steps --model smollm2-135m-instruct --rows 16 --dtype bfloat16
    python -m selfspec_eval.batch_steps --model smollm2-135m-instruct --rows 16 --dtype bfloat16 \
        --heads checkpoints/smollm2-135m-instruct-eagle

``--rows`` held-out prompts (chat and code, as ``serve_load`` sends them) join at once and decode to the end
(``BatchEngine.step`` in a loop, after ``calibrate()`` as ``selfspec serve`` does). Prints total tokens/s and how
many steps ran with how many requests and draft tokens: where serving under load falls short of the engine, the
gap is the server's; where the budget drafts at a load it should not, it shows here.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from collections.abc import Sequence

from selfspec.batching import BatchEngine
from selfspec.checkpoint import load_heads
from selfspec.options import OneLineParser, add_model_options, load_target, positive_int, run_command
from selfspec.request import DecodeConfig

from .prompts import load_bench_prompts


def run(args: argparse.Namespace) -> int:
    """Load, calibrate, decode ``--rows`` prompts together, print the figures."""
    model, tok = load_target(args)
    drafter = load_heads(model, args.heads, tokenizer=tok)[1] if args.heads else None
    prompts = [tok.apply_chat_template(p.messages([]), add_generation_prompt=True, tokenize=False)
               for p in load_bench_prompts(["chat", "code"], max(1, args.rows // 2), tok, 300)]
    ids = [tok.encode(text, add_special_tokens=False) for text in (prompts * args.rows)[:args.rows]]
    engine = BatchEngine(model, drafter, tok, max_batch=args.rows, exact=args.exact)
    engine.calibrate()
    engine.generate_batch(ids[:2], DecodeConfig(max_new_tokens=8))  # warm-up
    for prompt in ids:
        engine.add(prompt, DecodeConfig(max_new_tokens=args.max_new_tokens))
    shapes, tokens, start = Counter(), 0, time.perf_counter()
    while engine.busy:
        tokens += sum(len(new) for _, new in engine.step())
        shapes[(engine.last_step.rows, engine.last_step.drafted)] += 1
    elapsed = time.perf_counter() - start
    print(f"{args.model}, {args.rows} requests at once, heads {args.heads or 'none'}, exact {engine.target.exact}: "
          f"{tokens} tokens in {elapsed:.2f} s = {tokens / elapsed:.1f} tokens/s, {sum(shapes.values())} steps")
    print("steps by (requests in the pass, draft tokens verified): "
          + ", ".join(f"{rows}/{drafted}: {n}" for (rows, drafted), n in sorted(shapes.items())))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m selfspec_eval.batch_steps``: the model options, the heads, how many requests."""
    p = OneLineParser(prog="batch_steps", description=__doc__.split("\n")[0])
    add_model_options(p)
    p.add_argument("--heads", help="a heads folder to draft with (default: none, plain batched decoding)")
    p.add_argument("--rows", type=positive_int, default=16, help="requests decoded together")
    p.add_argument("--max-new-tokens", type=positive_int, default=96)
    return run_command("batch_steps", run, p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
