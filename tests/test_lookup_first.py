"""Lookup-first drafting: prompt lookup where the context repeats, the wrapped drafter elsewhere; lossless
whichever answers, and the wrapped drafter's state survives the steps it sat out."""

from __future__ import annotations

import pytest
import torch

from conftest import (ALPHA, HEADS_HYPER as HYPER, SAMPLING_VOCAB, chi_square_pvalue, draw, exact_joint, hf_greedy,
                      perturb, prompt_for, tiny_model)
from selfspec.drafters.base import DraftContext, DraftRequest, Drafter
from selfspec.drafters.draft_model import DraftModelDrafter
from selfspec.drafters.lookup_first import LookupFirstDrafter
from selfspec.engine import DecodeConfig, SpeculativeEngine
from selfspec.heads import init_heads, make_drafter
from selfspec.sampling import SamplingConfig
from selfspec.tree import from_paths


class Counting(Drafter):
    """Wraps a drafter and counts the drafts it was asked for."""

    def __init__(self, inner: Drafter) -> None:
        self.inner, self.calls, self.name, self.depths = inner, 0, inner.name, []
        self.needs_hidden_states, self.state_layers = inner.needs_hidden_states, inner.state_layers

    def start(self, ctx):
        return self.inner.start(ctx)

    def propose(self, state, ctx, req):
        self.calls += 1
        self.depths.append(req.max_depth)
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


def test_each_source_drafts_as_deep_as_the_policy_allows_it() -> None:
    """The policy is asked per source: lookup drafts while the wrapped drafter is switched off, and the
    other way round; a source allowed depth 0 drafts nothing."""
    inner = Counting(DraftModelDrafter(tiny_model(101, layers=1)))
    drafter = LookupFirstDrafter(inner)
    repeats = torch.tensor(list(range(10)) * 2 + [0, 1, 2])
    fresh = torch.arange(23)
    asked = []

    def policy(depths):
        return lambda source: asked.append(source) or depths[source]

    def draft(tokens, depths):
        ctx = DraftContext(tokens, tokens.numel() - 1)
        req = DraftRequest(4, 16, SamplingConfig(), depth_for=policy(depths))
        return drafter.draft(drafter.start(ctx), ctx, req)[0]

    tree = draft(repeats, {"prompt-lookup": 2, inner.name: 0})
    assert (tree.tokens.tolist(), tree.source, inner.calls) == ([2, 3, 4], "prompt-lookup", 0)
    tree = draft(fresh, {"prompt-lookup": 2, inner.name: 0})  # no match: only the wrapped drafter is asked
    assert (tree.size, inner.calls, asked[-1]) == (1, 0, inner.name) and "prompt-lookup" not in asked[1:]
    tree = draft(repeats, {"prompt-lookup": 0, inner.name: 3})  # lookup off: the wrapped drafter drafts
    assert (tree.source, inner.calls, inner.depths) == (inner.name, 1, [3]) and tree.max_depth >= 1


def test_short_matches_draft_only_where_the_policy_expects_more_of_them() -> None:
    """Only a 1-token match ("5" occurred before): short lookup drafts if its expected rate beats the
    wrapped drafter's, else the wrapped drafter does."""
    inner = Counting(DraftModelDrafter(tiny_model(101, layers=1)))
    drafter = LookupFirstDrafter(inner)
    tokens = torch.tensor([5, 6, 7, 8, 9, 5])
    ctx = DraftContext(tokens, tokens.numel() - 1)

    def draft(rates):
        req = DraftRequest(4, 16, SamplingConfig(), depth_for=lambda s: 4, rate_for=rates.get)
        return drafter.draft(drafter.start(ctx), ctx, req)[0]

    tree = draft({"prompt-lookup-short": 2.0, inner.name: 1.0})
    assert (tree.tokens.tolist(), tree.source, inner.calls) == ([5, 6, 7, 8, 9], "prompt-lookup-short", 0)
    tree = draft({"prompt-lookup-short": 1.0, inner.name: 2.0})
    assert (tree.source, inner.calls) == (inner.name, 1)


class Wrong(Drafter):
    """Drafts a token the target never picks next: every draft is rejected."""

    name = "wrong"

    def __init__(self, target) -> None:
        self.target = target

    @torch.no_grad()
    def propose(self, state, ctx, req):
        best = int(self.target(ctx.tokens[None]).logits[0, -1].argmax())
        return from_paths(int(ctx.tokens[-1]), [[(best + 1) % 64]]), state


def test_a_useless_drafter_does_not_silence_lookup() -> None:
    """Adaptive depth with a drafter whose drafts always fail: it switches itself off, and lookup still
    drafts once the target falls into a loop (this tiny model does after ~75 tokens). Judged together,
    the failures switched lookup off too: every step plain, tau exactly 1."""
    target = tiny_model(1, layers=1)
    got = SpeculativeEngine(target, LookupFirstDrafter(Wrong(target))).generate([1, 2, 3], DecodeConfig(max_new_tokens=120))
    assert got.tokens == hf_greedy(target, [1, 2, 3], 120)
    by_source = got.stats.drafts_by_source
    assert sum(by_source.values()) == got.stats.speculative_steps
    lookup = by_source.get("prompt-lookup", 0) + by_source.get("prompt-lookup-short", 0)
    assert lookup > by_source.get("wrong", 0) and got.stats.mean_accepted > 1.05


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


def test_lookup_first_sampling_is_lossless() -> None:
    target = tiny_model(11, vocab=SAMPLING_VOCAB, hidden=16)
    draft = tiny_model(12, vocab=SAMPLING_VOCAB, hidden=16, layers=1)
    engine = SpeculativeEngine(target, LookupFirstDrafter(DraftModelDrafter(draft), min_ngram=1, min_depth=1))
    assert chi_square_pvalue(draw(engine, 1, n=1000), exact_joint(target)) > ALPHA


def test_generate_flags_put_heads_behind_lookup(tmp_path):
    """``selfspec generate --heads F``: the checkpoint's drafter behind lookup; with ``--no-lookup``, bare."""
    from selfspec.checkpoint import save_heads
    from selfspec_cli.generate import build_drafter
    from selfspec_cli.main import build_parser

    model = tiny_model(0, vocab=64)
    save_heads(init_heads("medusa", model), model, tmp_path)
    argv = ["generate", "--prompt", "x", "--heads", str(tmp_path)]
    bare = build_drafter(build_parser().parse_args(argv + ["--no-lookup"]), model, None)
    wrapped = build_drafter(build_parser().parse_args(argv), model, None)
    assert isinstance(wrapped, LookupFirstDrafter) and not isinstance(bare, LookupFirstDrafter)
    assert type(wrapped.inner) is type(bare)


def test_a_recent_match_in_a_loop_drafts_the_loop_forward() -> None:
    """The latest match of "7 7" ends one token before the end; the draft repeats the loop to full depth."""
    from selfspec.drafters.prompt_lookup import continuation, find_continuations

    assert find_continuations(torch.tensor([1, 7, 7, 7]), 2, 4, 1) == [[7, 7, 7, 7]]
    assert continuation([5, 1, 2, 3, 1, 2], 4, 5) == [1, 2, 1, 2, 1]  # period 2
    assert continuation([5, 1, 2, 3, 1, 2], 1, 3) == [1, 2, 3]  # an old match: the text as it was
