"""What Medusa-style heads learn: head i (0-based) on the target's final state f_t predicts x_{t+2+i}.

Cross-entropy on assistant tokens through the target's frozen LM head, head i weighted ``decay**i``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .common import Objective, final_states, fixed, lm_logits


@dataclass(frozen=True)
class MedusaLoss:
    decay: float = 0.8  # the loss of head i (0-based) weighs decay**i


def loss(heads: nn.Module, target: nn.Module, batch: dict[str, torch.Tensor], args: MedusaLoss
         ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Weighted cross-entropy of every head on the positions whose target token is an assistant token (sums).

    A head whose targets lie past a short batch's end still enters the loss (an empty sum): every parameter
    takes part in every step, as data-parallel training needs."""
    x, m, f = batch["input_ids"], batch["loss_mask"].bool(), batch["f"]
    states = heads(f)  # (K, B, T, H)
    T, total, parts = x.shape[1], f.new_zeros(()), {}
    for i in range(states.shape[0]):
        shift = i + 2
        keep = m[:, shift:]
        logits = lm_logits(target, states[i][:, :max(T - shift, 0)][keep])  # (n, V)
        ce = F.cross_entropy(logits.float(), x[:, shift:][keep], reduction="sum")
        total = total + args.decay**i * ce
        parts[f"ce{i + 1}"] = ce.detach()
    return total, parts


@torch.no_grad()
def predictions(heads: nn.Module, target: nn.Module, batch: dict[str, torch.Tensor], depth: int
                ) -> list[torch.Tensor]:
    """Head d-1's greedy tokens: ``out[d-1][:, t]`` guesses the token at t + d + 1."""
    states = heads(batch["f"])
    return [lm_logits(target, states[i]).argmax(-1) for i in range(min(states.shape[0], depth))]


OBJECTIVE = Objective(features=final_states, cached=fixed("f"), loss=loss, predictions=predictions, args=MedusaLoss)
