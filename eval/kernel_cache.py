"""How many matmul kernels oneDNN compiles while a batch engine serves fresh prompts, round after round.

    python -m selfspec_eval.kernel_cache --model smollm2-135m-instruct --dtype bfloat16 \\
        --heads checkpoints/smollm2-135m-instruct-eagle --rounds 3 [--no-grid]

oneDNN compiles a kernel for each matmul shape it meets and keeps it (its primitive cache, up to 1,024; ~0.6 MiB
each for SmolLM2's linears). A server meets every prompt length and draft size, so unless its matmuls run on a few
shapes (``selfspec/target/packed_linear.py``: ``grid_rows``) the kernels keep coming and its memory grows for
hours. Each round, ``--requests`` held-out questions with a random suffix (every prompt new) decode to the end
through the batch engine, as ``selfspec serve`` runs them; the round prints how many kernels oneDNN had to compile
(``ONEDNN_VERBOSE=profile_create``'s cache misses) and the C heap in use and free after it. ``--no-grid`` runs the
matmuls at the shapes they come in, as before the grid. The decoding runs in a child process (oneDNN writes what
it compiles to that process's stdout).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from collections import Counter
from collections.abc import Iterable, Sequence

from selfspec.options import OneLineParser, add_model_options, positive_int, run_command

ROUND = "kernel_cache round "


def count_misses(lines: Iterable[str]) -> list[dict]:
    """oneDNN's verbose lines and the child's round reports -> per round: kernels compiled, by kind, and the heap."""
    rounds, misses = [], Counter()
    for line in lines:
        if line.startswith(ROUND):
            rounds.append({**json.loads(line[len(ROUND):]), "compiled": sum(misses.values()), "by_kind": dict(misses)})
            misses = Counter()
        elif "create:cache_miss" in line:
            fields = line.split(",")
            misses[fields[5] if len(fields) > 5 else "?"] += 1
    return rounds


def child(args: argparse.Namespace) -> int:
    """Decode the rounds; after each, one ``kernel_cache round {...}`` line on stdout."""
    from selfspec.batching import BatchEngine
    from selfspec.checkpoint import load_heads
    from selfspec.options import load_target
    from selfspec.request import DecodeConfig
    from selfspec.sampling import SamplingConfig
    from selfspec.serve.footprint import malloc_bytes

    from .prompts import load_bench_prompts

    if args.no_grid:  # the shapes as they come (the grid's own functions look these names up at each call)
        import selfspec.target.packed_linear as packed

        packed.grid_rows = lambda rows: rows
        packed.OUT_STEP = 1
    model, tok = load_target(args)
    drafter = load_heads(model, args.heads, tokenizer=tok)[1] if args.heads else None
    engine = BatchEngine(model, drafter, tok, max_batch=args.rows)
    engine.calibrate()
    print(ROUND + json.dumps({"round": "start"}), flush=True)
    questions = [p.messages([])[-1]["content"] for p in load_bench_prompts(["chat", "code"], 64, tok, 300)]
    rng = random.Random(0)
    for r in range(args.rounds):
        for _ in range(args.requests):
            messages = [{"role": "user", "content": f"{rng.choice(questions)}\n\n(ref {rng.randrange(1 << 40):x})"}]
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            cfg = DecodeConfig(max_new_tokens=rng.choice((16, 48, 96)), seed=rng.randrange(1 << 30),
                               sampling=SamplingConfig(temperature=rng.choice((0.0, 0.8))))
            engine.add(tok.encode(text, add_special_tokens=False), cfg)
        while engine.busy:
            engine.step()
        heap = {k: round(v / 2**20, 1) for k, v in malloc_bytes().items()}
        print(ROUND + json.dumps({"round": r, **heap}), flush=True)
    return 0


def run(args: argparse.Namespace) -> int:
    """Run the child with oneDNN's verbose output on; print each round's compiled kernels and heap."""
    argv = [sys.executable, "-m", "selfspec_eval.kernel_cache", "--child", *args.argv]
    proc = subprocess.run(argv, env={**os.environ, "ONEDNN_VERBOSE": "profile_create"}, capture_output=True,
                          text=True, errors="replace")
    if proc.returncode:
        sys.stderr.write(proc.stderr[-4000:])
        return proc.returncode
    for row in count_misses(proc.stdout.splitlines()):
        print(json.dumps(row))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m selfspec_eval.kernel_cache``."""
    p = OneLineParser(prog="kernel_cache", description=__doc__.split("\n")[0])
    add_model_options(p)
    p.add_argument("--heads", help="a heads folder to draft with (default: none)")
    p.add_argument("--rows", type=positive_int, default=8, help="requests decoded together")
    p.add_argument("--rounds", type=positive_int, default=3)
    p.add_argument("--requests", type=positive_int, default=48, help="fresh requests per round")
    p.add_argument("--no-grid", action="store_true", help="matmuls at the shapes they come in (as before the grid)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    args.argv = [a for a in argv if a != "--child"]
    return run_command("kernel_cache", child if args.child else run, args)


if __name__ == "__main__":
    sys.exit(main())
