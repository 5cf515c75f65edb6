"""KV-cache bookkeeping through public ``transformers`` Cache APIs: new cache, length, rollback, compaction.

After a tree pass the cache holds every tree node. Only the root and the accepted path may stay,
contiguous and in order, so the next pass sees exactly the committed tokens. A chain whose accepted
path is a prefix needs only ``crop``; a tree path is first gathered into place (``index_select`` on
the sequence dimension of each layer's keys and values), then cropped.

``RowCache``: a preallocated cache of several rows, each written at its own slots (the batch engine's target
cache, and the padded copy of many requests' head caches that a batched draft runs over).
"""

from __future__ import annotations

import torch
from transformers import Cache, DynamicCache
from transformers.cache_utils import StaticLayer

from ..errors import SelfspecError
from ..memory import attention_layout


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


class RowCache(Cache):
    """A static cache whose rows are written at per-row slots: before each forward the pass sets ``rows`` (the
    batch entries of the forward, a slice of the cache's rows) and ``write`` ((entries, tokens) slot per token)."""

    def __init__(self, config, rows: int, slots: int, dtype: torch.dtype, device: torch.device) -> None:
        n_layers, _, kv, dim = attention_layout(config)
        layers = [StaticLayer(slots) for _ in range(n_layers)]
        probe = torch.zeros(rows, kv, 1, dim, dtype=dtype, device=device)
        for layer in layers:
            layer.lazy_initialization(probe, probe)  # (rows, kv, slots, dim) each, zeros
        super().__init__(layers=layers)
        self.rows, self.write = slice(0, rows), None
        self.entries = torch.arange(rows, device=device)[:, None]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.layers[layer_idx]
        keys, values = layer.keys[self.rows], layer.values[self.rows]  # views: written in place
        entry = self.entries[:keys.shape[0]]
        keys[entry, :, self.write] = key_states.transpose(1, 2)  # (entries, tokens, kv_heads, dim) at their slots
        values[entry, :, self.write] = value_states.transpose(1, 2)  # (index_put: 10-40x faster than scatter_ here)
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are always given; lengths are per row, kept by the caller
