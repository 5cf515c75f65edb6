"""Suffix speculation (``selfspec/drafters/suffix.py``): drafts from earlier answers, output unchanged.

Greedy output equals transformers' greedy alone and batched; sampling keeps the target's distribution; an answer
the engine finished drafts the next request that repeats it; a request that asks not to be remembered leaves no
trace; the index stays within its bound however much is fed."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import ALPHA, SAMPLING_VOCAB, chi_square_pvalue, draw, exact_joint, hf_greedy, prompt_for, tiny_model
from selfspec.batching import BatchEngine
from selfspec.drafters.suffix import SuffixDrafter, SuffixIndex, frequency_tree, own_matches
from selfspec.engine import DecodeConfig, SpeculativeEngine

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 64


def test_matches_are_measured_back_to_where_the_contexts_differ() -> None:
    index = SuffixIndex()
    index.add([1, 1, 3, 4, 5, 6, 7])  # matches ...3 4 5 over 3 tokens
    index.add([9, 2, 3, 4, 5, 8, 8])  # ... over 4 tokens (2 3 4 5)
    index.add([7, 3, 4, 5])  # nothing follows: no match
    assert index.matches([2, 3, 4, 5], depth=2) == [(4, [8, 8]), (3, [6, 7])]  # the newest first
    assert index.matches([1, 1, 1], 2) == [] and index.hits == 1 and index.lookups == 2
    assert own_matches([5, 6, 7, 5, 6, 9, 5, 6], depth=3) == [(2, [9, 5, 6]), (2, [7, 5, 6])]


def test_beside_heads_only_matches_of_min_match_tokens_draft() -> None:
    from selfspec.drafters.base import DraftContext, DraftRequest
    from selfspec.sampling import SamplingConfig

    req = DraftRequest(4, 16, SamplingConfig())
    weak = DraftContext(torch.tensor([5, 6, 7, 1, 2, 7]), 5)  # 7 occurred before, after 6: a 1-token match
    assert SuffixDrafter().propose(None, weak, req)[0].tokens.tolist() == [7, 1, 2, 7, 1]
    assert SuffixDrafter(min_match=3).propose(None, weak, req)[0].size == 1  # the heads' turn
    strong = DraftContext(torch.tensor([5, 6, 7, 1, 2, 5, 6, 7]), 7)  # 5 6 7 again: 3 tokens
    assert SuffixDrafter(min_match=3).propose(None, strong, req)[0].tokens.tolist() == [7, 1, 2, 5, 6]


def test_the_tree_holds_the_likeliest_continuations_first() -> None:
    # weights m^2: [8 8] 16; [6 6] 9 twice; [6 7] 9. Path probabilities: 6 27/43, 6 6 18/43, 8 16/43, 8 8 16/43, 6 7 9/43
    found = [(4, [8, 8]), (3, [6, 6]), (3, [6, 6]), (3, [6, 7])]
    tree = frequency_tree(0, found, max_nodes=4, max_depth=2)
    assert tree.tokens.tolist() == [0, 6, 6, 8] and tree.parents == [-1, 0, 1, 0]
    assert frequency_tree(0, found, max_nodes=5, max_depth=2).tokens.tolist() == [0, 6, 6, 8, 8]  # 8 first: tie
    whole = frequency_tree(0, found, max_nodes=16, max_depth=2)
    assert sorted(zip(whole.depth, whole.tokens.tolist())) == [(0, 0), (1, 6), (1, 8), (2, 6), (2, 7), (2, 8)]
    assert frequency_tree(0, found, max_nodes=16, max_depth=1).tokens.tolist() == [0, 6, 8]
    assert frequency_tree(0, [], max_nodes=16, max_depth=4).tokens.tolist() == [0]
    weak = frequency_tree(0, [(1, list(range(1, 17)))], max_nodes=32, max_depth=16)  # a 1-token match: 4 deep
    assert weak.tokens.tolist() == [0, 1, 2, 3, 4]


def test_the_index_stays_within_its_bound_and_forgets_the_oldest_first() -> None:
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 50, (100,), generator=g).tolist() for _ in range(21)]
    whole = SuffixIndex(max_bytes=2**30)
    for seq in seqs[-3:]:
        whole.add(seq)
    index = SuffixIndex(max_bytes=whole.nbytes)  # room for three
    for seq in seqs:  # 2,100 tokens fed into room for 300
        index.add(seq)
        assert index.nbytes <= index.max_bytes
    assert index.tokens == 300 and sorted(index.seqs) == [18, 19, 20]  # the newest three
    assert index.entries == whole.entries and len(index.table) == len(whole.table)  # the others' entries went too
    assert index.matches(seqs[0][:40], 4) == whole.matches(seqs[0][:40], 4)


def test_an_answer_drafted_from_is_kept_over_older_unused_ones() -> None:
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 50_000, (60,), generator=g).tolist() for _ in range(4)]  # keys all distinct
    one = SuffixIndex(max_bytes=2**30)
    one.add(seqs[0])
    index = SuffixIndex(max_bytes=int(3.5 * one.nbytes))  # room for three
    for seq in seqs[:3]:
        index.add(seq)
    assert index.matches(seqs[0][:20], 4)  # the oldest one drafts: now the most recently used
    index.add(seqs[3])
    assert sorted(index.seqs) == [0, 2, 3]  # the least recently used (1) went, not the oldest (0)


def test_the_accounting_holds_what_python_allocates() -> None:
    """The bound is on the index's own accounting; it must not undercount what its objects take (tracemalloc), for
    text whose keys repeat little (random tokens: a key per position, the worst case) or much."""
    import tracemalloc

    g = torch.Generator().manual_seed(1)
    for vocab in (50_000, 200):
        seqs = [torch.randint(0, vocab, (200,), generator=g).tolist() for _ in range(300)]
        tracemalloc.start()
        index = SuffixIndex(max_bytes=2**30)
        for seq in seqs:
            index.add(seq)
        held = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        assert held <= index.nbytes, (vocab, held, index.nbytes)


def test_an_answer_the_engine_finished_drafts_the_next_request_that_repeats_it() -> None:
    model = tiny_model(3, vocab=VOCAB)
    drafter = SuffixDrafter()
    engine = SpeculativeEngine(model, drafter)
    prompt = prompt_for(7, 12, VOCAB)
    cfg = DecodeConfig(max_new_tokens=40, adaptive=False, max_depth=8, max_nodes=16)
    first = engine.generate(prompt, cfg)
    assert first.tokens == hf_greedy(model, prompt, 40) and drafter.index.tokens > 0
    again = engine.generate(prompt, cfg)
    assert again.tokens == first.tokens
    assert again.stats.mean_accepted > first.stats.mean_accepted + 1  # most of it drafted from the first answer


def test_a_request_that_asks_not_to_be_remembered_leaves_no_trace() -> None:
    model = tiny_model(3, vocab=VOCAB)
    drafter = SuffixDrafter()
    engine = SpeculativeEngine(model, drafter)
    engine.generate(prompt_for(7, 12, VOCAB), DecodeConfig(max_new_tokens=20, remember=False))
    assert drafter.index.tokens == 0 and not drafter.index.table
    engine.generate(prompt_for(7, 12, VOCAB), DecodeConfig(max_new_tokens=20))
    assert drafter.index.tokens > 0


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_batched_rows_with_a_shared_index_equal_their_greedy_answers(arch: str) -> None:
    model = tiny_model(5, vocab=VOCAB, arch=arch)
    prompts = [prompt_for(i % 3, 10 + i % 3, VOCAB) for i in range(9)]  # three prompts, each asked three times
    batch = BatchEngine(model, SuffixDrafter(), max_batch=3, context=128)
    cfg = DecodeConfig(max_new_tokens=30, max_depth=6, max_nodes=16)
    results = batch.generate_batch(prompts, cfg)
    assert [r.tokens for r in results] == [hf_greedy(model, p, 30) for p in prompts]
    assert batch.drafter.index.hits > 0


@pytest.mark.parametrize("batched", [False, True])
def test_heads_beside_suffix_drafts_equal_greedy(batched: bool) -> None:
    """<heads>+suffix: the suffix index first where an earlier answer (or the context) matches, the heads elsewhere;
    every answer plain greedy's, whoever drafted (repeated prompts: the second asking is drafted from the first)."""
    from conftest import HEADS_HYPER, perturb
    from selfspec.drafters.lookup_first import LookupFirstDrafter
    from selfspec.heads import init_heads, make_drafter

    model = tiny_model(2, vocab=VOCAB, layers=3)
    heads = make_drafter(perturb(init_heads("eagle", model, **HEADS_HYPER["eagle"]), 2), model)
    drafter = LookupFirstDrafter(heads, lookup=SuffixDrafter(min_match=3))
    prompts = [prompt_for(i % 2, 12, VOCAB) for i in range(4)]
    cfg = DecodeConfig(max_new_tokens=24, max_depth=4, max_nodes=10, adaptive=False)
    if batched:
        results = BatchEngine(model, drafter, max_batch=2, context=128).generate_batch(prompts, cfg)
    else:
        engine = SpeculativeEngine(model, drafter)
        results = [engine.generate(p, cfg) for p in prompts]
    assert [r.tokens for r in results] == [hf_greedy(model, p, 24) for p in prompts]
    sources = {s for r in results for s in r.stats.drafts_by_source}
    assert {"eagle", "suffix"} <= sources and drafter.lookup.index.hits > 0  # both drafted


def test_sampling_with_suffix_drafts_keeps_the_distribution() -> None:
    model = tiny_model(11, vocab=SAMPLING_VOCAB, hidden=16)
    drafter = SuffixDrafter()
    engine = SpeculativeEngine(model, drafter)
    pairs = draw(engine, max_depth=2)  # every sample's answer joins the index: later ones are drafted from it
    assert drafter.index.hits > 100
    assert chi_square_pvalue(pairs, exact_joint(model)) > ALPHA


def test_a_server_remembers_what_it_answered_except_what_asked_not_to_be_stored() -> None:
    pytest.importorskip("uvicorn")
    from conftest import Live

    server = Live("tiny", smooth=False, drafter=lambda model, tokenizer: SuffixDrafter())
    index = server.engine.drafter.index
    try:
        ask = {"messages": [{"role": "user", "content": "Say something long"}], "model": "tiny", "max_tokens": 24,
               "temperature": 0}
        status, private = server.call("/v1/chat/completions", {**ask, "store": False})
        assert status == 200 and index.tokens == 0  # not kept
        status, kept = server.call("/v1/chat/completions", ask)
        assert status == 200 and index.tokens > 0
        status, again = server.call("/v1/chat/completions", ask)
        assert status == 200 and index.hits > 0
        text = [json.loads(raw)["choices"][0]["message"]["content"] for raw in (private, kept, again)]
        assert text[0] == text[1] == text[2]  # drafted or not, the same answer
        metrics = server.call("/metrics")[1]
        assert f'selfspec_suffix_index{{part="bytes"}} {float(index.nbytes)}' in metrics
        assert 'selfspec_suffix_index{part="sequences"} 2.0' in metrics  # kept and again, not private
    finally:
        server.close()


def test_scoped_indexes_keep_each_scopes_answers_to_itself() -> None:
    model = tiny_model(3, vocab=VOCAB)
    drafter = SuffixDrafter(SuffixIndex(0), scoped_bytes=2**20)
    engine = SpeculativeEngine(model, drafter)
    prompt = prompt_for(7, 12, VOCAB)
    cfg = DecodeConfig(max_new_tokens=40, adaptive=False, max_depth=8, max_nodes=16)
    first = engine.generate(prompt, DecodeConfig(**{**cfg.__dict__, "scope": "a"}))
    other = engine.generate(prompt, DecodeConfig(**{**cfg.__dict__, "scope": "b"}))
    again = engine.generate(prompt, DecodeConfig(**{**cfg.__dict__, "scope": "a"}))
    assert first.tokens == other.tokens == again.tokens == hf_greedy(model, prompt, 40)
    a, b = drafter.scoped["a"], drafter.scoped["b"]
    assert a.hits > 0 and b.hits == 0  # b never drew on a's answer; a's second request did
    assert len(a.seqs) == 2 and len(b.seqs) == 1 and drafter.index.tokens == 0  # none shared
    assert other.stats.mean_accepted == pytest.approx(first.stats.mean_accepted)  # b drafted as a did the first time
    assert again.stats.mean_accepted > first.stats.mean_accepted + 1


def test_a_server_with_suffix_scope_key_keeps_each_api_keys_answers_apart() -> None:
    pytest.importorskip("uvicorn")
    from conftest import Live

    server = Live("tiny", smooth=False, drafter=lambda model, tokenizer: SuffixDrafter(SuffixIndex(0),
                                                                                         scoped_bytes=2**20),
                  api_keys=("alpha", "beta"), suffix_scope="key")
    drafter = server.engine.drafter
    ask = {"messages": [{"role": "user", "content": "Say something long"}], "model": "tiny", "max_tokens": 24,
           "temperature": 0}

    def as_key(key: str) -> dict:
        return {"Authorization": f"Bearer {key}"}

    try:
        texts = []
        for key in ("alpha", "beta", "alpha"):
            status, raw = server.call("/v1/chat/completions", ask, as_key(key))
            assert status == 200
            texts.append(json.loads(raw)["choices"][0]["message"]["content"])
        assert texts[0] == texts[1] == texts[2]
        assert sorted(len(i.seqs) for i in drafter.scoped.values()) == [1, 2]  # alpha's two answers, beta's one
        hits = sorted(i.hits for i in drafter.scoped.values())
        assert hits[0] == 0 and hits[1] > 0  # beta's request found nothing of alpha's; alpha's second found its first
        metrics = server.call("/metrics", headers=as_key("beta"))[1]
        assert 'selfspec_suffix_index{part="scopes"} 3.0' in metrics  # the unused shared one and two keys'
    finally:
        server.close()


def test_a_replay_accepts_the_longest_matching_path_and_remembers_answers() -> None:
    from selfspec.tree import from_paths
    from selfspec_eval.suffix_replay import accepted, replay

    tree = from_paths(0, [[1, 2, 3], [1, 4]])
    assert accepted(tree, [1, 2, 9]) == 2 and accepted(tree, [1, 4, 4]) == 2 and accepted(tree, [5]) == 0
    answer = [7, 8, 9, 10, 11, 12] * 3
    once = replay(SuffixDrafter(), [([1, 2, 3], answer)], depth=8, nodes=16)
    twice = replay(SuffixDrafter(), [([1, 2, 3], answer), ([1, 2, 3], answer)], depth=8, nodes=16)
    assert once[0] == twice[0] and twice[1][1] < twice[0][1]  # the second asking is drafted from the first answer
    assert twice[1][1] == 2  # 18 tokens in passes of 8 drafted + 1: whole continuations from the first answer
