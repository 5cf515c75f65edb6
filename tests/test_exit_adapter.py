"""Early exit with a one-layer adapter (Kangaroo-style): lossless on every pass, starts as the plain exit,
keeps its own caches in step with the committed tokens, trains with the base frozen, saves and loads."""

from __future__ import annotations

import pytest
import torch

from conftest import (ALPHA, SAMPLING_VOCAB, chi_square_pvalue, draw, exact_joint, hf_greedy, perturb, prompt_for,
                      tiny_model)
from selfspec.checkpoint import load_heads, save_heads
from selfspec.drafters.base import DraftContext, DraftRequest
from selfspec.engine import DecodeConfig, SpeculativeEngine
from selfspec.errors import SelfspecError
from selfspec.heads import EarlyExitDrafter, init_heads, make_drafter
from selfspec.sampling import SamplingConfig

pytestmark = pytest.mark.usefixtures("one_thread")
LAYER = {"exit_layer": 1, "adapter": "layer"}
LORA = {"exit_layer": 2, "adapter": "lora", "lora_rank": 4}  # LoRA on the first layers themselves (exit_lora.py)


@pytest.mark.parametrize("adapter", [LAYER, LORA], ids=["layer", "lora"])
@pytest.mark.parametrize("backend", ["eager", "static"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("seed", range(3))
def test_exit_adapter_is_lossless(seed: int, arch: str, backend: str, adapter: dict) -> None:
    model = tiny_model(seed, layers=3, arch=arch)
    prompt = prompt_for(seed)
    expected = hf_greedy(model, prompt, 30)
    drafter = make_drafter(perturb(init_heads("early-exit", model, **adapter), seed, 0.2), model)
    depth = [4, 6, 2][seed]
    cfg = DecodeConfig(max_new_tokens=30, max_depth=depth, max_nodes=depth + 1, adaptive=False)
    got = SpeculativeEngine(model, drafter, backend=backend).generate(prompt, cfg)
    assert got.tokens == expected
    assert got.stats.speculative_steps > 0


@pytest.mark.parametrize("top_k", [1, 4], ids=["chain", "tree"])
@pytest.mark.parametrize("adapter", ["projection", "layer"])
def test_an_untrained_adapter_after_every_layer_accepts_everything(adapter: str, top_k: int) -> None:
    """Exit after the last layer, adapter at its identity start: the draft IS the target (positions, caches,
    tree masks; the projection drafts inside the eager pass's own cache): every drafted depth is accepted (a
    tree's best path may stop short of max_depth)."""
    model = tiny_model(2, layers=3, arch="qwen2")
    drafter = make_drafter(init_heads("early-exit", model, exit_layer=3, adapter=adapter, top_k=top_k), model)
    cfg = DecodeConfig(max_new_tokens=30, max_depth=4, adaptive=False)
    for backend in ("eager", "static"):
        got = SpeculativeEngine(model, drafter, backend=backend).generate(prompt_for(2), cfg)
        assert got.tokens == hf_greedy(model, prompt_for(2), 30)
        by_depth = got.stats.acceptance_by_depth
        assert by_depth == [1.0] * 4 if top_k == 1 else (len(by_depth) >= 2 and set(by_depth) == {1.0})


def test_an_untrained_layer_adapter_drafts_what_the_plain_exit_drafts() -> None:
    model = tiny_model(1, layers=3)
    plain = make_drafter(init_heads("early-exit", model, exit_layer=2, exit_projection=False), model)
    layer = make_drafter(init_heads("early-exit", model, exit_layer=2, adapter="layer"), model)
    ctx = DraftContext(torch.tensor(prompt_for(1, 12)), 11)
    req = DraftRequest(5, 16, SamplingConfig())
    a, _ = plain.propose(plain.start(ctx), ctx, req)
    b, _ = layer.propose(layer.start(ctx), ctx, req)
    assert a.tokens.tolist() == b.tokens.tolist()


@pytest.mark.parametrize("adapter", [LAYER, LORA], ids=["layer", "lora"])
def test_the_adapter_cache_follows_the_committed_tokens(adapter: dict) -> None:
    """Drafting after commits (caches cropped and re-fed) equals drafting from a fresh start at that context."""
    model = tiny_model(2, layers=3)
    drafter = make_drafter(perturb(init_heads("early-exit", model, **adapter), 2, 0.3), model)
    req = DraftRequest(4, 16, SamplingConfig())
    tokens = prompt_for(2, 10)
    ctx = DraftContext(torch.tensor(tokens), len(tokens) - 1)
    state = drafter.start(ctx)
    for extra in ([7, 3], [9], [1, 1, 4]):  # each step: draft, then a commit differing from the draft
        _, state = drafter.propose(state, ctx, req)
        tokens = tokens + extra
        ctx = DraftContext(torch.tensor(tokens), len(tokens) - 1)
        state = drafter.observe(state, ctx)
        incremental, state = drafter.propose(state, ctx, req)
        fresh, _ = drafter.propose(drafter.start(ctx), ctx, req)
        assert incremental.tokens.tolist() == fresh.tokens.tolist()
    assert drafter.kv_bytes_per_token() > 0  # its own caches are counted


@pytest.mark.parametrize("adapter", [LAYER, {**LORA, "exit_layer": 1}], ids=["layer", "lora"])
def test_sampling_with_an_exit_adapter_is_lossless(adapter: dict) -> None:
    target = tiny_model(11, vocab=SAMPLING_VOCAB, hidden=16)
    heads = perturb(init_heads("early-exit", target, **adapter), 3, 0.2)
    engine = SpeculativeEngine(target, make_drafter(heads, target))
    assert chi_square_pvalue(draw(engine, 2, n=1000), exact_joint(target)) > ALPHA


def test_layer_adapter_checkpoint_round_trip(tmp_path) -> None:
    model = tiny_model(3, layers=3, arch="qwen2")
    heads = perturb(init_heads("early-exit", model, exit_layer=2, adapter="layer", adapter_intermediate_size=24), 3)
    folder = save_heads(heads, model, tmp_path / "heads")
    loaded, drafter = load_heads(model, folder)
    assert loaded.config == heads.config and loaded.config.adapter_intermediate_size == 24
    a, b = heads.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    prompt = prompt_for(3)
    got = SpeculativeEngine(model, drafter).generate(prompt, DecodeConfig(max_new_tokens=20, adaptive=False))
    assert got.tokens == hf_greedy(model, prompt, 20)


def test_bad_adapter_settings_are_one_line_errors() -> None:
    model = tiny_model(0, layers=3)
    with pytest.raises(SelfspecError, match="adapter must be one of"):
        init_heads("early-exit", model, adapter="mlp")
    with pytest.raises(SelfspecError, match="adapter_intermediate_size"):
        init_heads("early-exit", model, adapter="layer", adapter_intermediate_size=0)
    with pytest.raises(SelfspecError, match="exit_layer must lie in"):
        init_heads("early-exit", model, adapter="layer", exit_layer=7)


@pytest.mark.parametrize("adapter", ["projection", "layer", "lora"])
def test_a_draft_vocabulary_drafts_only_its_tokens_and_stays_lossless(adapter: str) -> None:
    model = tiny_model(6, layers=3, arch="qwen2")
    heads = perturb(init_heads("early-exit", model, exit_layer=1, adapter=adapter, draft_vocab_size=20), 6, 0.2)
    counts = torch.zeros(64)
    counts[torch.arange(0, 64, 3)] = torch.arange(22, 0, -1, dtype=torch.float)  # ids 0, 3, ..., 57 the 20 most frequent
    heads.set_draft_vocab(counts)
    allowed = set(range(0, 60, 3))
    assert set(heads.draft_ids.tolist()) == allowed
    drafter = make_drafter(heads, model)
    ctx = DraftContext(torch.tensor(prompt_for(6, 12)), 11)
    allowed |= set(prompt_for(6, 12))  # the prompt's own tokens are drafted too
    tree, _ = drafter.propose(drafter.start(ctx), ctx, DraftRequest(6, 16, SamplingConfig()))
    assert set(drafter.rows[0].tolist()) == allowed
    assert len(tree.tokens) == 16 and set(tree.tokens[1:].tolist()) <= allowed  # a dynamic tree, budget filled
    chained = EarlyExitDrafter(model, heads, top_k=1)
    line, _ = chained.propose(chained.start(ctx), ctx, DraftRequest(6, 16, SamplingConfig()))
    assert line.is_chain and len(line.tokens) == 7 and set(line.tokens[1:].tolist()) <= allowed
    prompt = prompt_for(6)
    for backend in ("eager", "static"):
        got = SpeculativeEngine(model, drafter, backend=backend).generate(
            prompt, DecodeConfig(max_new_tokens=30, max_depth=4, adaptive=False))
        assert got.tokens == hf_greedy(model, prompt, 30)
    assert drafter.adapter.config.copied_parameters(64, 32) == 20 * 32  # the rows the memory prediction counts
    with pytest.raises(SelfspecError, match="draft_vocab_size must lie in"):
        init_heads("early-exit", model, draft_vocab_size=65)


@pytest.mark.parametrize("top_k", [1, 3], ids=["sampled-chain", "tree"])
def test_sampling_with_a_draft_vocabulary_is_lossless(top_k: int) -> None:
    """A sampled chain reports its q; a top-k tree is deterministic (point masses): both exact."""
    target = tiny_model(12, vocab=SAMPLING_VOCAB, hidden=16)
    heads = perturb(init_heads("early-exit", target, exit_layer=1, draft_vocab_size=5, top_k=top_k), 4, 0.2)
    heads.set_draft_vocab(torch.tensor([5.0, 1, 4, 0, 3, 2, 6, 7]))  # drafts never propose tokens 1, 3, 5
    engine = SpeculativeEngine(target, make_drafter(heads, target))
    assert chi_square_pvalue(draw(engine, 2, n=1000), exact_joint(target)) > ALPHA


def test_a_draft_vocabulary_round_trips(tmp_path) -> None:
    model = tiny_model(3, layers=3)
    heads = init_heads("early-exit", model, exit_layer=2, draft_vocab_size=10)
    heads.set_draft_vocab(torch.arange(64, dtype=torch.float))  # the 10 highest ids
    loaded, _ = load_heads(model, save_heads(heads, model, tmp_path / "heads"))
    assert loaded.draft_ids.tolist() == list(range(54, 64))
