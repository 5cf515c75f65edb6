"""The decoder loop (``selfspec/target/decoder.py``): the exact pass's layers run as one loop of the model's own
modules give the bits of the model's own forward; layers of another form are refused; a loop that computed
anything else would be caught at its first pass, the model's own forward then running every pass."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from conftest import hf_greedy, make_tokenizer, tiny_model
from selfspec.engine import DecodeConfig, SpeculativeEngine
from selfspec.target import RowPass
from selfspec.target import decoder as loop, row_ops
from selfspec.tree import DraftTree


TREES = [([5, 6, 7, 8], [-1, 0, 1, 2]), ([9, 1, 2, 3, 4], [-1, 0, 0, 1, 2]), ([11], [-1])]  # chain, tree, root


def _pass(p: RowPass, trusted: bool, layers: tuple[int, ...], which: tuple[int, ...] = (0, 1, 2)) -> list:
    """One batched pass over requests ``which`` (a chain, a branching tree, a lone root), the loop on or off."""
    p.target.loop.trusted = trusted
    items = [(p.claimed[i], DraftTree(torch.tensor(TREES[i][0]), TREES[i][1])) for i in which]
    return p.verify_batch(items, layers)


def _prefilled(arch: str, dtype: torch.dtype, fused: bool) -> RowPass:
    model = tiny_model(3, arch=arch).to(dtype)
    p = RowPass(model, max_batch=3, context=200)
    assert p.exact and loop.fits(p.target.decoder) is None
    if not fused:
        p.target.loop.ops = None  # as where the extension cannot be built
    g = torch.Generator().manual_seed(1)
    for n in (40, 7, 75):
        p.prefill(p.new_cache(200), torch.randint(0, 64, (n,), generator=g), layers=(1,))
    assert p.target.loop.trusted is True  # the first prompt forward ran both ways and agreed
    return p


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_through_the_modules_the_loop_gives_the_models_own_bits(arch: str, dtype: torch.dtype) -> None:
    p = _prefilled(arch, dtype, fused=False)
    for layers in ((), (1, -1), (0, 2)):
        for a, b in zip(_pass(p, True, layers), _pass(p, False, layers)):
            assert torch.equal(a.logits, b.logits)
            assert all(torch.equal(x, y) for x, y in zip(a.hidden_states or (), b.hidden_states or ()))
            assert (a.hidden_states is None) == (not layers)


@pytest.mark.skipif(row_ops.ops() is None, reason="the row operations cannot be built here")
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_through_the_row_operations_each_row_keeps_its_bits_in_any_pass(arch: str, dtype: torch.dtype) -> None:
    """The extension rounds a norm or an activation now and then otherwise than the modules (close to the model's
    forward), and gives every request the same bits whoever shares its pass: what exactness needs."""
    p = _prefilled(arch, dtype, fused=True)
    assert p.target.loop.ops is not None
    together, theirs = _pass(p, True, (1, -1)), _pass(p, False, (1, -1))
    for i, (a, b) in enumerate(zip(together, theirs)):
        alone = _pass(p, True, (1, -1), (i,))[0]
        assert torch.equal(a.logits, alone.logits)
        assert all(torch.equal(x, y) for x, y in zip(a.hidden_states, alone.hidden_states))
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        torch.testing.assert_close(a.logits, b.logits, atol=tol * b.logits.abs().max(), rtol=0)


def test_layers_of_another_form_are_refused() -> None:
    model = tiny_model(3)
    assert loop.fits(model.model) is None
    model.model.layers[1].self_attn.q_norm = torch.nn.LayerNorm(8)  # a norm on the queries, as Qwen3 has
    assert "q/k/v/o projections alone" in loop.fits(model.model)
    model = tiny_model(3)
    model.model.layers[0].extra_norm = torch.nn.LayerNorm(32)
    assert "extra_norm" in loop.fits(model.model)
    model = tiny_model(3)
    before = getattr(model.config, "layer_types", None)
    model.config.layer_types = ["sliding_attention", "full_attention"]
    assert "whole context" in loop.fits(model.model)
    engine = SpeculativeEngine(model, None)  # refused: the model's own forward runs, output as before
    assert engine.target.target.loop is None
    prompt = [3, 1, 4, 1, 5, 9]
    model.config.layer_types = before
    assert engine.generate(prompt, DecodeConfig(max_new_tokens=12)).tokens == hf_greedy(model, prompt, 12)


class _NoRope:
    """The row operations, rotary positions left out."""

    def __init__(self, ops) -> None:
        self.rms_norm, self.add_rms_norm_, self.silu_mul = ops.rms_norm, ops.add_rms_norm_, ops.silu_mul

    def rope_(self, *args) -> None:
        return None


@pytest.mark.parametrize("fused", [False, True])
def test_a_loop_that_breaks_the_arithmetic_is_caught_at_its_first_pass(monkeypatch, caplog, fused: bool) -> None:
    """The negative control: a loop leaving out the rotary positions differs from the model's forward; the first pass
    finds it, says so, and every pass then runs the model's own forward: output stays transformers' greedy."""
    if fused and row_ops.ops() is None:
        pytest.skip("the row operations cannot be built here")
    model = tiny_model(4)
    prompt = [7, 3, 9, 3, 7, 3, 9, 1]
    expected = hf_greedy(model, prompt, 20)
    monkeypatch.setattr(loop, "rotary", lambda attn: lambda q, k, cos, sin: (q, k))
    monkeypatch.setattr(loop, "row_ops", lambda: _NoRope(row_ops.ops()) if fused else None)
    engine = SpeculativeEngine(model, None)
    assert (engine.target.target.loop.ops is not None) == fused
    with caplog.at_level(logging.WARNING, logger="selfspec.target.common"):
        assert engine.generate(prompt, DecodeConfig(max_new_tokens=20)).tokens == expected
    assert engine.target.target.loop.trusted is False
    assert "computed other states" in caplog.text


class _RowVariant(_NoRope):
    """The row operations with a norm whose last bits depend on how many rows share its call."""

    def __init__(self, ops) -> None:
        super().__init__(ops)
        self.rope_ = ops.rope_
        self.rms_norm = lambda x, w, eps: ops.rms_norm(x, w, eps) * (1 + 2.0 ** -23 * x.shape[0])


@pytest.mark.skipif(row_ops.ops() is None, reason="the row operations cannot be built here")
def test_a_row_operation_that_depends_on_the_pass_is_caught(monkeypatch) -> None:
    """The negative control of the row-invariance check above: a norm within rounding of the model's forward (so
    the loop is trusted) whose bits depend on the pass's rows gives a request other logits beside others."""
    monkeypatch.setattr(loop, "row_ops", lambda: _RowVariant(row_ops.ops()))
    p = _prefilled("llama", torch.float32, fused=True)
    together, alone = _pass(p, True, ()), _pass(p, True, (), (0,))
    assert not torch.equal(together[0].logits, alone[0].logits)


def test_the_loop_can_be_turned_off(monkeypatch) -> None:
    monkeypatch.setenv("SELFSPEC_DECODER_LOOP", "0")
    model = tiny_model(3)
    engine = SpeculativeEngine(model, None)
    assert engine.target.target.loop is None
    prompt = [2, 7, 1, 8, 2, 8]
    assert engine.generate(prompt, DecodeConfig(max_new_tokens=12)).tokens == hf_greedy(model, prompt, 12)


def test_pass_shapes_times_both_ways(tmp_path, capsys) -> None:
    """``pass_shapes --compare-loop`` times each pass through transformers' forward and through the loop."""
    from selfspec_eval import pass_shapes

    folder = tmp_path / "tiny"
    tiny_model(0, vocab=272).save_pretrained(folder)
    make_tokenizer().save_pretrained(folder)
    assert pass_shapes.main(["--model", str(folder), "--dtype", "float32", "--shapes", "2x1,3x4", "--repeats", "1",
                             "--compare-loop"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(out) == {"2x1", "3x4"} and all(r["ms"] > 0 and r["transformers_ms"] > 0 for r in out.values())
