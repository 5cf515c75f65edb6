"""selfspec generate: one prompt, printed as it is decoded (stats on stderr), or one JSON object; or a file of
prompts (``--prompts FILE.jsonl``) decoded together in batches, one JSON line per answer, in the file's order.

Prompts are checked against the model's context before the weights load.
"""

from __future__ import annotations

import argparse
import json
import sys

from selfspec.errors import SelfspecError
from selfspec.options import (add_decoding_options, add_drafter_options, add_model_options, add_sampling_options,
                              decode_config, load_target, positive_int)

HELP = "decode one prompt (streams text, or --json), or a file of prompts in batches (--prompts)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The prompt, the output form, the drafter, and the shared model / decoding / sampling options."""
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--prompt", help="the prompt (a user message, or raw text with --no-chat-template)")
    which.add_argument("--prompts", metavar="FILE", help='a .jsonl/.json file of prompts, each a string, '
                       '{"prompt": ...} or {"messages": [...]}: decoded together, one JSON line per answer')
    p.add_argument("--max-batch", type=positive_int, default=8, help="with --prompts: requests decoded together "
                   "(default: %(default)s)")
    p.add_argument("--no-chat-template", action="store_true", help="feed the prompt as raw text")
    p.add_argument("--json", action="store_true", help="print one JSON object with text and stats")
    p.add_argument("--drafter", choices=["none", "draft-model", "prompt-lookup", "suffix"], default="prompt-lookup",
                   help="what drafts when no --heads are given (default: %(default)s; suffix: the request's own "
                   "context and every answer finished before, with --prompts; with --heads: suffix drafts first)")
    add_model_options(p)
    add_decoding_options(p)
    add_sampling_options(p)
    add_drafter_options(p)


def suffix_drafter(args: argparse.Namespace, scopes: int = 0, min_match: int = 1):
    """``--drafter suffix``'s drafter within ``--suffix-max-mib``: one index, or ``scopes`` indexes sharing it;
    drafting from matches of ``min_match`` tokens or more."""
    from selfspec.drafters.suffix import SuffixDrafter, SuffixIndex

    total = int(args.suffix_max_mib * 2**20)
    if scopes:
        return SuffixDrafter(SuffixIndex(0), scoped_bytes=total // scopes, min_match=min_match)
    return SuffixDrafter(SuffixIndex(total), min_match=min_match)


def build_drafter(args: argparse.Namespace, model, tokenizer, suffix_scopes: int = 0):
    """The drafter named by ``--drafter`` / ``--heads`` (None for plain decoding); ``suffix_scopes``: with
    ``--drafter suffix``, that many scopes (the server's API keys) each keep their own index."""
    from selfspec.drafters.draft_model import DraftModelDrafter
    from selfspec.drafters.lookup_first import LookupFirstDrafter
    from selfspec.drafters.prompt_lookup import PromptLookupDrafter
    from selfspec.zoo import load_model

    if args.heads:
        from selfspec.checkpoint import load_heads

        drafter = load_heads(model, args.heads, tokenizer=tokenizer)[1]
        if args.drafter == "suffix":  # heads, with suffix drafts first where 3+ tokens match
            return LookupFirstDrafter(drafter, lookup=suffix_drafter(args, suffix_scopes, min_match=3))
        return drafter if args.no_lookup else LookupFirstDrafter(drafter)
    if args.drafter == "none":
        return None
    if args.drafter == "prompt-lookup":
        return PromptLookupDrafter()
    if args.drafter == "suffix":
        return suffix_drafter(args, suffix_scopes)
    if not args.draft_model:
        raise SelfspecError("--drafter draft-model needs --draft-model NAME (e.g. qwen2.5-coder-0.5b-instruct)")
    draft, draft_tok = load_model(args.draft_model, dtype=args.dtype, device=args.device)
    if draft_tok.get_vocab() != tokenizer.get_vocab():
        raise SelfspecError(f"--draft-model {args.draft_model} has a different tokenizer from --model {args.model}: "
                            "a separate draft model must share the target's tokenizer")
    drafter = DraftModelDrafter(draft, target_vocab_size=model.get_output_embeddings().out_features)
    return drafter if args.no_lookup else LookupFirstDrafter(drafter)


def prompt_ids(tokenizer, text: str, chat: bool) -> list[int]:
    """The prompt's token ids, through the tokenizer's chat template unless ``chat`` is False."""
    from selfspec.data import apply_chat_template

    if chat:
        return apply_chat_template(tokenizer, [{"role": "user", "content": text}])
    return tokenizer.encode(text)


def file_prompts(path: str, tokenizer, chat: bool) -> list[tuple[object, list[int]]]:
    """(id or None, token ids) of every prompt in ``path`` (``--prompts``); one line names the record it cannot use."""
    from pathlib import Path

    from selfspec.data import apply_chat_template, read_records

    out = []
    for i, rec in enumerate(read_records(Path(path)), start=1):
        if isinstance(rec, str):
            out.append((None, prompt_ids(tokenizer, rec, chat)))
        elif isinstance(rec, dict) and isinstance(rec.get("messages"), list):
            out.append((rec.get("id"), apply_chat_template(tokenizer, rec["messages"])))
        elif isinstance(rec, dict) and isinstance(rec.get("prompt"), str):
            out.append((rec.get("id"), prompt_ids(tokenizer, rec["prompt"], chat)))
        else:
            raise SelfspecError(f"{path}: record {i} is neither a string nor an object with \"prompt\" (a string) or "
                                f"\"messages\" (a list)")
    if not out:
        raise SelfspecError(f"{path} holds no prompts")
    return out


def summary(s, drafter) -> dict:
    """What ``--json`` prints of one answer's stats."""
    return {"new_tokens": s.new_tokens, "tokens_per_s": s.tokens_per_s, "mean_accepted": s.mean_accepted,
            "target_forwards": s.target_forwards, "dtype": s.dtype, "target_pass": s.target_pass, "exact": s.exact,
            "drafter": drafter.name if drafter else "none", "stats": s.to_dict()}


def run_file(args: argparse.Namespace) -> int:
    """``--prompts``: every prompt decoded, ``--max-batch`` at a time; one JSON line per answer, in order."""
    from selfspec.batching import BatchEngine
    from selfspec.context import check_request
    from selfspec.zoo import load_config, load_tokenizer

    prompts = file_prompts(args.prompts, load_tokenizer(args.model), not args.no_chat_template)
    config = load_config(args.model)
    for i, (_, ids) in enumerate(prompts, start=1):
        try:
            check_request(config, len(ids), args.max_new_tokens)
        except SelfspecError as exc:
            raise SelfspecError(f"{args.prompts}, prompt {i}: {exc}") from None
    model, tokenizer = load_target(args)
    drafter = build_drafter(args, model, tokenizer)
    context = max(len(ids) for _, ids in prompts) + args.max_new_tokens
    engine = BatchEngine(model, drafter, tokenizer, max_batch=args.max_batch, context=context, exact=args.exact)
    results = engine.generate_batch([ids for _, ids in prompts], decode_config(args), progress=len(prompts) > 1)
    for i, ((pid, _), res) in enumerate(zip(prompts, results)):
        print(json.dumps({"index": i, **({"id": pid} if pid is not None else {}), "text": res.text,
                          **summary(res.stats, drafter)}, ensure_ascii=False))
    return 0


def run(args: argparse.Namespace) -> int:
    """Check the prompt against the context, load, decode; print the text and stats."""
    if args.prompts:
        return run_file(args)
    from selfspec.context import check_request
    from selfspec.engine import SpeculativeEngine
    from selfspec.stats import GenerationStats
    from selfspec.zoo import load_config, load_tokenizer

    ids = prompt_ids(load_tokenizer(args.model), args.prompt, not args.no_chat_template)
    check_request(load_config(args.model), len(ids), args.max_new_tokens)
    model, tokenizer = load_target(args)
    drafter = build_drafter(args, model, tokenizer)
    engine = SpeculativeEngine(model, drafter, tokenizer, backend=args.target_pass, exact=args.exact)
    cfg = decode_config(args)
    if args.json:
        res = engine.generate(ids, cfg)
        print(json.dumps({"text": res.text, **summary(res.stats, drafter)}))
        return 0
    stats = GenerationStats()
    for piece in engine.stream(ids, cfg, stats):
        print(piece, end="", flush=True)
    print()
    drafts = ", ".join(f"{n} by {source}" for source, n in stats.drafts_by_source.items())
    print(f"[{stats.new_tokens} tokens, {stats.tokens_per_s:.1f} tokens/s, tau {stats.mean_accepted:.2f}, "
          f"{stats.target_forwards} target passes, {stats.dtype} {stats.target_pass}{' exact' if stats.exact else ''} pass, "
          f"drafter {drafter.name if drafter else 'none'}"
          f"{'; drafts: ' + drafts if drafts else ''}]", file=sys.stderr)
    return 0
