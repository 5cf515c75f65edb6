"""Draft heads on a frozen target: every family is lossless, EAGLE's cached tree equals recomputation,
early exit can draft inside the target's own cache."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from conftest import (tree_path, ALPHA, HEADS_HYPER as HYPER, SAMPLING_VOCAB, chi_square_pvalue, draw, exact_joint, hf_greedy,
                      perturb, prompt_for, tiny_model)
from selfspec.drafters.base import DraftContext, DraftRequest
from selfspec.engine import DecodeConfig, SpeculativeEngine, prefill
from selfspec.heads import init_heads, make_drafter
from selfspec.frozen import truncated_decoder
from selfspec.heads.medusa import rank_tree
from selfspec.target.packed_linear import is_packed, pack_linears
from selfspec.sampling import SamplingConfig

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("perturbed", [False, True])
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("family", list(HYPER))
def test_greedy_heads_match_hf(family: str, arch: str, seed: int, perturbed: bool) -> None:
    model = tiny_model(seed, layers=3, arch=arch)
    prompt = prompt_for(seed)
    heads = init_heads(family, model, **HYPER[family])
    if perturbed:
        perturb(heads, seed)
    limits = [(4, 16), (6, 8), (2, 3)][seed]
    cfg = DecodeConfig(max_new_tokens=24, max_depth=limits[0], max_nodes=limits[1], adaptive=False)
    got = SpeculativeEngine(model, make_drafter(heads, model)).generate(prompt, cfg)
    assert got.tokens == hf_greedy(model, prompt, 24)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_eagle1_layout_is_lossless(arch: str) -> None:
    """EAGLE-1's layout (no input norms, no norm before the layer's attention, no final norm: what vLLM loads)."""
    model = tiny_model(5, layers=3, arch=arch)
    heads = perturb(init_heads("eagle", model, norms=False, **HYPER["eagle"]), 5)
    assert sorted(k for k in heads.state_dict() if "norm" in k) == ["decoder.layers.0.post_attention_layernorm.weight"]
    cfg = DecodeConfig(max_new_tokens=24, max_depth=5, max_nodes=12, adaptive=False)
    got = SpeculativeEngine(model, make_drafter(heads, model)).generate(prompt_for(5), cfg)
    assert got.tokens == hf_greedy(model, prompt_for(5), 24)


@pytest.mark.parametrize("family", list(HYPER))
def test_one_token_prompt(family: str) -> None:
    model = tiny_model(4, layers=3)
    drafter = make_drafter(perturb(init_heads(family, model, **HYPER[family]), 0), model)
    got = SpeculativeEngine(model, drafter).generate([7], DecodeConfig(max_new_tokens=16, adaptive=False))
    assert got.tokens == hf_greedy(model, [7], 16)


def test_early_exit_shares_the_targets_modules() -> None:
    model = tiny_model(0, layers=3)
    cut = truncated_decoder(model, 2)
    target = dict(model.get_decoder().named_parameters())
    for name, p in cut.named_parameters():
        assert p is target[name]  # shared, nothing copied
    assert len(cut.layers) == 2 and all(a is b for a, b in zip(cut.layers, model.get_decoder().layers))
    assert init_heads("early-exit", model, exit_layer=2).proj.weight.abs().sum() == 0
    pack_linears(model)  # what the static target pass does later: the cut's layers are the packed ones
    assert is_packed(cut) and sum(p.numel() for p in cut.parameters()) < sum(p.numel() for p in target.values())


@dataclass
class SharedCacheContext(DraftContext):
    """The engine extension early exit uses when present: the target's own cache."""

    target_cache: object = None


def test_early_exit_drafts_inside_the_target_cache() -> None:
    model = tiny_model(5, layers=3)
    drafter = make_drafter(perturb(init_heads("early-exit", model, exit_layer=2), 5, 0.1), model)
    state, _ = prefill(model, torch.tensor(prompt_for(5, 12)))
    before = [(layer.keys.clone(), layer.values.clone()) for layer in state.cache.layers]
    req = DraftRequest(4, 16, SamplingConfig())
    ctx = DraftContext(state.tokens, state.cache_len)
    own, _ = drafter.propose(drafter.start(ctx), ctx, req)
    ctx = SharedCacheContext(state.tokens, state.cache_len, target_cache=state.cache)
    shared, _ = drafter.propose(drafter.start(ctx), ctx, req)
    assert shared.tokens.tolist() == own.tokens.tolist()
    for layer, (k, v) in zip(state.cache.layers, before):  # the target gets its cache back untouched
        assert torch.equal(layer.keys, k) and torch.equal(layer.values, v)


def test_rank_tree_prunes_to_limits() -> None:
    paths = [[0], [0, 0], [1], [0, 0, 0], [0, 1], [2, 1]]
    parents, labels = rank_tree(paths, max_depth=2, max_nodes=5)
    assert parents == [-1, 0, 1, 0, 1] and labels[1:] == [(1, 0), (2, 0), (1, 1), (2, 1)]
    parents, labels = rank_tree([[2, 1]], max_depth=3, max_nodes=8)  # a missing prefix comes with its path
    assert parents == [-1, 0, 1] and labels[1:] == [(1, 2), (2, 1)]


@pytest.mark.parametrize("seed", range(3))
def test_eagle_tree_equals_uncached_recomputation(seed: int) -> None:
    """Every node's children are the head's top-k after recomputing its whole path from scratch, no cache."""
    model = tiny_model(seed, layers=2, arch=["llama", "qwen2"][seed % 2])
    heads = init_heads("eagle", model, top_k=3, draft_vocab_size=40)
    drafter = make_drafter(heads, model)
    prompt = prompt_for(seed, 11)
    state, hs = prefill(model, torch.tensor(prompt), layers=(-1,))
    ctx = DraftContext(state.tokens, state.cache_len, hs)
    tree, dstate = drafter.propose(drafter.start(ctx), ctx, DraftRequest(4, 14, SamplingConfig()))
    assert tree.max_depth >= 2 and tree.size == 14
    assert dstate.cache.get_seq_length() == dstate.cached == state.cache_len  # drafted pairs were dropped
    real = hs[-1]  # f_0 .. f_{R-1}
    with torch.no_grad():
        for node in range(tree.size):
            if not tree.children[node]:
                continue
            drafted = tree_path(tree, node)
            feats, toks = real, prompt[1:]
            for tok in [None, *drafted]:  # grow the sequence with the head's own predicted features
                if tok is not None:
                    feats, toks = torch.cat([feats, pred[None]]), toks + [tok]
                embeds = model.get_input_embeddings()(torch.tensor(toks))
                pred = heads(feats[None], embeds[None], torch.arange(len(toks))[None])[0, -1]
            top, _ = drafter._top(dstate, pred[None], 3)
            kids = [int(tree.tokens[c]) for c in tree.children[node]]
            assert set(kids) <= set(top[0]) and top[0][0] in kids


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_eagle_chains_for_many_sequences_equal_each_sequence_recomputed_alone(arch: str) -> None:
    """``propose_chains`` (a batch's draft: one head pass for every sequence's queued pairs, then one per depth)
    gives each sequence the greedy chain that recomputing its own pairs from scratch gives; the committed pairs are
    appended to each sequence's own cache, the drafted ones are not; a sequence asked for no draft is untouched."""
    model = tiny_model(5, layers=2, arch=arch)
    heads = perturb(init_heads("eagle", model, top_k=3, draft_vocab_size=40), 5)
    drafter = make_drafter(heads, model)
    prompts = [prompt_for(s, n) for s, n in ((1, 9), (2, 17), (3, 5), (4, 12))]
    queued, depths = (3, 0, 1, 5), [4, 3, 0, 2]
    states, ctxs = [], []
    for prompt, k in zip(prompts, queued):  # started k tokens short, then told of the last k
        state, hs = prefill(model, torch.tensor(prompt), layers=(-1,))
        n = state.cache_len
        dstate = drafter.start(DraftContext(state.tokens[:len(prompt) - k], n - k, (hs[-1][:n - k],)))
        ctx = DraftContext(state.tokens, n, (hs[-1][n - k:],))
        states.append(drafter.observe(dstate, ctx))
        ctxs.append((ctx, hs[-1]))
    trees, _ = drafter.propose_chains(states, [c for c, _ in ctxs], depths)
    for prompt, (ctx, real), tree, dstate, depth, k in zip(prompts, ctxs, trees, states, depths, queued):
        assert int(tree.tokens[0]) == prompt[-1] and tree.parents == list(range(-1, depth))
        if depth == 0:  # untouched: its queued pairs (the prompt's included: start only queues) wait for a draft
            assert tree.size == 1 and dstate.cached == 0 and dstate.pending.shape[0] == ctx.cache_len
            continue
        assert dstate.cached == dstate.row_len == ctx.cache_len and dstate.pending is None and dstate.row >= 0
        drafter.head_rows.copy_out(dstate)  # the row's pairs, appended to the sequence's own cache on demand
        assert dstate.cache.get_seq_length() == dstate.dense == ctx.cache_len
        feats, toks, chain_ = real, prompt[1:], []
        with torch.no_grad():
            for _ in range(depth):  # the head over the whole sequence, no cache, fed its own features
                embeds = model.get_input_embeddings()(torch.tensor(toks))
                pred = heads(feats[None], embeds[None], torch.arange(len(toks))[None])[0, -1]
                top, _ = drafter._top(dstate, pred[None], 1)
                chain_.append(top[0][0])
                feats, toks = torch.cat([feats, pred[None]]), toks + [top[0][0]]
        assert tree.tokens[1:].tolist() == chain_


def recomputed(heads, drafter, dstate, feats: torch.Tensor, toks: list[int], depth: int) -> tuple[torch.Tensor, list]:
    """The head over a whole sequence's pairs without a cache: (its root feature, the greedy chain of ``depth``)."""
    root, chain_ = None, []
    with torch.no_grad():
        for d in range(max(depth, 1)):
            embeds = drafter.embed(torch.tensor(toks))
            pred = heads(feats[None], embeds[None], torch.arange(len(toks))[None])[0, -1]
            root = pred if d == 0 else root
            top, _ = drafter._top(dstate, pred[None], 1)
            chain_.append(top[0][0])
            feats, toks = torch.cat([feats, pred[None]]), toks + [top[0][0]]
    return root, chain_[:depth]


@pytest.mark.parametrize("family", ["eagle", "eagle3"])
def test_batched_head_rows_stay_right_across_steps_leaves_and_lone_drafts(family: str) -> None:
    """The head's batch cache keeps a row per sequence from step to step: over steps with rows joining, a row
    released from the middle (the last row moves into it), a sequence drafting alone (its own cache, topped up from
    its row) and back in a batch (its row topped up), every root feature and chain equals the head recomputed over
    the sequence's whole pairs."""
    model = tiny_model(6, layers=3)
    heads = perturb(init_heads(family, model, top_k=3, draft_vocab_size=40), 6)
    drafter = make_drafter(heads, model)
    seqs = [prompt_for(s, 60) for s in range(5)]
    with torch.no_grad():
        hidden = [model(torch.tensor([q]), output_hidden_states=True).hidden_states for q in seqs]
    layers = drafter.state_layers

    def feats_of(i: int, a: int, b: int) -> tuple[torch.Tensor, ...]:
        return tuple(hidden[i][layer][0, a:b] for layer in layers)

    lengths = [9, 17, 5, 30, 12]  # pairs committed so far (the prompt)
    states = [drafter.start(DraftContext(torch.tensor(q[:n + 1]), n, feats_of(i, 0, n)))
              for i, (q, n) in enumerate(zip(seqs, lengths))]

    def commit(i: int, k: int) -> DraftContext:
        lengths[i] += k
        ctx = DraftContext(torch.tensor(seqs[i][:lengths[i] + 1]), lengths[i], feats_of(i, lengths[i] - k, lengths[i]))
        states[i] = drafter.observe(states[i], ctx)
        return ctx

    def check(i: int, chain_tokens: list[int] | None) -> None:
        n = lengths[i]
        feats = torch.cat(feats_of(i, 0, n), -1) if family == "eagle3" else feats_of(i, 0, n)[0]
        feats = heads.fuse(feats) if family == "eagle3" else feats
        root, want = recomputed(heads, drafter, states[i], feats, seqs[i][1:n + 1], len(chain_tokens or []))
        assert states[i].cached == n and torch.allclose(states[i].root_feature, root, atol=1e-5)
        if chain_tokens is not None:
            assert chain_tokens == want

    plan = [([0, 1, 2, 3], 2), ([0, 1, 2, 3, 4], 3), ([1, 2, 3, 4], 1), ([3], 2), ([1, 3, 4], 4), ([1, 3], 2)]
    for step, (active, k) in enumerate(plan):
        if step == 2:
            drafter.release(states[0])  # from the middle: the last row moves into row 0
            assert drafter.head_rows.rows == 4 and sorted(states[i].row for i in active) == [0, 1, 2, 3]
        ctxs = {i: commit(i, k + i % 2) for i in active}
        if len(active) == 1:  # a batch of one drafts alone, over the sequence's own cache
            i = active[0]
            tree, states[i] = drafter.propose(states[i], ctxs[i], DraftRequest(3, 8, SamplingConfig()))
            assert states[i].dense == lengths[i]
            check(i, None)
            continue
        depths = [3 if j % 3 else 2 for j in active]
        trees, _ = drafter.propose_chains([states[i] for i in active], [ctxs[i] for i in active], depths)
        for i, tree, depth in zip(active, trees, depths):
            check(i, tree.tokens[1:].tolist())
            assert tree.max_depth == depth


def test_eagle_drafts_context_tokens_outside_its_draft_vocabulary() -> None:
    """A reduced draft vocabulary (here ids 0..7) is widened per sequence by its prompt and committed tokens."""
    model = tiny_model(1, layers=2)
    drafter = make_drafter(init_heads("eagle", model, top_k=3, draft_vocab_size=8), model)
    prompt = [20, 3, 30, 40, 30, 5]
    state, hs = prefill(model, torch.tensor(prompt), layers=(-1,))
    first = DraftContext(state.tokens, state.cache_len, hs)
    dstate = drafter.start(first)
    assert dstate.context_ids == []  # start only queues: rows are gathered when the head first feeds the prompt
    drafter.propose(dstate, first, DraftRequest(2, 4, SamplingConfig()))
    assert dstate.context_ids == [20, 30, 40] and set(drafter.row_cache) == {20, 30, 40}
    lm_rows = model.get_output_embeddings().weight
    for token in (40, 3):  # a feature along a token's LM-head row makes it the head's first choice
        top, logp = drafter._top(dstate, 50 * lm_rows[token][None], 3)
        assert top[0][0] == token and len(set(top[0])) == 3
        assert torch.tensor(logp[0]).exp().sum() <= 1.0 + 1e-5
    longer, more = prefill(model, torch.tensor(prompt + [50, 60]), layers=(-1,))  # two tokens committed
    ctx = DraftContext(longer.tokens, longer.cache_len, tuple(h[state.cache_len:] for h in more))
    drafter.propose(drafter.observe(dstate, ctx), ctx, DraftRequest(3, 8, SamplingConfig()))
    assert dstate.context_ids == [20, 30, 40, 50, 60]
    assert torch.equal(dstate.context_weight, lm_rows[[20, 30, 40, 50, 60]])


def test_context_rows_are_cached_across_sequences_and_bounded(monkeypatch) -> None:
    """The LM-head rows of context tokens are kept (most recently used first out of the cap) for later sequences,
    and are the head's rows whether fetched or cached."""
    import selfspec.heads.eagle_drafter as eagle_drafter
    model = tiny_model(1, layers=2)
    drafter = make_drafter(init_heads("eagle", model, top_k=3, draft_vocab_size=8), model)
    lm_rows = model.get_output_embeddings().weight
    monkeypatch.setattr(eagle_drafter, "CONTEXT_ROWS_CACHED", 3)
    fetched = []
    fetch = eagle_drafter.lm_head_rows
    monkeypatch.setattr(eagle_drafter, "lm_head_rows", lambda m, ids: fetched.append(ids.tolist()) or fetch(m, ids))
    steps = (([20, 21], [20, 21]), ([21, 22, 20], [22]), ([23], [23]), ([21, 20], [21]))  # 21: least recently used
    for ids, missing in steps:
        weight, bias = drafter._context_rows(ids)
        assert torch.equal(weight, lm_rows[ids]) and bias is None and fetched.pop() == missing
        assert len(drafter.row_cache) <= 3 and not fetched


@pytest.mark.parametrize("family", list(HYPER))
def test_sampling_with_heads_is_lossless(family: str) -> None:
    target = tiny_model(11, vocab=SAMPLING_VOCAB, hidden=16)
    hyper = {"medusa": {}, "eagle": {"draft_vocab_size": 6, "top_k": 3}, "early-exit": {"exit_layer": 1},
             "eagle3": {"draft_vocab_size": 6, "top_k": 3}}[family]
    heads = perturb(init_heads(family, target, **hyper), 3, 0.2)
    engine = SpeculativeEngine(target, make_drafter(heads, target))
    assert chi_square_pvalue(draw(engine, 1, n=1000), exact_joint(target)) > ALPHA


@pytest.mark.integration
@pytest.mark.parametrize("family", list(HYPER))
def test_real_model_heads_match_generate(family: str) -> None:
    from selfspec.zoo import load_model

    model, tokenizer = load_model("smollm2-135m-instruct", dtype="float32")  # bf16 near-ties: test_demo, divergence
    messages = [{"role": "user", "content": "Write a haiku about the sea."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    ids = torch.tensor([prompt])
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24,
                              temperature=None, top_p=None, top_k=None)[0, len(prompt):].tolist()
    drafter = make_drafter(init_heads(family, model), model)
    got = SpeculativeEngine(model, drafter, tokenizer).generate(prompt, DecodeConfig(max_new_tokens=24))
    eos = model.generation_config.eos_token_id
    assert got.tokens == expected[: len(got.tokens)] and (len(got.tokens) == 24 or got.tokens[-1] in
                                                          (eos if isinstance(eos, list) else [eos]))
