"""EAGLE-3-style heads: the fused layers follow the target's depth, the weights carry the EAGLE-3 layout's names,
the target passes report exactly the asked layers, training unrolls what drafting does, the cached tree equals
recomputation, and decoding with them is plain greedy decoding on every target pass."""

from __future__ import annotations

import pytest
import torch

from conftest import tree_path, hf_greedy, perturb, prompt_for, tiny_model
from selfspec.drafters.base import DraftContext, DraftRequest
from selfspec.engine import DecodeConfig, SpeculativeEngine, prefill
from selfspec.errors import SelfspecError
from selfspec.heads import init_heads, make_drafter
from selfspec.heads.eagle3 import default_aux_layers
from selfspec.sampling import SamplingConfig
from selfspec.target import make_target_pass
from selfspec.tree import chain

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize(("layers", "expected"), [(2, [1, 1, 1]), (3, [2, 1, 1]), (4, [2, 2, 1]), (6, [2, 3, 3]),
                                                  (8, [2, 4, 5]), (28, [2, 14, 25])])
def test_fused_layers_follow_the_targets_depth(layers: int, expected: list[int]) -> None:
    assert default_aux_layers(layers) == expected
    if layers <= 8:
        model = tiny_model(0, layers=layers)
        head = init_heads("eagle3", model)
        assert head.config.aux_layers == expected and head.fc.in_features == 3 * model.config.hidden_size
        assert make_drafter(head, model).state_layers == tuple(expected)


def test_aux_layers_are_checked() -> None:
    model = tiny_model(0, layers=4)
    with pytest.raises(SelfspecError, match="aux_layers"):
        init_heads("eagle3", model, aux_layers=[1, 2, 9])


def test_weights_carry_the_eagle3_layout_names_and_shapes() -> None:
    model = tiny_model(0, layers=4, hidden=32)
    head = init_heads("eagle3", model, draft_vocab_size=40, intermediate_size=48)
    shapes = {k: tuple(v.shape) for k, v in head.state_dict().items()}
    h, q, kv = 32, 4 * 8, 2 * 8  # 4 heads, 2 KV heads, head_dim 8
    assert shapes == {
        "fc.weight": (h, 3 * h),
        "midlayer.self_attn.q_proj.weight": (q, 2 * h), "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * h), "midlayer.self_attn.o_proj.weight": (h, q),
        "midlayer.mlp.gate_proj.weight": (48, h), "midlayer.mlp.up_proj.weight": (48, h),
        "midlayer.mlp.down_proj.weight": (h, 48),
        "midlayer.input_layernorm.weight": (h,), "midlayer.hidden_norm.weight": (h,),
        "midlayer.post_attention_layernorm.weight": (h,),
        "norm.weight": (h,), "lm_head.weight": (40, h), "d2t": (40,), "t2d": (64,),
    }


def test_draft_vocabulary_offsets_and_mask() -> None:
    model = tiny_model(0, layers=4)
    head = init_heads("eagle3", model, draft_vocab_size=5)
    counts = torch.zeros(64)
    counts[[3, 9, 17, 40, 63]] = torch.tensor([5.0, 4, 3, 2, 1])
    counts[50] = 0.5  # the sixth most frequent: left out
    head.set_draft_vocab(counts)
    assert head.draft_ids().tolist() == [3, 9, 17, 40, 63]
    assert head.d2t.tolist() == [3, 8, 15, 37, 59]  # target id - draft id, as vLLM and SGLang read it
    assert head.t2d.nonzero().flatten().tolist() == [3, 9, 17, 40, 63]
    head.init_lm_head(model)
    assert torch.equal(head.lm_head.weight, model.lm_head.weight[[3, 9, 17, 40, 63]])


@pytest.mark.parametrize("backend", ["eager", "static"])
def test_target_passes_report_the_asked_layers(backend: str) -> None:
    model = tiny_model(2, layers=4)
    prompt = prompt_for(2, 9)
    with torch.no_grad():
        full = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    layers = (2, 3, 1, -1)
    target = make_target_pass(model, backend)
    cache = target.new_cache(32)
    got = target.prefill(cache, torch.tensor(prompt[:6]), layers)
    ver = target.verify(cache, chain(prompt[6], prompt[7:]), 6, layers)
    for states, rows in ((got, slice(0, 6)), (ver.hidden_states, slice(6, 9))):
        assert len(states) == len(layers)
        for h, i in zip(states, layers):
            torch.testing.assert_close(h, full[i][0, rows], atol=1e-5, rtol=1e-5)


def test_unroll_sees_what_drafting_sees() -> None:
    """Unrolled step k, row t equals drafting k steps from root t+1 with the head's own cache (real pairs 0..t)."""
    from selfspec.objectives.eagle3 import eagle3_unroll

    target = tiny_model(3, layers=4)
    head = perturb(init_heads("eagle3", target), 1, 0.1).eval()
    torch.manual_seed(0)
    x = torch.randint(0, 64, (2, 12))
    aux = torch.randn(2, 12, 3 * target.config.hidden_size)
    embed = target.get_input_embeddings()
    with torch.no_grad():
        steps = eagle3_unroll(head, target, aux, x, 3)
        for b in range(2):
            for t in (0, 4, 8):
                cache = head.new_cache()
                out = head(aux[b:b + 1, :t + 1], embed(x[b:b + 1, 1:t + 2]), torch.arange(t + 1)[None], cache,
                           fuse=True)[:, -1:]
                for k in range(1, 4):
                    torch.testing.assert_close(out[0, 0], steps[k - 1][b, t], atol=1e-5, rtol=1e-5)
                    if k < 3:
                        out = head(out, embed(x[b:b + 1, t + k + 1:t + k + 2]), torch.tensor([[t + k]]), cache)


@pytest.mark.parametrize("seed", range(2))
def test_tree_equals_uncached_recomputation(seed: int) -> None:
    """Every node's children are the head's top-k after recomputing its whole path from scratch, no cache."""
    model = tiny_model(seed, layers=4, arch=["llama", "qwen2"][seed % 2])
    head = perturb(init_heads("eagle3", model, top_k=3, draft_vocab_size=40), seed, 0.1)
    drafter = make_drafter(head, model)
    prompt = prompt_for(seed, 11)
    state, hs = prefill(model, torch.tensor(prompt), layers=drafter.state_layers)
    ctx = DraftContext(state.tokens, state.cache_len, hs)
    tree, dstate = drafter.propose(drafter.start(ctx), ctx, DraftRequest(4, 14, SamplingConfig()))
    assert tree.max_depth >= 2 and tree.size == 14
    assert dstate.cache.get_seq_length() == dstate.cached == state.cache_len  # drafted pairs were dropped
    with torch.no_grad():
        real = head.fc(torch.cat(hs, dim=-1))  # fused features of positions 0 .. R-1
        for node in range(tree.size):
            if not tree.children[node]:
                continue
            feats, toks = real, prompt[1:]
            for tok in [None, *tree_path(tree, node)]:  # grow the sequence with the head's own outputs
                if tok is not None:
                    feats, toks = torch.cat([feats, out[None]]), toks + [tok]
                embeds = model.get_input_embeddings()(torch.tensor(toks))
                out = head(feats[None], embeds[None], torch.arange(len(toks))[None])[0, -1]
            top, _ = drafter._top(dstate, out[None], 3)
            kids = [int(tree.tokens[c]) for c in tree.children[node]]
            assert set(kids) <= set(top[0]) and top[0][0] in kids


@pytest.mark.parametrize("backend", ["eager", "static", "compiled"])
@pytest.mark.parametrize(("top_k", "depth", "nodes"), [(1, 5, 6), (3, 4, 12)])  # a chain, a tree
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_equals_plain_greedy_on_every_pass(backend: str, top_k: int, depth: int, nodes: int, arch: str) -> None:
    model = tiny_model(5, layers=5, arch=arch)
    prompt = prompt_for(5, 10)
    expected = hf_greedy(model, prompt, 28)
    head = perturb(init_heads("eagle3", model, top_k=top_k, draft_vocab_size=48), 5, 0.2)
    cfg = DecodeConfig(max_new_tokens=28, max_depth=depth, max_nodes=nodes, adaptive=False)
    got = SpeculativeEngine(model, make_drafter(head, model), backend=backend).generate(prompt, cfg)
    assert got.tokens == expected and got.stats.max_tree_nodes > 1  # drafts were made and checked


@pytest.mark.parametrize("lever", ["feature_weight", "topk_weight"])
def test_each_small_data_lever_adds_its_documented_term(lever: str) -> None:
    """The loss with a lever on minus the loss without is the lever's weight times its term, computed here row by
    row: feature_weight, smooth-L1 of the head's normed output onto the target's state at t + k; topk_weight, the
    cross-entropy to the teacher's probabilities of its top-K draft tokens; each step weighted decay**(k-1)."""
    import torch.nn.functional as F

    from selfspec.objectives.common import lm_logits
    from selfspec.objectives.eagle3 import Eagle3Loss, eagle3_unroll, features, loss

    model = tiny_model(2, vocab=64, layers=3)
    head = perturb(init_heads("eagle3", model, draft_vocab_size=48), 2)
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 64, (2, 10), generator=g)
    batch = {"input_ids": x, "loss_mask": torch.ones_like(x), **features(model, head, x)}
    base, weight = Eagle3Loss(unroll=2, decay=0.5, topk=3), 0.7
    with torch.no_grad():
        on = loss(head, model, batch, Eagle3Loss(unroll=2, decay=0.5, topk=3, **{lever: weight}))[0]
        off = loss(head, model, batch, base)[0]
        steps = eagle3_unroll(head, model, batch["aux"], x, 2)
        ids, by_hand = head.draft_ids(), 0.0
        for k, pred in enumerate(steps, start=1):
            for b in range(2):
                for t in range(10 - k):
                    p = t + k  # the position whose next token step k's row t guesses
                    after = int(x[b, p + 1]) if p + 1 < 10 else int(ids[0])
                    if not head.t2d[after]:
                        continue  # an undraftable next token is not trained on
                    if lever == "feature_weight":
                        term = F.smooth_l1_loss(head.norm(pred[b, t]).float(), batch["f"][b, p].float())
                    else:
                        teacher = F.softmax(lm_logits(model, batch["f"][b, p].float(), ids).float(), -1)
                        logq = F.log_softmax(head.logits(pred[b, t]).float(), -1)
                        top = teacher.topk(3).indices
                        term = -(teacher[top] * logq[top]).sum()
                    by_hand += 0.5 ** (k - 1) * float(term)
    torch.testing.assert_close(float(on - off), weight * by_hand, rtol=1e-4, atol=1e-5)
    assert by_hand > 0


def test_the_unroll_curriculum_grows_one_step_per_stage_and_its_loss_is_that_unrolls() -> None:
    """``curriculum_steps=2, unroll=3``: optimizer steps 0-1 unroll 1 step, 2-3 two, 4 on three; the loss at a step
    is exactly the loss of the plain settings with that unroll (only steps up to it scored)."""
    from selfspec.objectives.common import settings_at
    from selfspec.objectives.eagle3 import Eagle3Loss, features, loss

    plan = Eagle3Loss(unroll=3, curriculum_steps=2)
    assert [settings_at(plan, s).unroll for s in range(7)] == [1, 1, 2, 2, 3, 3, 3]
    assert settings_at(Eagle3Loss(unroll=3), 0) == Eagle3Loss(unroll=3)  # no curriculum: as given
    with pytest.raises(ValueError, match="curriculum_steps"):
        Eagle3Loss(curriculum_steps=-1)
    model = tiny_model(2, vocab=64, layers=3)
    head = perturb(init_heads("eagle3", model, draft_vocab_size=48), 2)
    x = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(3))
    batch = {"input_ids": x, "loss_mask": torch.ones_like(x), **features(model, head, x)}
    with torch.no_grad():
        for step, unroll in ((0, 1), (3, 2), (9, 3)):
            got, parts = loss(head, model, batch, settings_at(plan, step))
            want, want_parts = loss(head, model, batch, Eagle3Loss(unroll=unroll))
            assert torch.equal(got, want)
            assert list(parts) == list(want_parts) == [f"kl{k}" for k in range(1, unroll + 1)]
