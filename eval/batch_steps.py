"""What the batch engine does alone, without a server: tokens/s and the draft size it chose at each step.

    python -m selfspec_eval.batch_steps --model smollm2-135m-instruct --rows 16 --dtype bfloat16
    python -m selfspec_eval.batch_steps --model smollm2-135m-instruct --rows 16 --dtype bfloat16 \
        --heads checkpoints/smollm2-135m-instruct-eagle

``--rows`` held-out prompts (chat and code, as ``serve_load`` sends them) join at once and decode to the end
(``BatchEngine.step`` in a loop, after ``calibrate()`` as ``selfspec serve`` does). Prints total tokens/s and how
many steps ran with how many requests and draft tokens: where serving under load falls short of the engine, the
gap is the server's; where the budget drafts at a load it should not, it shows here. ``--breakdown STEPS``: where a
step's time goes instead (ms per step by part, from torch's profiler), for plain steps without ``--heads``.
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


PARTS = (  # an operator's part of a step, by its profiler name (first match)
    ("packed linears", ("mkldnn::_linear_pointwise",)),
    ("dense matmuls (a tied LM head)", ("aten::mm", "aten::addmm", "aten::bmm")),
    ("attention", ("selfspec::", "scaled_dot_product", "attention")),
    ("KV writes, gathers, copies", ("aten::index_put", "aten::index_select", "aten::index", "aten::copy_", "aten::cat",
                                    "aten::gather", "aten::_to_copy", "aten::clone", "aten::contiguous")),
    ("norms, rotary, activations, other ops", ("",)),
)


def part_of(name: str) -> str:
    return next(part for part, prefixes in PARTS if any(name.startswith(p) or p in name for p in prefixes))


def breakdown(engine: BatchEngine, steps: int) -> dict[str, float]:
    """ms per plain batched step by part: ``steps`` steps timed alone, then as many under the profiler, whose
    operators' own times are summed by :data:`PARTS`; what the operators do not account for is Python, dispatch
    and the profiler's own overhead (``wall under the profiler`` minus the operators)."""
    from torch.profiler import ProfilerActivity, profile

    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = (time.perf_counter() - start) / steps * 1e3
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        profiled = (time.perf_counter() - start) / steps * 1e3
    parts = Counter()
    for event in prof.key_averages():
        if not event.key.startswith("ProfilerStep"):
            parts[part_of(event.key)] += event.self_cpu_time_total / 1e3 / steps
    ops = sum(parts.values())
    return {"step ms (no profiler)": wall, "step ms (profiled)": profiled, **dict(parts),
            "Python, dispatch, profiler (profiled - ops)": profiled - ops}


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
    if args.breakdown:
        while engine.waiting or engine.joining:  # every prompt cached: what follows are decoding steps
            engine.step()
        table = breakdown(engine, args.breakdown)
        print(f"{args.model}, {len(engine.running)} rows, heads {args.heads or 'none'}, exact {engine.target.exact}: "
              f"ms per step by part ({args.breakdown} steps each way)")
        for part, ms in table.items():
            print(f"  {part:<45} {ms:7.2f}")
        return 0
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
    p.add_argument("--breakdown", type=positive_int, metavar="STEPS",
                   help="instead: time STEPS decoding steps once all prompts are cached, then as many under torch's "
                        "profiler, and print ms per step by part (linears, attention, KV writes, other ops, Python)")
    args = p.parse_args(argv)
    if args.breakdown and 2 * args.breakdown >= args.max_new_tokens:
        p.error(f"--breakdown {args.breakdown} runs {2 * args.breakdown} steps: give --max-new-tokens above that "
                "(every row must still decode)")
    return run_command("batch_steps", run, args)


if __name__ == "__main__":
    sys.exit(main())
