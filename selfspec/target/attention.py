"""Attention for the static-cache pass: grouped-query attention without copying K/V, over the slots in use.

transformers' "sdpa" attention, given a static cache, attends over every slot of it (``max_len``, the
mask hiding the empty ones) and, for a pass of more than one token (every draft tree) or under
``torch.compile``, first copies K and V once per query head (``repeat_kv``: 6x for Qwen2.5-1.5B). This one,
registered with transformers' ``AttentionInterface`` as ``"selfspec_sdpa"``, computes the same attention

    K, V      cut to the mask's width: the static pass gives a mask as wide as the slots the pass can see
              (``cache_len + tree``), so the empty tail of the cache is never read
    1 query   the query heads of each K/V head folded into one (kv_heads, group, head_dim) query
    more      ``scaled_dot_product_attention(enable_gqa=True)``: K/V read once per K/V head

Qwen2.5-Coder-1.5B's shapes, bf16, 2 cores, one layer's attention, a 1024-slot cache with 512 in use:
16 queries 3.7 ms ("sdpa") -> 0.8 ms, 64 queries 7.4 -> 2.4 ms. Same arithmetic as "sdpa" up to the order of a softmax's sums (bf16
logits may differ in the last bit: the bench's divergence check tells such near-ties from bugs).

    with static_attention(model) as cut: ...   the model attends with this inside (if it was "sdpa": cut is True)
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.nn.functional import scaled_dot_product_attention
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .exact import exact_attention

NAME = "selfspec_sdpa"


def grouped_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                 scale: float | None) -> torch.Tensor:
    """Attention of ``query`` (b, heads, q, d) over ``key``/``value`` (b, kv_heads, n, d) under an additive or
    bool ``mask`` (b, 1, q, n); query head i reads K/V head i // (heads // kv_heads). Returns (b, q, heads, d)."""
    b, heads, q, d = query.shape
    group = heads // key.shape[1]
    if group > 1 and q == 1:  # fold each K/V head's query heads into one query block: no K/V copy, one kernel
        out = scaled_dot_product_attention(query.reshape(b, key.shape[1], group, d), key, value, attn_mask=mask,
                                           scale=scale)
        return out.reshape(b, heads, 1, d).transpose(1, 2)
    out = scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale, enable_gqa=group > 1)
    return out.transpose(1, 2)


def selfspec_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                       **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-interface signature; without a 4-D mask (not a static pass), stock "sdpa"; given an
    exact pass's plan (``selfspec_exact``), every row as a plain step computes it (``selfspec/target/exact.py``).
    Under torch's profiler the call is one ``selfspec::attention`` range (the row kernel is no torch operator)."""
    if getattr(torch.autograd.profiler, "_is_profiler_enabled", False):
        with torch.profiler.record_function("selfspec::attention"):
            return _attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    return _attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)


def _attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs) -> tuple[torch.Tensor, None]:
    plan = kwargs.get("selfspec_exact")
    if plan is not None:
        return exact_attention(query, key, value, plan, scaling), None
    if attention_mask is None or attention_mask.dim() != 4 or dropout or kwargs.get("softcap") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    width = attention_mask.shape[-1]
    out = grouped_sdpa(query, key[:, :, :width], value[:, :, :width], attention_mask, scaling)
    return out.contiguous(), None


AttentionInterface.register(NAME, selfspec_attention)


@contextmanager
def static_attention(model):
    """Inside, ``model`` (a model, or the config its attention layers read) attends with ``selfspec_attention`` if
    it was set to transformers' "sdpa" (a user's other choice, e.g. "eager", is left alone); restored after. Yields
    whether it is in place (only then may a mask be narrower than the cache)."""
    config = getattr(model, "config", model)
    before = getattr(config, "_attn_implementation", None)
    if before != "sdpa":
        yield False
        return
    config._attn_implementation = NAME
    try:
        yield True
    finally:
        config._attn_implementation = before
