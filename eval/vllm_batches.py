"""vLLM with and without exported heads at several batch sizes: where speculation stops paying.

    python -m selfspec_eval.vllm_batches --model smollm2-135m-instruct \\
        --heads checkpoints/experimental/smollm2-135m-instruct-eagle3 --batch 1,4,16

A decoding step of a batch of b requests reads the weights once for all b, so plain decoding's tokens/s
grows with b while a speculative step's extra tokens cost real compute: the gain of drafting shrinks as
the batch grows. For each batch size, in each round, the same b questions (held-out ShareGPT +
HumanEval first turns, cycled) are decoded greedily by vLLM plain and by vLLM with the heads
(``vllm+<family>``, chains of ``--spec-tokens``), one after the other; tokens/s is every new token of the
batch over the call's wall time. Prints a table of tokens/s, the ratio, and vLLM's own acceptance.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch

from selfspec.checkpoint.format import read_heads_json
from selfspec.data import apply_chat_template
from selfspec.dtypes import dtype_name
from selfspec.errors import SelfspecError
from selfspec.memory import model_dtype
from selfspec.options import OneLineParser, add_model_options, load_target, positive_int, run_command
from selfspec.zoo import resolve

from .methods import build_methods
from .prompts import load_bench_prompts
from .vllm_client import WorkerConfig, missing_environment
from .verify_cost import parse_ks


def measure(plain, heads, prompts: list[list[int]], sizes: list[int], max_new: int, rounds: int) -> list[dict]:
    """Per batch size: summed new tokens and seconds of each client over ``rounds`` rounds, the heads' counters."""
    rows = []
    for b in sizes:
        batch = [prompts[i % len(prompts)] for i in range(b)]
        row = {"batch": b, "tokens": [0, 0], "seconds": [0.0, 0.0], "drafts": 0, "accepted": []}
        for _ in range(rounds):
            for i, client in enumerate((plain, heads)):
                outputs, run = client.run_batch(batch, max_new)
                row["tokens"][i] += sum(len(o) for o in outputs)
                row["seconds"][i] += run.seconds
                if run.reached_depth:
                    row["drafts"] += run.reached_depth[0]
                    acc = run.accepted_at_depth
                    row["accepted"] = [a + b for a, b in zip(acc, row["accepted"] + [0] * len(acc))]
        rows.append(row)
    return rows


def table(rows: list[dict], name: str) -> str:
    """Markdown: batch, tokens/s of each, their ratio, vLLM's acceptance per draft position and tau."""
    lines = [f"| batch | vllm tok/s | {name} tok/s | ratio | acceptance by position | tau |", "|---|---|---|---|---|---|"]
    for r in rows:
        plain, heads = (t / s for t, s in zip(r["tokens"], r["seconds"]))
        drafts = r["drafts"]
        acc = " ".join(f"{a / drafts:.2f}" for a in r["accepted"]) if drafts else "-"
        tau = f"{1 + sum(r['accepted']) / drafts:.2f}" if drafts else "-"
        lines.append(f"| {r['batch']} | {plain:.2f} | {heads:.2f} | {heads / plain:.2f}x | {acc} | {tau} |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Start both workers, warm them, measure every batch size, print the table."""
    why = missing_environment()
    if why:
        raise SelfspecError(why)
    sizes = parse_ks(args.batch)
    target, tok = load_target(args)
    family = read_heads_json(args.heads)["family"]
    name = f"vllm+{family}"
    config = WorkerConfig(resolve(args.model), dtype_name(model_dtype(target)), torch.get_num_threads(),
                          log_dir=args.log_dir)
    plain, heads = build_methods(["vllm", name], target, tok, None, {family: args.heads}, vllm=config,
                                 vllm_spec_tokens=args.spec_tokens)
    prompts = [apply_chat_template(tok, q.messages([]))
               for q in load_bench_prompts(["chat", "code"], max(sizes), tok)]
    try:
        measure(plain.client, heads.client, prompts[:1], [1], 8, 1)  # start and warm both workers
        rows = measure(plain.client, heads.client, prompts, sizes, args.max_new_tokens, args.rounds)
    finally:
        plain.close()
        heads.close()
    print(f"{args.model}, {dtype_name(model_dtype(target))}, heads {args.heads}, chains of {args.spec_tokens}, "
          f"{args.max_new_tokens} new tokens, {args.rounds} rounds, {torch.get_num_threads()} threads")
    print(table(rows, name))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m selfspec_eval.vllm_batches``: the model options, the heads, the batch sizes."""
    p = OneLineParser(prog="vllm_batches", description=__doc__.split("\n")[0])
    add_model_options(p)
    p.add_argument("--heads", required=True, help="an eagle3 or medusa heads folder (exported for vLLM on the fly)")
    p.add_argument("--batch", default="1,4,16", help="batch sizes, comma-separated")
    p.add_argument("--spec-tokens", type=positive_int, default=3, help="vLLM's draft chain length")
    p.add_argument("--max-new-tokens", type=positive_int, default=64)
    p.add_argument("--rounds", type=positive_int, default=2, help="timed rounds per batch size")
    p.add_argument("--log-dir", default=None, help="where the workers' logs and the export go (default: temporary)")
    return run_command("vllm_batches", run, p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
