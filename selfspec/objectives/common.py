"""What every family's training objective shares: the :class:`Objective` contract, the frozen target's LM head and
final states, the unrolled drafting mask, draft-vocabulary counts. The objectives themselves are one module per
family (``medusa.py``, ``eagle.py``, ``eagle3.py``, ``early_exit.py``), each exporting ``OBJECTIVE``, which the
family's registration (``selfspec.heads.register_family``) checks; ``objectives.py`` dispatches to them.

Losses are *sums* over the batch's loss tokens, never means: the loop divides once by the number of loss tokens
of the whole optimizer step (every micro-batch, every process), so a token weighs the same whatever micro-batch
or rank it lands on, and N processes of batch b step as one process of batch N x b.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..frozen import lm_head_rows
from ..tree import additive_mask


@dataclass(frozen=True)
class Objective:
    """How a head family trains. Every part but ``settings`` and ``prepare`` is required (checked when registered).

    features(target, heads, input_ids, attention_mask) -> {key: (B, T, .)}: the frozen target's states it trains on
    cached(head_config) -> the keys of ``features`` the feature cache stores for that config
    loss(heads, target, batch, args) -> (sum over the batch's loss tokens, {part: its detached sum})
    predictions(heads, target, batch, depth) -> [(B, n) target ids guessed d + 1 places after position t]
    args: the dataclass of its loss settings (``--loss-arg KEY=VALUE``), each field with a one-line comment
    settings: head config fields the states depend on (part of the feature cache's signature)
    prepare(heads, target, examples): what a fresh run sets from the data first (e.g. a draft vocabulary)
    """

    features: Callable
    cached: Callable
    loss: Callable
    predictions: Callable
    args: type
    settings: tuple[str, ...] = ()
    prepare: Callable | None = None

    def missing(self) -> list[str]:
        """The required parts that are absent or of the wrong kind."""
        parts = [n for n in ("features", "cached", "loss", "predictions") if not callable(getattr(self, n))]
        return parts + ([] if dataclasses.is_dataclass(self.args) and isinstance(self.args, type) else ["args"])


def fixed(*keys: str) -> Callable:
    """``Objective.cached`` for a family that caches the same states whatever its config."""
    return lambda config: keys


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
    """Step ``step``'s (1, 1, n, step * n) additive mask: row t sees real pairs 0..t and its own chain (row t of
    each step)."""
    causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    eye = torch.eye(n, dtype=torch.bool, device=device)
    return additive_mask(torch.cat([causal] + [eye] * (step - 1), dim=1)[None, None], dtype)


def draft_vocab_counts(examples: list[dict[str, torch.Tensor]], vocab: int) -> torch.Tensor:
    """How often each target token id is an assistant token in ``examples`` (to choose a draft vocabulary)."""
    counts = torch.zeros(vocab)
    for ex in examples:
        counts.index_add_(0, ex["input_ids"][ex["loss_mask"].bool()], torch.ones(int(ex["loss_mask"].sum())))
    return counts


def settings_at(args: Any, step: int) -> Any:
    """A family's loss settings in effect at optimizer step ``step``: its ``at(step)`` where it has a schedule (e.g.
    eagle3's unroll curriculum), else the settings as given."""
    at = getattr(args, "at", None)
    return args if at is None else at(step)
