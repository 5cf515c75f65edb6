"""selfspec demo (the README's main command): the same prompt decoded plainly and speculatively, side by side.

Every heads checkpoint of the model found on --heads-path drafts in turn (from a clone's root, the
committed ones in ./checkpoints), the first (EAGLE-style) also behind prompt lookup, then prompt
lookup alone; each row says whether its text is identical to plain decoding's and, where it is not,
whether the first differing token is a near-tie of the run's dtype (bf16 rounds a k-token pass differently
from k one-token passes; ``selfspec/divergence.py``) or a real divergence, a bug (exit status 1).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from selfspec.divergence import IDENTICAL, NEAR_TIE, REAL, Divergence, DivergenceChecker
from selfspec.engine import GenerationResult
from selfspec.options import add_decoding_options, add_heads_path_option, add_model_options, heads_folder
from selfspec.memory import weight_numel

HELP = "plain vs self-speculative decoding of one prompt, side by side"
DEMO_PROMPT = ("Write a Python function `is_palindrome(s)` that ignores case and punctuation, "
               "then show how to call it on three examples.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The prompt, the heads (given, or found on --heads-path), the shared model and decoding options."""
    p.add_argument("--prompt", default=DEMO_PROMPT)
    p.add_argument("--heads", type=heads_folder, metavar="FOLDER",
                   help="one heads checkpoint (default: every one of the model's found on --heads-path)")
    add_heads_path_option(p)
    add_model_options(p)
    add_decoding_options(p, max_new_tokens=160)


def _row(name: str, res: GenerationResult, base: GenerationResult, width: int, same: str, added: str) -> str:
    s = res.stats
    speed = s.tokens_per_s / base.stats.tokens_per_s if base.stats.tokens_per_s else 0.0
    return (f"{name:<{width}} {s.tokens_per_s:>9.1f} {speed:>7.2f}x {s.mean_accepted:>5.2f} {s.target_forwards:>6}  "
            f"{same:<{SAME_WIDTH}} {added}")


SAME_WIDTH = 34


def _drafters(model, tokenizer, folders: list[Path]) -> list[tuple[str, object]]:
    """(row name, drafter): each heads folder, the first behind prompt lookup, then prompt lookup alone."""
    from selfspec.checkpoint import load_heads
    from selfspec.drafters.lookup_first import LookupFirstDrafter
    from selfspec.drafters.prompt_lookup import PromptLookupDrafter

    drafters = [(f"heads: {f.name}", load_heads(model, str(f), tokenizer)[1]) for f in folders]
    if drafters:  # what `selfspec generate --heads` runs: the first (EAGLE-style) heads behind prompt lookup
        drafters.append((f"{drafters[0][0]} + lookup", LookupFirstDrafter(drafters[0][1])))
    return drafters + [("prompt lookup (no training)", PromptLookupDrafter())]


def _same(d: Divergence, dtype: str) -> str:
    """'identical', or where the output differs and whether that is rounding (a near-tie) or a bug."""
    if d.verdict == IDENTICAL:
        return "identical"
    if d.verdict == NEAR_TIE:
        return f"differs by {dtype} rounding at token {d.index}"
    return f"DIFFERS at token {d.index}: a bug ({d.reason})"


def run(args: argparse.Namespace) -> int:
    """Decode the prompt with plain decoding and each available drafter; print text, speed, τ, memory."""
    from selfspec.checkpoint import find_heads
    from selfspec.data import apply_chat_template
    from selfspec.engine import DecodeConfig, SpeculativeEngine
    from selfspec.memory import format_bytes, predict_added, predict_target
    from selfspec.options import decode_config, load_target
    from selfspec.target import make_target_pass

    torch.manual_seed(0)
    model, tokenizer = load_target(args)
    ids = apply_chat_template(tokenizer, [{"role": "user", "content": args.prompt}])
    cfg = decode_config(args)  # greedy
    folders = [Path(args.heads)] if args.heads else find_heads(args.model, args.heads_path)
    drafters = _drafters(model, tokenizer, folders)
    target = make_target_pass(model, args.target_pass, args.exact)  # one static cache (and packing) for every row
    SpeculativeEngine(model, backend=target).generate(ids[:8], DecodeConfig(max_new_tokens=4))  # warm-up
    plain = SpeculativeEngine(model, None, tokenizer, target).generate(ids, cfg)
    results = [(name, SpeculativeEngine(model, d, tokenizer, target).generate(ids, cfg), d)
               for name, d in drafters]
    base_params = weight_numel(model)
    model_bytes = predict_target(model).weights
    exact = "exact " if plain.stats.exact else ""
    print(f"model: {args.model} ({base_params / 1e6:.0f}M parameters), {plain.stats.dtype} (--dtype {args.dtype}), "
          f"{plain.stats.target_pass} {exact}target pass, greedy, {cfg.max_new_tokens} new tokens\n")
    print(f"prompt: {args.prompt}\n")
    print("--- plain decoding ---")
    print(plain.text)
    print()
    width = max(len(name) for name, _ in drafters)
    print(f"{'method':<{width}} {'tokens/s':>9} {'speedup':>8} {'tau':>5} {'passes':>6}  "
          f"{'output vs plain':<{SAME_WIDTH}} memory added")
    print(_row("plain", plain, plain, width, "-", "-"))
    ok = True
    checker = DivergenceChecker(model, max_new_tokens=cfg.max_new_tokens)
    for name, res, drafter in results:
        verdict = checker.diagnose(ids, plain.tokens, res.tokens)
        ok &= verdict.verdict != REAL
        added = predict_added(model, drafter, cfg.max_nodes).at(len(ids) + cfg.max_new_tokens)
        print(_row(name, res, plain, width, _same(verdict, plain.stats.dtype),
                   f"{format_bytes(added)} ({100 * added / model_bytes:.1f}% of {format_bytes(model_bytes)})"))
    print()
    if plain.stats.exact:
        print("exact target pass: each row of a verification pass is computed as a plain step computes it, so "
              "speculative output is bit-identical to plain decoding (--no-exact: faster passes, bf16 outputs may "
              "differ at near-ties)")
    else:
        why = getattr(getattr(target, "support", None), "reason", "") or "the eager pass is never exact"
        print(f"{plain.stats.target_pass} target pass, not exact ({why}): in {plain.stats.dtype} a many-token pass "
              "may round a near-tie differently from one-token steps; each difference is diagnosed above")
    if not folders:
        where = ", ".join(str(d) for d in args.heads_path)
        print(f"(no trained heads for {args.model} on --heads-path ({where}): showing training-free prompt lookup)")
    heads = f" --heads {folders[0]}" if folders else " --drafter prompt-lookup"
    print(f"\nnext: selfspec generate --model {args.model}{heads} --prompt \"Explain KV caches\"   "
          f"(then: selfspec bench --model {args.model} --n 4)")
    return 0 if ok else 1
