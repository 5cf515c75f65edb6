"""KV-cache bookkeeping through public ``transformers`` Cache APIs: new cache, length, rollback, compaction.

After a tree pass the cache holds every tree node. Only the root and the accepted path may stay,
contiguous and in order, so the next pass sees exactly the committed tokens. A chain whose accepted
path is a prefix needs only ``crop``; a tree path is first gathered into place (``index_select`` on
the sequence dimension of each layer's keys and values), then cropped.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from .errors import SelfspecError


def new_cache(model: torch.nn.Module) -> DynamicCache:
    """An empty dynamic cache shaped for ``model``; rejects caches selfspec cannot roll back."""
    cache = DynamicCache(config=model.config)
    for layer in getattr(cache, "layers", []):
        if not getattr(layer, "is_croppable", True) or getattr(layer, "is_sliding", False):
            raise SelfspecError(
                f"{type(model).__name__} uses a {type(layer).__name__} cache layer (sliding window or recurrent state), "
                "which cannot be rolled back after a rejected draft; selfspec supports full-attention caches"
            )
    return cache


def cache_length(cache: DynamicCache) -> int:
    """Number of positions held."""
    return cache.get_seq_length()


def truncate(cache: DynamicCache, length: int) -> None:
    """Drop every entry at position >= ``length``."""
    extra = cache_length(cache) - length
    if extra > 0:
        cache.crop(-extra)  # transformers >= 5: a negative count removes that many trailing tokens


def keep_entries(cache: DynamicCache, start: int, keep: list[int]) -> None:
    """Keep positions ``start + keep[j]`` (ascending) at ``start + j`` and drop everything after.

    ``keep`` indexes the entries written by the last pass (tree order, root = 0).
    """
    if keep == list(range(len(keep))):  # already in place: a chain prefix
        truncate(cache, start + len(keep))
        return
    n = len(keep)
    idx = torch.tensor(keep) + start
    for layer in cache.layers:
        if idx.device != layer.keys.device:
            idx = idx.to(layer.keys.device)
        layer.keys[..., start:start + n, :] = layer.keys.index_select(-2, idx)
        layer.values[..., start:start + n, :] = layer.values.index_select(-2, idx)
    truncate(cache, start + len(keep))
