"""The model card a training run writes beside its heads: base, data, steps, time, held-out top-1 per depth."""

from __future__ import annotations

from pathlib import Path

from ..data import read_records
from .config import TrainConfig


def model_card(cfg: TrainConfig, log_path: Path, examples: int, heads, processes: int = 1) -> str:
    """A short README for the heads folder: base, data, steps, time, held-out top-1 per depth."""
    rows = read_records(log_path) if log_path.is_file() else []
    steps = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "heldout_top1_by_depth" in r]
    top1 = ", ".join(f"{a:.3f}" for a in evals[-1]["heldout_top1_by_depth"]) if evals else "not evaluated"
    params = sum(p.numel() for p in heads.parameters())
    hours = steps[-1]["elapsed_s"] / 3600 if steps else 0.0
    return "\n".join([
        f"# {cfg.family} heads for {cfg.base_model}", "",
        f"- family: {cfg.family} ({params / 1e6:.2f}M trained parameters), head settings: {cfg.head_args or 'defaults'}",
        f"- base model: {cfg.base_model}, frozen",
        f"- data: {cfg.data}; {examples} training conversations (max {cfg.max_length} tokens), loss on assistant tokens",
        f"- training: {len(steps)} optimizer steps, {cfg.epochs} epochs, batch {cfg.batch_size} x "
        f"{cfg.gradient_accumulation_steps} accumulation x {processes} process{'es' if processes > 1 else ''}, "
        f"loss settings {cfg.loss_args or 'defaults'}, lr {cfg.learning_rate} (warmup {cfg.warmup_steps}, cosine), "
        f"{hours:.2f} h of logged training time (last run segment)",
        f"- held-out top-1 accuracy by draft depth (teacher-forced tokens): {top1}",
        f"- final loss: {steps[-1]['loss']:.4f}" if steps else "- final loss: -",
        "", "Reproduce: `python training/train_heads.py --config train_config.json` (the run's settings are in "
        "train_config.json beside this card).", ""])
