"""Copy a trained heads folder for publishing: weights cast (e.g. to bfloat16) and split into shards.

    python training/export_heads.py runs/qwen-eagle/heads checkpoints/qwen2.5-coder-1.5b-instruct-eagle \
        --dtype bfloat16 --max-shard-size 16MB

No base model is loaded: the config, model card and train_config.json are copied, the tensors
rewritten. Loading casts them back to the base model's dtype. Shards follow Hugging Face's
convention (heads-00001-of-00003.safetensors + heads.safetensors.index.json).
"""

import argparse
import sys

from selfspec.checkpoint import export_heads, heads_info
from selfspec.errors import SelfspecError
from selfspec.dtypes import DTYPES as MODEL_DTYPES

DTYPES = {"keep": None, **MODEL_DTYPES}


def main() -> int:
    """Parse flags, export, print the folder and its size."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="a heads folder (selfspec_heads.json + weights)")
    parser.add_argument("dest", help="the folder to write (created; earlier weights there are replaced)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bfloat16",
                        help="dtype of the stored floating-point tensors (default: bfloat16)")
    parser.add_argument("--max-shard-size", default=None,
                        help="split the weights into files of at most this size, e.g. 16MB (default: one file)")
    args = parser.parse_args()
    try:
        folder = export_heads(args.source, args.dest, DTYPES[args.dtype], args.max_shard_size)
        info = heads_info(folder)
    except (SelfspecError, ValueError) as exc:
        print(f"export_heads: error: {exc}", file=sys.stderr)
        return 2
    print(f"{folder}: {info['heads_parameters'] / 1e6:.2f}M parameters, {info['heads_bytes'] / 1e6:.1f} MB "
          f"in {info['heads_dtype']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
