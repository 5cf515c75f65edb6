"""Held-out top-1 accuracy by draft depth of several heads checkpoints, on the same conversations.

    python -m selfspec_eval.heldout --model qwen2.5-coder-1.5b-instruct \\
        --heads checkpoints/qwen2.5-coder-1.5b-instruct-eagle runs/heads/q3/qwen2.5-coder-1.5b-instruct-eagle3 \\
        --data runs/data/qwen-selfdistill.jsonl,runs/data/qwen-code-mix.jsonl --examples 32

Top-1 by depth is the measure training logs at each epoch's end (``selfspec.train.objectives.depth_accuracy``): on the
assistant tokens of held-out conversations (the deterministic split by id that training leaves out), how
often the heads' depth-d guess equals the target's greedy token, teacher-forced. Every checkpoint sees the
same conversations, the target's states computed once per batch, so families compare on equal terms
whatever data each was trained on. Beside it, the whole-chain measure: of the roots, the share whose guesses are
right at every depth up to d, the teacher-forced counterpart of a chain's acceptance at position d (which
`selfspec bench` and vLLM report).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch
from torch.utils.data import DataLoader

from selfspec.checkpoint import check_heads_folder, load_heads
from selfspec.dtypes import dtype_name
from selfspec.memory import model_dtype
from selfspec.target.packed_linear import dense_linears
from selfspec.options import OneLineParser, add_model_options, load_target, positive_int, run_command
from selfspec.train.config import TrainConfig
from selfspec.train.features import TokenDataset, pad_batch
from selfspec.train.objectives import chain_accuracy, depth_counts, depth_hits
from selfspec.train.loop import EVAL_DEPTH, load_examples, with_features


def accuracies(heads, target, loader, device) -> tuple[list[float], list[float]]:
    """Held-out top-1 by depth, and the share of roots whose guesses are right at every depth up to d (what a
    drafted chain gets accepted at position d), both teacher-forced, up to ``EVAL_DEPTH``."""
    sums = {name: ([0] * EVAL_DEPTH, [0] * EVAL_DEPTH) for name in ("depth", "chain")}
    heads.eval()
    for batch in loader:
        batch = with_features({k: v.to(device) for k, v in batch.items()}, target, heads)
        hits = depth_hits(heads, target, batch, EVAL_DEPTH)
        for name, (correct, total) in (("depth", depth_counts(hits)), ("chain", chain_accuracy(hits))):
            for d, (c, t) in enumerate(zip(correct, total)):
                sums[name][0][d] += c
                sums[name][1][d] += t
    return tuple([c / t for c, t in zip(*sums[name]) if t] for name in ("depth", "chain"))


def cells(acc: list[float]) -> str:
    """Accuracies to depth ``EVAL_DEPTH``, '-' where a family drafts fewer (Medusa: its heads; early exit: 1)."""
    return " ".join([f"{a:.3f}" for a in acc] + ["-"] * (EVAL_DEPTH - len(acc)))


def run(args: argparse.Namespace) -> int:
    """Load the target once, then each checkpoint; print one row of accuracies per checkpoint."""
    for folder in args.heads:  # a wrong folder fails before the model loads
        check_heads_folder(folder)
    target, tok = load_target(args)
    target.eval().requires_grad_(False)
    cfg = TrainConfig(base_model=args.model, data=args.data, max_length=args.max_length,
                      heldout_fraction=args.heldout_fraction)
    examples = load_examples(cfg, tok, "heldout", args.examples)
    tokens = sum(int(e["loss_mask"].sum()) for e in examples)
    print(f"{args.model}, {dtype_name(model_dtype(target))}: {len(examples)} held-out conversations of "
          f"{args.data}, {tokens} assistant tokens")
    loader = DataLoader(TokenDataset(examples), batch_size=args.batch_size, collate_fn=pad_batch)
    print("| heads | family | top-1 by depth 1..4 | whole chain right to depth 1..4 |")
    print("|---|---|---|---|")
    device = next(target.parameters()).device
    for folder in args.heads:
        heads, _ = load_heads(target, folder, tokenizer=tok)
        with dense_linears(heads):  # the drafter packed them for decoding; teacher-forced batches run them dense,
            depth, chain = accuracies(heads.float(), target, loader, device)  # in float32 as training evaluates
        print(f"| {folder} | {heads.config.family} | {cells(depth)} | {cells(chain)} |", flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m selfspec_eval.heldout``: the model options, the heads folders, the data."""
    p = OneLineParser(prog="heldout", description=__doc__.split("\n")[0])
    add_model_options(p)
    p.add_argument("--heads", nargs="+", required=True, help="heads folders of --model, any families")
    p.add_argument("--data", default="sharegpt", help="data sources as training takes them, comma-separated")
    p.add_argument("--examples", type=positive_int, default=32, help="held-out conversations")
    p.add_argument("--max-length", type=positive_int, default=320, help="tokens per conversation")
    p.add_argument("--heldout-fraction", type=float, default=0.02, help="the split training used")
    p.add_argument("--batch-size", type=positive_int, default=4)
    return run_command("heldout", run, p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
