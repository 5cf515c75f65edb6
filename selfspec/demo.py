"""The README's main command: the same prompt decoded plainly and speculatively, side by side."""

from __future__ import annotations

from pathlib import Path

import torch

from .data import apply_chat_template
from .drafters.prompt_lookup import PromptLookupDrafter
from .engine import DecodeConfig, GenerationResult, SpeculativeEngine
from .zoo import load_model

COMMITTED_HEADS = Path(__file__).resolve().parent.parent / "checkpoints"


def committed_heads(model_name: str) -> Path | None:
    """The heads checkpoint committed for ``model_name`` (EAGLE-style preferred), if any."""
    for family in ("eagle", "medusa", "early-exit"):
        folder = COMMITTED_HEADS / f"{model_name}-{family}"
        if (folder / "selfspec_heads.json").is_file():
            return folder
    return None


def _row(name: str, res: GenerationResult, base: GenerationResult) -> str:
    s = res.stats
    speed = s.tokens_per_s / base.stats.tokens_per_s if base.stats.tokens_per_s else 0.0
    return (f"{name:<24} {s.new_tokens:>6} {s.tokens_per_s:>9.1f} {speed:>7.2f}x {s.mean_accepted:>6.2f} "
            f"{s.target_forwards:>8}")


def run_demo(model_name: str, prompt: str, max_new_tokens: int, heads: str | None = None) -> int:
    """Decode ``prompt`` with plain decoding and each available drafter; print text, speed, τ, memory."""
    torch.manual_seed(0)
    model, tokenizer = load_model(model_name)
    ids = apply_chat_template(tokenizer, [{"role": "user", "content": prompt}])
    cfg = DecodeConfig(max_new_tokens=max_new_tokens)
    drafters = [("prompt lookup", PromptLookupDrafter())]
    heads_folder = heads or committed_heads(model_name)
    if heads_folder is not None:
        from .checkpoint import load_heads

        drafters.insert(0, (f"heads ({Path(heads_folder).name})", load_heads(model, str(heads_folder), tokenizer)[1]))
    SpeculativeEngine(model).generate(ids[:8], DecodeConfig(max_new_tokens=4))  # warm-up
    plain = SpeculativeEngine(model, None, tokenizer).generate(ids, cfg)
    results = [(name, SpeculativeEngine(model, d, tokenizer).generate(ids, cfg), d) for name, d in drafters]
    base_params = sum(p.numel() for p in model.parameters())
    print(f"model: {model_name} ({base_params / 1e6:.0f}M parameters), greedy, {max_new_tokens} new tokens\n")
    print(f"prompt: {prompt}\n")
    print("--- plain decoding ---")
    print(plain.text)
    print()
    print(f"{'method':<24} {'tokens':>6} {'tokens/s':>9} {'speedup':>8} {'tau':>6} {'passes':>8}")
    print(_row("plain", plain, plain))
    ok = True
    for name, res, drafter in results:
        print(_row(name, res, plain))
        same = res.tokens == plain.tokens
        ok &= same
        extra = drafter.extra_parameters()
        print(f"{'':<24} identical to plain: {'yes' if same else 'NO'}; adds {extra / 1e6:.2f}M parameters "
              f"({100 * extra / base_params:.1f}% of the model)")
    if heads_folder is None:
        print("\n(no trained heads committed for this model yet: showing training-free prompt lookup)")
    return 0 if ok else 1
