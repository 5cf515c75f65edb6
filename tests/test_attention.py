"""The static pass's attention: transformers' "sdpa" arithmetic without the K/V copy, over the slots in use."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from conftest import hf_greedy, tiny_model
from selfspec.target.attention import NAME, grouped_sdpa, selfspec_attention, static_attention
from selfspec.engine import DecodeConfig, SpeculativeEngine
from selfspec.target.common import ancestor_block, static_mask


class _Heads(torch.nn.Module):
    """What transformers' sdpa reads from an attention module."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


@pytest.mark.parametrize("queries", [1, 3, 8])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (6, 1), (4, 4)])
def test_grouped_attention_equals_stock_sdpa(queries: int, heads: int, kv_heads: int) -> None:
    torch.manual_seed(queries * 10 + heads)
    slots, used, d = 32, 20, 8
    q = torch.randn(1, heads, queries, d)
    k, v = torch.randn(1, kv_heads, slots, d), torch.randn(1, kv_heads, slots, d)
    k[:, :, used:] = float("nan")  # slots past the mask's width are never read
    v[:, :, used:] = float("nan")
    parents = [-1] + [max(i - 2, 0) for i in range(1, queries)]
    cache_len = used - queries
    narrow = static_mask(ancestor_block(parents, queries), cache_len, used, torch.float32, torch.device("cpu"))
    wide = static_mask(ancestor_block(parents, queries), cache_len, slots, torch.float32, torch.device("cpu"))
    ref, _ = sdpa_attention_forward(_Heads(heads // kv_heads), q, k[:, :, :used], v[:, :, :used], wide[..., :used],
                                    scaling=0.3)
    got, _ = selfspec_attention(_Heads(heads // kv_heads), q, k, v, narrow, scaling=0.3)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    assert grouped_sdpa(q, k[:, :, :used], v[:, :, :used], narrow, 0.3).shape == (1, queries, heads, d)


def test_static_attention_swaps_only_sdpa_and_restores() -> None:
    model = tiny_model(3)
    assert model.config._attn_implementation == "sdpa"
    with static_attention(model) as cut:
        assert cut and model.config._attn_implementation == NAME
    assert model.config._attn_implementation == "sdpa"
    model.config._attn_implementation = "eager"
    with static_attention(model) as cut:
        assert not cut and model.config._attn_implementation == "eager"
    assert model.config._attn_implementation == "eager"


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_static_pass_is_lossless_with_either_attention(attn: str) -> None:
    """A user's "eager" attention is kept (full-width masks); "sdpa" becomes the cut, grouped one."""
    model = tiny_model(4)
    model.config._attn_implementation = attn
    prompt = [5, 9, 2, 7, 5, 9, 2, 7, 1]
    expected = hf_greedy(model, prompt, 24)
    got = SpeculativeEngine(model, None, backend="static").generate(prompt, DecodeConfig(max_new_tokens=24))
    assert got.tokens == expected
    assert model.config._attn_implementation == attn
