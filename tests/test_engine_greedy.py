"""The core invariant: greedy speculative output == the target's own greedy output, token for token."""

from __future__ import annotations

import pytest
import torch

from conftest import OracleTreeDrafter, hf_greedy, tiny_model
from selfspec.drafters.draft_model import DraftModelDrafter
from selfspec.drafters.prompt_lookup import PromptLookupDrafter
from selfspec.engine import DecodeConfig, SpeculativeEngine
from selfspec.errors import SelfspecError


def _prompt(seed: int, n: int, vocab: int = 64) -> list[int]:
    g = torch.Generator().manual_seed(1000 + seed)
    base = torch.randint(0, vocab, (max(n // 2, 1),), generator=g).tolist()
    return (base * 3)[:n]  # repetitive, so prompt lookup finds matches


@pytest.mark.parametrize("seed", range(6))
def test_plain_engine_matches_hf(seed: int) -> None:
    model = tiny_model(seed)
    prompt = _prompt(seed, 12)
    expected = hf_greedy(model, prompt, 40)
    got = SpeculativeEngine(model).generate(prompt, DecodeConfig(max_new_tokens=40))
    assert got.tokens == expected
    assert got.stats.mean_accepted == 1.0
    assert got.stats.target_forwards == 40


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tree_drafts_are_lossless(seed: int, arch: str) -> None:
    model = tiny_model(seed, arch=arch)
    prompt = _prompt(seed, 9)
    expected = hf_greedy(model, prompt, 48)
    drafter = OracleTreeDrafter(prompt + expected, vocab=64, seed=seed)
    cfg = DecodeConfig(max_new_tokens=48, max_depth=5, max_nodes=12, adaptive=False)
    got = SpeculativeEngine(model, drafter).generate(prompt, cfg)
    assert got.tokens == expected
    assert got.stats.mean_accepted > 1.5  # the oracle is mostly right: speculation really happened


@pytest.mark.parametrize("seed", range(4))
def test_chain_from_draft_model_is_lossless(seed: int) -> None:
    target, draft = tiny_model(seed, layers=3), tiny_model(seed + 100, layers=1)
    prompt = _prompt(seed, 10)
    expected = hf_greedy(target, prompt, 40)
    got = SpeculativeEngine(target, DraftModelDrafter(draft)).generate(
        prompt, DecodeConfig(max_new_tokens=40, max_depth=4, adaptive=False))
    assert got.tokens == expected


def test_draft_model_that_is_the_target_accepts_everything() -> None:
    target = tiny_model(3)
    prompt = _prompt(3, 10)
    got = SpeculativeEngine(target, DraftModelDrafter(target, confidence_stop=0.0)).generate(
        prompt, DecodeConfig(max_new_tokens=30, max_depth=4, adaptive=False))
    assert got.tokens == hf_greedy(target, prompt, 30)
    assert got.stats.acceptance_by_depth == [1.0] * 4
    assert got.stats.mean_accepted == pytest.approx(30 / 6)  # 5 tokens per pass; the last pass is cut to fit


@pytest.mark.parametrize("seed", range(4))
def test_prompt_lookup_is_lossless(seed: int) -> None:
    model = tiny_model(seed)
    prompt = _prompt(seed, 20)
    expected = hf_greedy(model, prompt, 40)
    got = SpeculativeEngine(model, PromptLookupDrafter()).generate(prompt, DecodeConfig(max_new_tokens=40))
    assert got.tokens == expected


@pytest.mark.parametrize("position", [0, 3, 7])
def test_eos_inside_an_accepted_draft_stops_there(position: int) -> None:
    model = tiny_model(5)
    prompt = _prompt(5, 8)
    free = hf_greedy(model, prompt, 30)
    eos = free[position]
    model.generation_config.eos_token_id = eos
    expected = hf_greedy(model, prompt, 30, eos=eos)
    assert expected[-1] == eos and len(expected) == free.index(eos) + 1
    drafter = OracleTreeDrafter(prompt + free, vocab=64, seed=1, corrupt=0.0)
    got = SpeculativeEngine(model, drafter).generate(prompt, DecodeConfig(max_new_tokens=30, max_depth=6,
                                                                          adaptive=False))
    assert got.tokens == expected


@pytest.mark.parametrize("max_new", [1, 2, 5, 7])
def test_max_new_tokens_edge(max_new: int) -> None:
    model = tiny_model(2)
    prompt = _prompt(2, 8)
    expected = hf_greedy(model, prompt, max_new)
    drafter = OracleTreeDrafter(prompt + hf_greedy(model, prompt, 20), vocab=64, seed=2, corrupt=0.0)
    got = SpeculativeEngine(model, drafter).generate(prompt, DecodeConfig(max_new_tokens=max_new, max_depth=4,
                                                                          adaptive=False))
    assert got.tokens == expected
    assert got.stats.new_tokens == max_new


def test_one_token_prompt() -> None:
    model = tiny_model(4)
    expected = hf_greedy(model, [7], 20)
    for drafter in (None, PromptLookupDrafter(), DraftModelDrafter(tiny_model(9, layers=1)),
                    OracleTreeDrafter([7] + expected, 64, seed=0)):
        got = SpeculativeEngine(model, drafter).generate([7], DecodeConfig(max_new_tokens=20, adaptive=False))
        assert got.tokens == expected, drafter


def test_adaptive_engine_with_useless_drafts_is_lossless() -> None:
    model = tiny_model(6)
    prompt = _prompt(6, 10)
    useless = OracleTreeDrafter([0] * 200, vocab=64, seed=0, width=1, corrupt=1.0)  # always random
    got = SpeculativeEngine(model, useless).generate(prompt, DecodeConfig(max_new_tokens=60))
    assert got.tokens == hf_greedy(model, prompt, 60)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_tree_drafts_are_lossless_for_each_attention_kernel(attn: str) -> None:
    model = tiny_model(7)
    model.config._attn_implementation = attn  # eager adds the 4-D mask to the scores: it must be additive
    prompt = _prompt(7, 9)
    expected = hf_greedy(model, prompt, 32)
    drafter = OracleTreeDrafter(prompt + expected, vocab=64, seed=7, width=4, corrupt=0.5)
    got = SpeculativeEngine(model, drafter).generate(prompt, DecodeConfig(max_new_tokens=32, max_depth=4,
                                                                          max_nodes=14, adaptive=False))
    assert got.tokens == expected


def test_max_depth_zero_is_plain_decoding() -> None:
    model = tiny_model(1)
    prompt = _prompt(1, 6)
    got = SpeculativeEngine(model, PromptLookupDrafter()).generate(prompt, DecodeConfig(max_new_tokens=10, max_depth=0))
    assert got.tokens == hf_greedy(model, prompt, 10) and got.stats.speculative_steps == 0


def test_bad_requests_are_one_line_errors() -> None:
    from selfspec.errors import SelfspecError

    with pytest.raises(SelfspecError, match="stop strings"):
        DecodeConfig(stop_strings=("",))
    with pytest.raises(SelfspecError, match="token ids must lie"):
        SpeculativeEngine(tiny_model(0)).generate([5, 999])


def test_confidence_stop_shortens_drafts_and_stays_lossless() -> None:
    target, draft = tiny_model(8, layers=3), tiny_model(108, layers=1)
    prompt = _prompt(8, 10)
    cfg = DecodeConfig(max_new_tokens=40, max_depth=6, adaptive=False)
    full = SpeculativeEngine(target, DraftModelDrafter(draft, confidence_stop=0.0)).generate(prompt, cfg)
    short = SpeculativeEngine(target, DraftModelDrafter(draft, confidence_stop=0.9)).generate(prompt, cfg)
    assert full.tokens == short.tokens == hf_greedy(target, prompt, 40)
    assert sum(short.stats.drafted_at_depth) < sum(full.stats.drafted_at_depth)


@pytest.mark.parametrize("seed", range(3))
def test_draft_model_with_reduced_vocabulary_is_lossless(seed: int) -> None:
    """FR-Spec-style draft vocabulary: tokens outside it are never drafted, the output stays the target's."""
    target, draft = tiny_model(seed, layers=3), tiny_model(seed + 100, layers=1)
    prompt = _prompt(seed, 10)
    rows = torch.arange(0, 64, 2)  # half the vocabulary
    drafter = DraftModelDrafter(draft, draft_vocab=rows, confidence_stop=0.0)
    got = SpeculativeEngine(target, drafter).generate(prompt, DecodeConfig(max_new_tokens=40, max_depth=4,
                                                                          adaptive=False))
    assert got.tokens == hf_greedy(target, prompt, 40)
    assert drafter.extra_parameters() == sum(p.numel() for p in draft.parameters()) + 32 * 32


def test_reduced_vocabulary_drafts_the_subset_argmax() -> None:
    """Pruned logits equal the full model's logits on the kept rows, -inf elsewhere."""
    from selfspec.target.kv_cache import new_cache

    draft = tiny_model(5, layers=1)
    rows = torch.tensor([3, 7, 11, 60])
    d = DraftModelDrafter(draft, draft_vocab=rows)
    state = type("S", (), {"cache": new_cache(draft)})()
    ids = torch.tensor([[1, 2, 3]])
    got = d._step(state)(ids, 0)
    full = draft(ids).logits[0, -1]
    torch.testing.assert_close(got[rows], full[rows], atol=1e-5, rtol=1e-5)
    assert torch.isinf(got).sum() == 64 - 4


def test_reduced_vocabulary_rejects_bad_ids() -> None:
    with pytest.raises(SelfspecError, match="draft_vocab"):
        DraftModelDrafter(tiny_model(5, layers=1), draft_vocab=torch.tensor([0, 64]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_tokens_break_ties_as_argmax(dtype: torch.dtype) -> None:
    """The engine's greedy pick equals ``argmax`` (hf's), equal maxima included: bf16 logits tie often."""
    from selfspec.sampling import greedy_tokens
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(64, 16, 4096, generator=g) * 2).round().to(dtype)  # rounded: many equal maxima
    top = logits.max(-1, keepdim=True).values
    assert ((logits == top).sum(-1) > 1).float().mean() > 0.1  # the ties are really there
    assert torch.equal(greedy_tokens(logits), logits.argmax(-1))
