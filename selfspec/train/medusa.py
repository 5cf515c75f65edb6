"""What Medusa-style heads learn: head i (0-based) on the target's final state f_t predicts x_{t+2+i}.

Cross-entropy on assistant tokens through the target's frozen LM head, head i weighted ``medusa_decay**i``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .objective import final_states, lm_logits

FEATURES = ("f",)
features = final_states


def loss(heads: nn.Module, target: nn.Module, batch: dict[str, torch.Tensor], cfg
         ) -> tuple[torch.Tensor, dict[str, float]]:
    """Weighted cross-entropy of every head on the positions whose target token is an assistant token."""
    x, m, f = batch["input_ids"], batch["loss_mask"].bool(), batch["f"]
    states = heads(f)  # (K, B, T, H)
    total, logs = f.new_zeros(()), {}
    for i in range(states.shape[0]):
        shift = i + 2
        if x.shape[1] <= shift:
            break
        keep = m[:, shift:]
        if not keep.any():
            continue
        logits = lm_logits(target, states[i][:, :-shift][keep])  # (n, V)
        ce = F.cross_entropy(logits.float(), x[:, shift:][keep])
        total = total + cfg.medusa_decay**i * ce
        logs[f"ce{i + 1}"] = ce.item()
    return total, logs


@torch.no_grad()
def predictions(heads: nn.Module, target: nn.Module, batch: dict[str, torch.Tensor], depth: int
                ) -> list[torch.Tensor]:
    """Head d-1's greedy tokens: ``out[d-1][:, t]`` guesses the token at t + d + 1."""
    states = heads(batch["f"])
    return [lm_logits(target, states[i]).argmax(-1) for i in range(min(states.shape[0], depth))]
