"""Normed eagle heads in EAGLE-1's layout (what vLLM loads), the norms folded into the weights, calibrated on data.

    python training/fold_norms.py checkpoints/qwen2.5-coder-1.5b-instruct-eagle runs/heads/qwen-eagle1-folded \\
        --data runs/data/qwen-selfdistill.jsonl
    python training/train_heads.py --config training/configs/qwen2.5-coder-1.5b-eagle1.json  # --init-from it

The folded heads replace each per-token RMS by a constant (``selfspec/train/fold_norms.py``): a starting point
that keeps most of what the normed heads predict, for a short training run in the new layout.
"""

import argparse
import sys

import torch
from torch.utils.data import DataLoader

from selfspec.checkpoint import load_heads, read_heads_json, save_heads
from selfspec.options import OneLineParser, positive_int, run_command
from selfspec.target.packed_linear import dense_linears
from selfspec.train.config import TrainConfig
from selfspec.train.features import TokenDataset, pad_batch
from selfspec.train.fold_norms import calibrate, fold_norms
from selfspec.train.loop import load_examples, with_features
from selfspec.zoo import load_model


def run(args: argparse.Namespace) -> int:
    """Load the target and the normed heads, calibrate on the data, write the folded heads."""
    model = args.model or read_heads_json(args.heads)["base"]["name_or_path"]
    target, tok = load_model(model, dtype=args.dtype)
    target.eval().requires_grad_(False)
    heads, _ = load_heads(target, args.heads, tokenizer=tok)
    examples = load_examples(TrainConfig(base_model=model, data=args.data, max_length=args.max_length), tok,
                             "train", args.examples)
    batches = (with_features(b, target, heads) for b in DataLoader(TokenDataset(examples), batch_size=4,
                                                                    collate_fn=pad_batch))
    with dense_linears(heads), torch.no_grad():
        heads = heads.float()
        scales = calibrate(heads, target, batches)
        folded = fold_norms(heads, target, scales)
    save_heads(folded, target, args.out, tokenizer=tok, base_name=model)
    print(f"calibrated on {len(examples)} conversations: 1/rms {scales.inv}, kappa {scales.kappa:.4f}")
    print(f"wrote {args.out} (eagle, norms=false)")
    return 0


def main() -> int:
    p = OneLineParser(prog="fold_norms", description=__doc__.split("\n")[0])
    p.add_argument("heads", help="eagle heads with their norms")
    p.add_argument("out", help="the folder to write")
    p.add_argument("--data", required=True, help="conversations to calibrate on, as training takes them")
    p.add_argument("--model", default=None, help="the base model (default: the one the heads folder names)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--examples", type=positive_int, default=24, help="conversations to calibrate on")
    p.add_argument("--max-length", type=positive_int, default=320)
    return run_command("fold_norms", run, p.parse_args())


if __name__ == "__main__":
    sys.exit(main())
