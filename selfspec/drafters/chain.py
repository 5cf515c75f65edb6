"""Drafting a chain autoregressively with any cached model: the loop shared by the separate draft
model and early exit. Each drafter supplies ``step(ids, pos) -> logits``, which feeds ``ids``
(1, n) at positions ``pos ..`` into its cache and returns the next-token logits (V,)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..sampling import logits_to_probs
from .base import DraftRequest


@dataclass
class DraftedChain:
    """Drafted tokens, the distributions they were sampled from (None when greedy), and whether the
    last token was fed to the cache (the loop stopped early) or not."""

    tokens: list[int]
    draft_probs: torch.Tensor | None
    fed_last: bool


def vocab_probs(logits: torch.Tensor, req: DraftRequest, vocab: int) -> torch.Tensor:
    """The sampling distribution over the target's ``vocab`` ids (cut or zero-padded)."""
    probs = logits_to_probs(logits[:vocab], req.sampling)
    return torch.nn.functional.pad(probs, (0, vocab - probs.numel())) if probs.numel() < vocab else probs


def draft_chain(step: Callable[[torch.Tensor, int], torch.Tensor], feed: torch.Tensor, start: int, depth: int,
                req: DraftRequest, vocab: int, confidence_stop: float = 0.0) -> DraftedChain:
    """Draft up to ``depth`` tokens after feeding ``feed`` (1, n) at ``start``.

    Greedy tokens stay on the device until the end (no host sync per token, unless
    ``confidence_stop`` > 0 ends the chain at a token the drafter gives less than that probability:
    a rule on the draft alone, so acceptance stays exact).
    """
    drafted: list[torch.Tensor] = []
    q_rows: list[torch.Tensor] = []
    ids, pos, fed_last = feed, start, False
    for _ in range(depth):
        logits = step(ids, pos)
        pos += ids.shape[1]
        if drafted and confidence_stop > 0 and float(logits[:vocab].float().softmax(-1).max()) < confidence_stop:
            fed_last = True
            break
        if req.sampling.greedy:
            tok = logits[:vocab].argmax()[None]
        else:
            probs = vocab_probs(logits, req, vocab).cpu()
            tok = torch.multinomial(probs, 1, generator=req.generator).to(logits.device)
            q_rows.append(probs)
        drafted.append(tok)
        ids = tok[None]
    tokens = torch.cat(drafted).tolist() if drafted else []
    # row i: the distribution node i's child was sampled from; the last node has no child
    q = torch.stack(q_rows + [torch.zeros_like(q_rows[0])]) if q_rows else None
    return DraftedChain(tokens, q, fed_last)
