"""What EAGLE-style heads learn: the pair (f_t, x_{t+1}) predicts f_{t+1}.

Smooth-L1 regression on the feature plus a soft cross-entropy between the draft's and the target's next-token
distributions (over the draft vocabulary), unrolled ``unroll`` steps the way drafting runs (EAGLE-3's
training-time test): step k feeds step k-1's predicted features back in, and each of its rows sees the real
pairs before its root plus its own chain of predicted pairs, exactly the cache a depth-k draft sees. Step k's
loss weighs decay**(k-1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .common import Objective, draft_vocab_counts, final_states, fixed, inner, lm_logits, unroll_mask


@dataclass(frozen=True)
class EagleLoss:
    token_weight: float = 0.1  # the soft cross-entropy's weight beside the feature regression's 1
    unroll: int = 3  # drafting steps unrolled in training (training-time test)
    decay: float = 0.8  # the loss of unrolled step k weighs decay**(k-1)

    def __post_init__(self) -> None:
        if self.unroll < 1:
            raise ValueError(f"unroll must be >= 1, got {self.unroll}")


def eagle_step(head: nn.Module, target: nn.Module, feats: torch.Tensor, next_tokens: torch.Tensor, start: int,
               attention_mask: torch.Tensor | None, cache=None, **head_kwargs) -> torch.Tensor:
    """One pass of the head over pairs (feats[:, j], next_tokens[:, j]) at positions start + j -> predicted features."""
    embeds = target.get_input_embeddings()(next_tokens).to(feats.dtype)
    pos = torch.arange(start, start + feats.shape[1], device=feats.device)[None].expand(feats.shape[0], -1)
    return head(feats, embeds, pos, cache=cache, attention_mask=attention_mask, **head_kwargs)


def eagle_unroll(head: nn.Module, target: nn.Module, f: torch.Tensor, x: torch.Tensor, steps: int,
                 fuse_first: bool = False) -> list[torch.Tensor]:
    """Predicted features of ``steps`` drafting steps; ``out[k-1][:, t]`` guesses f[:, t + k] (x[:, t + k + 1] under the LM head).

    Step 1 reads the real pairs (f_t, x_{t+1}); step k reads (step k-1's output, x_{t+k}) at position
    t + k - 1 through one KV cache holding all earlier steps. ``fuse_first``: ``f`` holds the target states the
    head fuses itself (EAGLE-3), so step 1 asks it to (``fuse=True``).
    """
    n = f.shape[1] - 1
    tokens = F.pad(x, (0, steps))  # x[:, t + k] for every row t; rows past the end are masked from the loss
    cache, feats, out = inner(head).new_cache(), f[:, :-1], []
    for k in range(1, steps + 1):
        mask = None if k == 1 else unroll_mask(n, k, feats.dtype, f.device).expand(f.shape[0], -1, -1, -1)
        fuse = {"fuse": True} if fuse_first and k == 1 else {}
        feats = eagle_step(head, target, feats, tokens[:, k:k + n], k - 1, mask, cache, **fuse)
        out.append(feats)
    return out


def loss(head: nn.Module, target: nn.Module, batch: dict[str, torch.Tensor], args: EagleLoss
         ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Feature regression + soft cross-entropy to the target's next-token distribution, over ``args.unroll``
    unrolled steps; sums over the loss positions (each position's regression averaged over the features).

    A step whose positions lie past a short batch's end still enters the loss (an empty sum): every parameter
    takes part in every step, as data-parallel training needs."""
    x, m, f = batch["input_ids"], batch["loss_mask"].bool(), batch["f"]
    rows = inner(head).d2t
    with torch.no_grad():  # the target's distribution at every loss position, once for all steps
        teacher = F.softmax(lm_logits(target, f[m].float(), rows).float(), -1)
    position = torch.arange(f.shape[1], device=f.device).expand_as(m)[m]  # of each teacher row
    total, parts = f.new_zeros(()), {}
    for k, pred in enumerate(eagle_unroll(head, target, f, x, args.unroll), start=1):
        n = max(pred.shape[1] - (k - 1), 0)  # rows t with t + k inside the sequence
        keep = m[:, k:k + n]  # step k's row t guesses position t + k: the loss positions >= k, in order
        truth = f[:, k:k + n][keep].float()
        guess = pred[:, :n][keep].float()
        reg = F.smooth_l1_loss(guess, truth, reduction="none").mean(-1).sum()
        draft_logp = F.log_softmax(lm_logits(target, guess, rows).float(), -1)  # fp32 softmax under autocast too
        soft_ce = -(teacher[position >= k] * draft_logp).sum()
        total = total + args.decay ** (k - 1) * (reg + args.token_weight * soft_ce)
        parts[f"reg{k}"], parts[f"soft_ce{k}"] = reg.detach(), soft_ce.detach()
    return total, parts


@torch.no_grad()
def predictions(heads: nn.Module, target: nn.Module, batch: dict[str, torch.Tensor], depth: int
                ) -> list[torch.Tensor]:
    """Greedy target ids of ``depth`` unrolled steps: ``out[d-1][:, t]`` guesses the token at t + d + 1."""
    d2t = inner(heads).d2t
    return [d2t[lm_logits(target, pred, d2t).argmax(-1)]
            for pred in eagle_unroll(heads, target, batch["f"], batch["input_ids"], depth)]


def prepare(heads: nn.Module, target: nn.Module, examples: list[dict[str, torch.Tensor]]) -> None:
    """A reduced draft vocabulary: the most frequent assistant tokens of the training data."""
    vocab = target.get_output_embeddings().out_features
    if heads.d2t.numel() < vocab:
        heads.set_draft_vocab(draft_vocab_counts(examples, vocab))


OBJECTIVE = Objective(features=final_states, cached=fixed("f"), loss=loss, predictions=predictions, args=EagleLoss,
                      prepare=prepare)
