"""Lookup-first drafting: prompt lookup where the context repeats, the wrapped drafter elsewhere; lossless
whichever answers, and the wrapped drafter's state survives the steps it sat out."""

from __future__ import annotations

import pytest
import torch

import test_engine_sampling as sampling_test
from conftest import hf_greedy, tiny_model
from test_heads import HYPER, perturb, prompt_for
from selfspec.drafters.base import DraftContext, DraftRequest, Drafter
from selfspec.drafters.draft_model import DraftModelDrafter
from selfspec.drafters.lookup_first import LookupFirstDrafter
from selfspec.engine import DecodeConfig, SpeculativeEngine
from selfspec.heads import init_heads, make_drafter
from selfspec.sampling import SamplingConfig


class Counting(Drafter):
    """Wraps a drafter and counts the drafts it was asked for."""

    def __init__(self, inner: Drafter) -> None:
        self.inner, self.calls, self.name = inner, 0, inner.name
        self.needs_hidden_states = inner.needs_hidden_states

    def start(self, ctx):
        return self.inner.start(ctx)

    def propose(self, state, ctx, req):
        self.calls += 1
        return self.inner.propose(state, ctx, req)

    def observe(self, state, ctx):
        return self.inner.observe(state, ctx)


def repetitive(seed: int, n: int = 24, period: int = 6, vocab: int = 64) -> list[int]:
    g = torch.Generator().manual_seed(3000 + seed)
    return (torch.randint(0, vocab, (period,), generator=g).tolist() * n)[:n]


@pytest.mark.parametrize("seed", range(4))
def test_lookup_first_draft_model_is_lossless(seed: int) -> None:
    target, draft = tiny_model(seed, layers=3), tiny_model(seed + 100, layers=1)
    prompt = repetitive(seed)
    inner = Counting(DraftModelDrafter(draft))
    drafter = LookupFirstDrafter(inner)
    got = SpeculativeEngine(target, drafter).generate(prompt, DecodeConfig(max_new_tokens=40, max_depth=4, adaptive=False))
    assert got.tokens == hf_greedy(target, prompt, 40)
    assert 0 < inner.calls < got.stats.target_forwards  # both sources drafted


def test_lookup_answers_only_where_the_context_repeats() -> None:
    inner = Counting(DraftModelDrafter(tiny_model(101, layers=1)))
    drafter = LookupFirstDrafter(inner)
    req = DraftRequest(4, 16, SamplingConfig())
    repeats = torch.tensor(list(range(10)) * 2 + [0, 1, 2])
    state = drafter.start(DraftContext(repeats, repeats.numel() - 1))
    tree, _ = drafter.propose(state, DraftContext(repeats, repeats.numel() - 1), req)
    assert tree.tokens.tolist() == [2, 3, 4, 5, 6] and inner.calls == 0  # "0 1 2" occurred before
    fresh = torch.arange(23)
    state = drafter.start(DraftContext(fresh, fresh.numel() - 1))
    drafter.propose(state, DraftContext(fresh, fresh.numel() - 1), req)
    assert inner.calls == 1  # nothing repeats: the draft model drafted


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("family", list(HYPER))
def test_lookup_first_heads_are_lossless(family: str, seed: int) -> None:
    model = tiny_model(seed, layers=3)
    prompt = prompt_for(seed, 16)
    heads = perturb(init_heads(family, model, **HYPER[family]), seed)
    inner = Counting(make_drafter(heads, model))
    cfg = DecodeConfig(max_new_tokens=32, max_depth=4, max_nodes=10, adaptive=False)
    got = SpeculativeEngine(model, LookupFirstDrafter(inner, min_ngram=2)).generate(prompt, cfg)
    assert got.tokens == hf_greedy(model, prompt, 32)
    assert inner.calls > 0


def test_lookup_first_sampling_is_lossless(monkeypatch) -> None:
    monkeypatch.setattr(sampling_test, "N", 1000)
    target = tiny_model(11, vocab=sampling_test.VOCAB, hidden=16)
    draft = tiny_model(12, vocab=sampling_test.VOCAB, hidden=16, layers=1)
    engine = SpeculativeEngine(target, LookupFirstDrafter(DraftModelDrafter(draft), min_ngram=1, min_depth=1))
    samples = sampling_test.draw(engine, 1)
    assert sampling_test.chi_square_pvalue(samples, sampling_test.exact_joint(target)) > sampling_test.ALPHA


def test_generate_flags_put_heads_behind_lookup(tmp_path):
    """``selfspec generate --heads F --lookup``: the checkpoint's drafter wrapped by lookup; without it, bare."""
    from selfspec.checkpoint import save_heads
    from selfspec.cli import build_drafter, build_parser

    model = tiny_model(0, vocab=64)
    save_heads(init_heads("medusa", model), model, tmp_path)
    argv = ["generate", "--prompt", "x", "--heads", str(tmp_path)]
    bare = build_drafter(build_parser().parse_args(argv), model, None)
    wrapped = build_drafter(build_parser().parse_args(argv + ["--lookup"]), model, None)
    assert isinstance(wrapped, LookupFirstDrafter) and not isinstance(bare, LookupFirstDrafter)
    assert type(wrapped.inner) is type(bare)
