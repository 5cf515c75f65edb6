"""Training objectives: dispatch to the objective each head family registered, and held-out accuracy by depth.

Notation for one batch: tokens x (B, T), loss mask m (B, T) (1 on assistant tokens), the target's
final normed hidden states f (B, T, H); f_t under the target's LM head predicts x_{t+1}.

A family's objective is one module of ``selfspec/objectives/`` (``medusa.py``, ``eagle.py``, ``eagle3.py``, ``early_exit.py``)
exporting ``OBJECTIVE``, a :class:`~selfspec.objectives.common.Objective` (its contract is documented there), which
``selfspec.heads.register_family`` checks when the family registers. The family comes from the heads themselves
(their config), as peft derives its method from ``config.peft_type``.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import torch
from torch import nn

from ..errors import SelfspecError
from ..heads import FAMILIES
from ..objectives.common import Objective, inner, lm_logits


def objective(heads: nn.Module | str) -> Objective:
    """The training objective of these heads' family (or of a family named)."""
    family = heads if isinstance(heads, str) else inner(heads).config.family
    return FAMILIES[family].objective


def loss_settings(family: str, values: dict[str, Any]) -> Any:
    """The family's loss settings (its ``Objective.args`` dataclass) from ``--loss-arg`` values; a misspelt or
    invalid one is a one-line error naming what the family knows."""
    args = objective(family).args
    known = [f.name for f in fields(args)]
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise SelfspecError(f"unknown {family} loss settings {unknown}; known: {known or 'none'}")
    try:
        return args(**values)
    except (TypeError, ValueError) as exc:
        raise SelfspecError(f"{family} loss settings {values}: {exc}") from exc


def feature_keys(heads: nn.Module) -> tuple[str, ...]:
    """The target states these heads train on (what the feature cache stores)."""
    return tuple(objective(heads).cached(inner(heads).config))


def feature_settings(heads: nn.Module) -> dict:
    """The head config fields the cached target states depend on (exit layer, fused layers)."""
    config = inner(heads).config
    return {name: getattr(config, name) for name in objective(heads).settings}


@torch.no_grad()
def target_features(target: nn.Module, heads: nn.Module, input_ids: torch.Tensor,
                    attention_mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The frozen target's states these heads train on, for a (B, T) batch."""
    return objective(heads).features(target, heads, input_ids, attention_mask)


def head_loss(heads: nn.Module, target: nn.Module, batch: dict[str, torch.Tensor], args: Any
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The family's loss on a batch: (sum over its loss tokens, {part: detached sum}), ``args`` its loss settings."""
    return objective(heads).loss(heads, target, batch, args)


def prepare_heads(heads: nn.Module, target: nn.Module, examples: list[dict[str, torch.Tensor]]) -> None:
    """What a family sets from the training data before a fresh run (e.g. its draft vocabulary)."""
    prepare = objective(heads).prepare
    if prepare is not None:
        prepare(heads, target, examples)


@torch.no_grad()
def depth_hits(heads: nn.Module, target: nn.Module, batch: dict[str, torch.Tensor],
               max_depth: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per draft depth d, boolean (B, n_d) over roots j: (the depth-d guess from root j equals the *target's*
    greedy token there, that token is an assistant token).

    The target's greedy token after each true prefix (argmax of its LM head on ``f``) is what greedy
    verification accepts, so this is teacher-forced acceptance; on self-distilled data it is also the
    data's token. Depth d means: the token d places after the root (the family's ``predictions``: Medusa
    head d-1; EAGLE unrolled d times on its own outputs with teacher-forced tokens, the cache a depth-d draft
    sees; early exit depth 1 only). Column j is the same root at every depth.
    """
    x, m = batch["input_ids"], batch["loss_mask"].bool()
    T, hits = x.shape[1], []
    greedy = torch.cat([x[:, :1], lm_logits(target, batch["f"][:, :-1]).argmax(-1)], dim=1)  # greedy[:, j] follows x[:, :j]
    for d, predicted in enumerate(objective(heads).predictions(heads, target, batch, max_depth), start=1):
        first = d + 1  # predicted[:, j] guesses greedy[:, first + j]
        n = min(predicted.shape[1], T - first)
        if n <= 0:
            break
        hits.append((predicted[:, :n] == greedy[:, first:first + n], m[:, first:first + n]))
    return hits


def depth_accuracy(heads: nn.Module, target: nn.Module, batch: dict[str, torch.Tensor],
                   max_depth: int = 4) -> tuple[list[int], list[int]]:
    """(correct, total) top-1 counts per draft depth on assistant positions (see :func:`depth_hits`), ``max_depth`` long."""
    correct, total = depth_counts(depth_hits(heads, target, batch, max_depth))
    pad = [0] * (max_depth - len(correct))
    return correct + pad, total + pad


def depth_counts(hits: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[list[int], list[int]]:
    """(correct, total) per depth of :func:`depth_hits`: right guesses among the assistant positions."""
    return [int((hit & keep).sum()) for hit, keep in hits], [int(keep.sum()) for _, keep in hits]


def chain_accuracy(hits: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[list[int], list[int]]:
    """(correct, total) per depth d of whole chains: of the roots whose first drafted token is an assistant token,
    how many have depths 1..d all right, i.e. how often greedy verification accepts a drafted chain's d-th
    token (teacher-forced: every depth fed the true tokens, which an accepted chain's are)."""
    correct, total, run = [], [], None
    for hit, keep in hits:
        n = hit.shape[1]
        run = hit & keep if run is None else run[:, :n] & hit & keep  # depth 1's keep: the roots counted
        correct.append(int(run.sum()))
        total.append(int(hits[0][1][:, :n].sum()))
    return correct, total
