"""Deterministic drafters replayed on recorded greedy answers: tau without the model, to compare drafting rules.

    python -m selfspec_eval.suffix_replay runs/templated-qwen/runs.jsonl --method prompt-lookup

Greedy output does not depend on the drafter, so a run's answers (a bench ``runs.jsonl``: one method's rows, in the
order they were asked) fix what every later step must match. Each answer is replayed step by step: the drafter
proposes a tree from the prompt and the answer so far (``--depth`` levels, ``--nodes`` nodes, no adaptive depth),
the longest path that matches the answer is accepted with the target's token after it, and a finished request joins
the drafter's memory (``Drafter.finished``), as in the engine. Prints tau per window of ``--window`` requests for
prompt lookup and suffix drafting. No pass runs, so no timing: the engine's tau (adaptive depth) differs by a few
percent; use it to choose between drafting rules, then measure the chosen one with ``templated.py``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from selfspec.data.jsonio import read_records
from selfspec.drafters.base import DraftContext, Drafter, DraftRequest
from selfspec.drafters.prompt_lookup import PromptLookupDrafter
from selfspec.drafters.suffix import SuffixDrafter
from selfspec.options import OneLineParser, positive_int, run_command
from selfspec.sampling import SamplingConfig
from selfspec.tree import DraftTree


def accepted(tree: DraftTree, truth: list[int]) -> int:
    """Depth of the deepest node whose whole path equals the start of ``truth``."""
    ok, best = [True], 0
    for i in range(1, tree.size):
        d = tree.depth[i]
        ok.append(ok[tree.parents[i]] and d <= len(truth) and int(tree.tokens[i]) == truth[d - 1])
        best = max(best, d) if ok[i] else best
    return best


def replay(drafter: Drafter, requests: list[tuple[list[int], list[int]]], depth: int, nodes: int
           ) -> list[tuple[int, int]]:
    """(answer tokens, target passes) per request, the requests in order."""
    out, req = [], DraftRequest(depth, nodes, SamplingConfig())
    for prompt, answer in requests:
        seq = [*prompt, *answer]
        i, steps = len(prompt), 0
        while i < len(seq):
            tree, _ = drafter.propose(None, DraftContext(torch.tensor(seq[:i]), i - 1), req)
            i += accepted(tree, seq[i:]) + 1
            steps += 1
        out.append((len(answer), steps))
        drafter.finished(None, torch.tensor(seq))
    return out


def run(args: argparse.Namespace) -> int:
    rows = [r for r in read_records(Path(args.runs)) if r["method"] == args.method]
    requests = [(r["prompt_ids"], r["tokens"]) for r in rows]
    print(f"{len(requests)} answers of {args.method} in {args.runs}; depth {args.depth}, {args.nodes} nodes; "
          f"tau per window of {args.window}")
    for name, drafter in (("prompt-lookup", PromptLookupDrafter()), ("suffix", SuffixDrafter())):
        per = replay(drafter, requests, args.depth, args.nodes)
        windows = [per[i:i + args.window] for i in range(0, len(per), args.window)]
        taus = [sum(t for t, _ in w) / sum(s for _, s in w) for w in windows]
        print(f"{name:14} " + " ".join(f"{tau:.2f}" for tau in taus))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m selfspec_eval.suffix_replay``."""
    p = OneLineParser(prog="suffix_replay", description=__doc__.split("\n")[0])
    p.add_argument("runs", help="a bench runs.jsonl")
    p.add_argument("--method", default="prompt-lookup", help="whose answers (any greedy method's are the same)")
    p.add_argument("--depth", type=positive_int, default=16)
    p.add_argument("--nodes", type=positive_int, default=16)
    p.add_argument("--window", type=positive_int, default=10)
    return run_command("suffix_replay", run, p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
