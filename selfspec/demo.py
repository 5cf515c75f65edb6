"""The README's main command: the same prompt decoded plainly and speculatively, side by side."""

from __future__ import annotations

from pathlib import Path

import torch

from .data import apply_chat_template
from .drafters.lookup_first import LookupFirstDrafter
from .drafters.prompt_lookup import PromptLookupDrafter
from .engine import DecodeConfig, GenerationResult, SpeculativeEngine
from .memory import format_bytes, predict_added, predict_target
from .zoo import load_model

COMMITTED_HEADS = Path(__file__).resolve().parent.parent / "checkpoints"


def committed_heads(model_name: str) -> list[Path]:
    """The heads checkpoints committed for ``model_name``: EAGLE-style, Medusa-style, early exit (those that exist)."""
    folders = [COMMITTED_HEADS / f"{Path(model_name).name}-{family}" for family in ("eagle", "medusa", "early-exit")]
    return [f for f in folders if (f / "selfspec_heads.json").is_file()]


def _row(name: str, res: GenerationResult, base: GenerationResult, width: int) -> str:
    s = res.stats
    speed = s.tokens_per_s / base.stats.tokens_per_s if base.stats.tokens_per_s else 0.0
    return (f"{name:<{width}} {s.new_tokens:>6} {s.tokens_per_s:>9.1f} {speed:>7.2f}x {s.mean_accepted:>6.2f} "
            f"{s.target_forwards:>8}")


def run_demo(model_name: str, prompt: str, max_new_tokens: int, heads: str | None = None) -> int:
    """Decode ``prompt`` with plain decoding and each available drafter; print text, speed, τ, memory."""
    torch.manual_seed(0)
    model, tokenizer = load_model(model_name)
    ids = apply_chat_template(tokenizer, [{"role": "user", "content": prompt}])
    cfg = DecodeConfig(max_new_tokens=max_new_tokens)
    folders = [Path(heads)] if heads else committed_heads(model_name)
    from .checkpoint import load_heads

    drafters = [(f"heads: {f.name}", load_heads(model, str(f), tokenizer)[1]) for f in folders]
    if drafters:  # what `selfspec generate --heads` runs: the first (EAGLE-style) heads behind prompt lookup
        drafters.append((f"{drafters[0][0]} + lookup", LookupFirstDrafter(drafters[0][1])))
    drafters.append(("prompt lookup (no training)", PromptLookupDrafter()))
    SpeculativeEngine(model).generate(ids[:8], DecodeConfig(max_new_tokens=4))  # warm-up
    plain = SpeculativeEngine(model, None, tokenizer).generate(ids, cfg)
    results = [(name, SpeculativeEngine(model, d, tokenizer).generate(ids, cfg), d) for name, d in drafters]
    base_params = sum(p.numel() for p in model.parameters())
    model_bytes = predict_target(model).weights
    print(f"model: {model_name} ({base_params / 1e6:.0f}M parameters), {plain.stats.dtype} (--dtype auto), "
          f"{plain.stats.target_pass} target pass, greedy, {max_new_tokens} new tokens\n")
    print(f"prompt: {prompt}\n")
    print("--- plain decoding ---")
    print(plain.text)
    print()
    width = max(len(name) for name, _ in drafters)
    print(f"{'method':<{width}} {'tokens':>6} {'tokens/s':>9} {'speedup':>8} {'tau':>6} {'passes':>8}")
    print(_row("plain", plain, plain, width))
    ok = True
    for name, res, drafter in results:
        print(_row(name, res, plain, width))
        same = res.tokens == plain.tokens
        ok &= same
        added = predict_added(model, drafter, cfg.max_nodes).at(len(ids) + max_new_tokens)
        print(f"{'':<{width}} identical to plain: {'yes' if same else 'NO'}; adds {format_bytes(added)} "
              f"({100 * added / model_bytes:.1f}% of the model's {format_bytes(model_bytes)}): "
              f"{drafter.extra_parameters() / 1e6:.2f}M parameters + its cache and draft tree")
    if not folders:
        print("\n(no trained heads committed for this model yet: showing training-free prompt lookup)")
    return 0 if ok else 1
