"""What every family's training objective shares: the frozen target's LM head and final states, the unrolled
drafting mask, draft-vocabulary counts. The objectives themselves are one module per family (``medusa.py``,
``eagle.py``, ``eagle3.py``, ``early_exit.py``); ``losses.py`` dispatches to them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..heads.common import lm_head_rows
from ..tree import additive_mask


def inner(module: nn.Module) -> nn.Module:
    """The module itself, under a DDP/FSDP wrapper if there is one (for reading attributes)."""
    return getattr(module, "module", module)


@torch.no_grad()
def final_states(target: nn.Module, heads: nn.Module, input_ids: torch.Tensor,
                 attention_mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """``f``: the target's final normed states, (B, T, H)."""
    # the decoder alone: its last state is hidden_states[-1] of the full model, and skipping the LM head
    # matters on CPU, where a (1, 1, H) row through a large vocabulary is slow under bf16 autocast
    return {"f": target.get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state}


def lm_logits(target: nn.Module, h: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The target's frozen LM head (its ``rows`` only, if given) on states ``h``."""
    weight, bias = lm_head_rows(target, rows)
    return F.linear(h, weight.to(h.dtype), None if bias is None else bias.to(h.dtype))


def unroll_mask(n: int, step: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Step ``step``'s (1, 1, n, step * n) additive mask: row t sees real pairs 0..t and its own chain (row t of each step)."""
    causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    eye = torch.eye(n, dtype=torch.bool, device=device)
    return additive_mask(torch.cat([causal] + [eye] * (step - 1), dim=1)[None, None], dtype)


def draft_vocab_counts(examples: list[dict[str, torch.Tensor]], vocab: int) -> torch.Tensor:
    """How often each target token id is an assistant token in ``examples`` (to choose a draft vocabulary)."""
    counts = torch.zeros(vocab)
    for ex in examples:
        counts.index_add_(0, ex["input_ids"][ex["loss_mask"].bool()], torch.ones(int(ex["loss_mask"].sum())))
    return counts
