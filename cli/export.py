"""selfspec export HEADS OUT --format vllm|sglang|speculators: eagle3 heads as the EAGLE-3 drafter a serving
engine loads (config.json + model.safetensors; only the base model's config is read); for vllm also eagle heads (as a
two-layer EAGLE-3 drafter computing what the head does, ``--layout mtp``: as vLLM's MTP layer; trained with
``--head-arg norms=false``: as vLLM's EAGLE-1 drafter) and medusa heads (the base model's LM head copied in, as
vLLM's Medusa checkpoints carry it). For vllm it prints the ``vllm serve`` flags.

    selfspec export runs/smollm2-eagle3/heads exported/smollm2-eagle3 --format vllm
    vllm serve smollm2-135m-instruct-folder --speculative-config \\
        '{"method": "eagle3", "model": "exported/smollm2-eagle3", "num_speculative_tokens": 3}'

``--format speculators`` writes the speculators layout, which ``vllm serve OUT`` serves alone. Medusa heads:
``--speculative-config '{"method": "medusa", "model": OUT, "num_speculative_tokens": <the number of heads>}'``.
"""

from __future__ import annotations

import argparse
import json
import shlex

from selfspec.dtypes import DTYPES
from selfspec.options import heads_folder, positive_int

HELP = ("write eagle3 heads in the layout vLLM, SGLang or speculators load (eagle and medusa heads: vLLM's)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The heads folder, the output folder, the format and what the config needs."""
    from selfspec.export import EAGLE_LAYOUTS, FORMATS

    p.add_argument("folder", type=heads_folder,
                   help="a selfspec heads folder (eagle3; for vllm also eagle or medusa)")
    p.add_argument("out", help="the folder to write (config.json, model.safetensors)")
    p.add_argument("--format", choices=FORMATS, default="vllm")
    p.add_argument("--base", default=None, help="the base model (default: the one the heads folder names)")
    p.add_argument("--num-speculative-tokens", type=positive_int, default=3,
                   help="the proposal length in the speculators config and the printed vllm flags (default 3)")
    p.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    p.add_argument("--layout", choices=EAGLE_LAYOUTS, default=None,
                   help="eagle heads in vLLM: eagle3 (default: two EAGLE-3 layers drafting over the head's vocabulary) "
                        "or mtp (vLLM's MTP layer: any rotary embedding, the whole vocabulary)")


def run(args: argparse.Namespace) -> int:
    """Export and say where."""
    from selfspec.export import export_for_serving, vllm_serve_flags

    out = export_for_serving(args.folder, args.out, args.format, base=args.base,
                             num_speculative_tokens=args.num_speculative_tokens, dtype=DTYPES[args.dtype],
                             layout=args.layout)
    print(f"wrote {out}/config.json and {out}/model.safetensors ({args.format})")
    if args.format == "vllm":
        flags = vllm_serve_flags(out, args.num_speculative_tokens)
        base = json.loads((out / "config.json").read_text()).get("base_model", "<base model folder>")
        print("serve it: vllm serve " + " ".join(shlex.quote(f) for f in [base, *flags]))
    return 0
