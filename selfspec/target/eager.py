"""The reference target pass: the model's own modules over a growing ``DynamicCache`` (any model, any shape)."""

from __future__ import annotations

import torch

from ..tree import DraftTree
from ..verify import Verification, forward_with_cache, verify_tree
from .kv_cache import cache_length, keep_entries, new_cache


class EagerPass:
    """The target's forward through public ``transformers`` arguments over a ``DynamicCache``."""

    name = "eager"
    exact = False  # a k-token pass may round a row differently from a one-token step (the reference, not exact)
    buckets = None  # any tree size, unpadded

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.last_shape = (0, 0)

    def pass_shape(self, rows: int, nodes: int) -> tuple[int, int]:
        """A pass runs as many nodes as it is given."""
        return rows, nodes

    def new_cache(self, max_len: int):
        """An empty cache for a request of at most ``max_len`` positions (grows as needed here)."""
        return new_cache(self.model)

    @torch.no_grad()
    def prefill(self, cache, ids: torch.Tensor, layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, ...] | None:
        """Cache ``ids`` (1-D, CPU) from position 0; the states of ``layers``, (n, H) each."""
        x = ids.to(self.device)[None]
        out = forward_with_cache(self.model, x, cache, position_ids=torch.arange(x.shape[1], device=self.device)[None],
                                 hidden_states=bool(layers), logits_to_keep=1)
        return tuple(out.hidden_states[i][0] for i in layers) if layers else None

    def verify(self, cache, tree: DraftTree, cache_len: int, layers: tuple[int, ...] = ()) -> Verification:
        """One pass over root + tree, appending every node to ``cache``."""
        self.last_shape = (1, tree.size)
        return verify_tree(self.model, cache, tree, cache_len, layers)

    def release(self, cache) -> None:
        """The request is done with ``cache`` (a dynamic cache is simply dropped)."""

    def keep(self, cache, start: int, keep: list[int]) -> None:
        """Keep the pass's entries ``keep`` (tree indices, ascending) at ``start..`` and drop the rest."""
        keep_entries(cache, start, keep)

    def length(self, cache) -> int:
        """Positions the cache holds."""
        return int(cache_length(cache))

    def draft_view(self, cache):
        """What drafters that draft inside the target's cache (early exit) may use: this one is a DynamicCache."""
        return cache
