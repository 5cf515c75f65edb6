"""One target forward pass over the committed-but-unprocessed root plus a draft tree."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import lru_cache

import torch

from .errors import SelfspecError
from .tree import DraftTree, additive_mask, tree_attention_mask, tree_position_ids


@lru_cache(maxsize=None)
def cache_kwarg(model_cls: type) -> str:
    # transformers 5.x names the argument `cache`; earlier releases `past_key_values`.
    return "cache" if "cache" in inspect.signature(model_cls.forward).parameters else "past_key_values"


def forward_with_cache(model: torch.nn.Module, input_ids: torch.Tensor, cache, *, position_ids=None,
                       attention_mask=None, hidden_states: bool = False, logits_to_keep: int = 0):
    """``model(...)`` through public arguments, appending to ``cache``; returns the model output."""
    kwargs = {cache_kwarg(type(model)): cache}
    return model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                 use_cache=True, output_hidden_states=hidden_states, logits_to_keep=logits_to_keep, **kwargs)


TREE_ATTENTION = ("eager", "sdpa")  # kernels that apply an arbitrary 4-D mask


def check_tree_attention(model: torch.nn.Module) -> None:
    """Branching trees need an attention kernel that honours a 4-D mask; say so clearly if it does not."""
    impl = getattr(model.config, "_attn_implementation", None) or "sdpa"
    if impl not in TREE_ATTENTION:
        raise SelfspecError(f"tree drafts need attention that applies a 4-D mask ({' or '.join(TREE_ATTENTION)}); "
                            f"this model uses '{impl}': load it with attn_implementation='sdpa'")


@dataclass
class Verification:
    """What the target says about every node of a tree."""

    logits: torch.Tensor  # (N, V): the target's next-token logits after each node
    hidden_states: tuple[torch.Tensor, ...] | None  # (N, H) per asked layer (a pass's ``layers``); None unless asked


@torch.no_grad()
def verify_tree(model: torch.nn.Module, cache, tree: DraftTree, cache_len: int, layers: tuple[int, ...] = ()
                ) -> Verification:
    """Run the target once over ``tree`` (root included), appending every node to ``cache``.

    A chain uses the model's own causal mask; a branching tree gets a 4-D ancestor mask and
    ``position_ids = cache_len + depth`` so siblings share positions.
    """
    device = next(model.parameters()).device
    ids = tree.tokens.to(device)[None]
    if tree.is_chain:
        pos = torch.arange(cache_len, cache_len + tree.size, device=device)[None]
        mask = None
    else:
        check_tree_attention(model)
        pos = tree_position_ids(tree, cache_len, device)
        mask = additive_mask(tree_attention_mask(tree, cache_len, device), next(model.parameters()).dtype)
    out = forward_with_cache(model, ids, cache, position_ids=pos, attention_mask=mask, hidden_states=bool(layers))
    hs = tuple(out.hidden_states[i][0] for i in layers) if layers else None
    return Verification(out.logits[0], hs)
