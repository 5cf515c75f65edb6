"""Packed linears (oneDNN's weight layout): same products, reversible bit for bit, counted as the same bytes, and the
static target pass that uses them still decodes exactly what plain greedy decoding does."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import hf_greedy, tiny_model
from selfspec.divergence import float32_copy
from selfspec.engine import DecodeConfig, SpeculativeEngine
from selfspec.frozen import lm_head, lm_head_rows
from selfspec.memory import predict_target
import selfspec.target.packed_linear as packed_linear_module
from selfspec.serve import footprint
from selfspec.memory import weight_numel
from selfspec.target.packed_linear import (PackedLinear, dense_linears, is_packed, linear_modules, pack_linears,
                                           unpack_linears)
from selfspec.target import make_target_pass

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN not in this torch build")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_computes_the_dense_product(dtype, bias):
    torch.manual_seed(0)
    linear = nn.Linear(48, 80, bias=bias).to(dtype)
    packed = PackedLinear(linear)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for shape in [(1, 48), (5, 48), (16, 48), (2, 7, 48)]:
        x = torch.randn(shape, dtype=dtype)
        torch.testing.assert_close(packed(x), linear(x), atol=tol, rtol=tol)
    back = packed.to_linear()
    assert torch.equal(back.weight, linear.weight)
    assert bias == (back.bias is not None) and (not bias or torch.equal(back.bias, linear.bias))


def test_row_limits_run_the_rows_of_every_leading_dimension_in_chunks_and_lone_rows_padded(monkeypatch):
    """``max_rows`` counts the rows of a batched (B, tokens, in) input, not its last-but-one dimension; ``min_rows``
    runs fewer rows beside zero rows; the results are the unlimited module's (each row sliced back in place)."""
    torch.manual_seed(0)
    packed = PackedLinear(nn.Linear(48, 80, bias=True))
    calls = []
    real = packed._matmul
    monkeypatch.setattr(packed, "_matmul", lambda x: calls.append(x.shape[0] if x.dim() == 2 else x.shape) or real(x))
    x = torch.randn(4, 8, 48)
    want = packed(x)
    packed.max_rows = 8
    calls.clear()
    torch.testing.assert_close(packed(x), want, atol=0, rtol=0)
    assert calls == [8, 8, 8, 8]  # 32 rows in chunks of 8 (the old split of the 8 tokens ran one 32-row call)
    packed.max_rows, packed.min_rows = 0, 2
    calls.clear()
    one = torch.randn(1, 1, 48)
    assert packed(one).shape == (1, 1, 80)
    torch.testing.assert_close(packed(one), real(one), atol=1e-5, rtol=1e-5)
    assert calls[0] == 2  # the lone row ran beside a zero row
    calls.clear()
    packed(x)
    assert calls == [(4, 8, 48)]  # enough rows: one call, untouched


def test_packed_matmuls_run_on_a_row_grid_that_keeps_the_exact_row_sizes(monkeypatch):
    """Every row count reaches oneDNN as one of a few grid sizes (oneDNN compiles and keeps a kernel per shape), the
    exact pass's self-tested sizes untouched, each row's result the on-grid call's (padding rows dropped)."""
    from selfspec.target.exact import ROW_SIZES

    assert all(packed_linear_module.grid_rows(r) == r for r in ROW_SIZES)
    torch.manual_seed(0)
    packed = PackedLinear(nn.Linear(48, 80, bias=True).to(torch.bfloat16))
    seen = set()
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(packed_linear_module, "_pointwise", lambda x, *a: seen.add(x.shape[0]) or real(x, *a))
    x = torch.randn(1100, 48, dtype=torch.bfloat16)
    for rows in range(1, 1100, 3):
        out = packed(x[:rows])
        assert out.shape == (rows, 80)
    assert len(seen) <= 64 and max(seen) <= 1152
    on_grid = packed(x[:24])
    assert torch.equal(packed(x[:21]), on_grid[:21])  # 21 rows run as 24: the same bits for each of them
    assert torch.equal(packed(x[:21].view(3, 7, 48)), on_grid[:21].view(3, 7, 80))


def test_dense_16_bit_linears_run_on_the_grid_too(monkeypatch):
    """A drafter's own context rows (any number of output rows) beside any number of input rows: each call reaches
    the matmul at grid shapes, the results those of the unpadded product."""
    torch.manual_seed(0)
    real = nn.functional.linear
    seen = set()
    monkeypatch.setattr(nn.functional, "linear",
                        lambda x, w, b=None: seen.add((x.shape[0], w.shape[0])) or real(x, w, b))
    for rows, out, bias in [(1, 1, False), (3, 5, True), (13, 70, True), (40, 64, False)]:
        x, w = torch.randn(rows, 48, dtype=torch.bfloat16), torch.randn(out, 48, dtype=torch.bfloat16)
        b = torch.randn(out, dtype=torch.bfloat16) if bias else None
        torch.testing.assert_close(packed_linear_module.linear(x, w, b), real(x, w, b), atol=2e-2, rtol=2e-2)
    assert all(packed_linear_module.grid_rows(r) == r and o % packed_linear_module.OUT_STEP == 0 for r, o in seen)
    seen.clear()
    packed_linear_module.linear(torch.randn(3, 48), torch.randn(5, 48))  # float32: MKL, which keeps no kernels
    assert seen == {(3, 5)}


@pytest.mark.skipif(footprint.malloc_bytes() == {}, reason="reads glibc's heap (mallinfo2)")
def test_matmuls_of_hundreds_of_row_counts_leave_the_heap_flat():
    """A server meets every row count (prompts, drafted features): off the grid, oneDNN kept a compiled kernel of
    ~0.6 MiB for each (SmolLM2's 576 x 1536 linear: +120 MiB over 200 row counts), a slow growth a soak saw."""
    torch.manual_seed(0)
    packed = PackedLinear(nn.Linear(576, 1536, bias=False).to(torch.bfloat16))
    x = torch.randn(300, 576, dtype=torch.bfloat16)
    for rows in range(1, 101):
        packed(x[:rows])
    before = footprint.malloc_bytes()["malloc_in_use"]
    for rows in range(101, 301):
        packed(x[:rows])
    assert footprint.malloc_bytes()["malloc_in_use"] - before < 40 * 2**20


def test_a_compiled_graph_calls_the_packed_matmul_as_one_opaque_operator():
    """Compiled code shares the module's packed weight (no copy per graph) and computes exactly its product."""
    torch.manual_seed(1)
    block = nn.Sequential(nn.Linear(24, 40), nn.SiLU(), nn.Linear(40, 24)).to(torch.bfloat16)
    pack_linears(block)
    x = torch.randn(3, 24, dtype=torch.bfloat16)
    eager = block(x)
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(block, backend=backend, dynamic=False)
    assert torch.equal(compiled(x), eager)
    ops = [n.target for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert ops.count(torch.ops.selfspec.packed_linear) == 2  # the dynamo graph: the op packet
    assert torch.equal(torch.ops.selfspec.packed_linear(x, block[0].key), block[0].eager_forward(x))


@pytest.mark.parametrize("tie", [False, True])
def test_pack_and_unpack_are_exact_and_tied_output_embeddings_stay_dense(tie):
    model = tiny_model(3, tie=tie)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    numel, predicted = weight_numel(model), predict_target(model)
    head = model.get_output_embeddings()
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    dense_logits = model(ids).logits

    assert pack_linears(model) > 0 and is_packed(model)
    if tie:  # the embedding lookup reads the same dense weight
        assert model.get_output_embeddings() is head and isinstance(head, nn.Linear)
    else:
        packed = model.get_output_embeddings()
        assert isinstance(packed, PackedLinear)
        assert torch.equal(packed.rows(), head.weight)
        rows = torch.tensor([7, 0, 63])
        assert torch.equal(packed.rows(rows), head.weight[rows])
        assert torch.equal(lm_head_rows(model, rows)[0], head.weight[rows]) and lm_head(model) is packed
    assert pack_linears(model) == 0  # already packed
    assert weight_numel(model) == numel and predict_target(model) == predicted
    torch.testing.assert_close(model(ids).logits, dense_logits, atol=1e-5, rtol=1e-5)

    unpack_linears(model)
    assert not is_packed(model)
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


def test_a_linear_of_many_rows_is_packed_in_blocks(monkeypatch):
    monkeypatch.setattr(packed_linear_module, "ROW_BLOCK", 16)
    torch.manual_seed(1)
    linear = nn.Linear(24, 70).to(torch.bfloat16)
    packed = PackedLinear(linear)
    assert packed.blocks == 5
    x = torch.randn(3, 24, dtype=torch.bfloat16)
    torch.testing.assert_close(packed(x), linear(x), atol=2e-2, rtol=2e-2)
    rows = torch.tensor([69, 0, 17, 16, 33])
    assert torch.equal(packed.rows(rows), linear.weight[rows]) and torch.equal(packed.rows(), linear.weight)
    assert torch.equal(packed.state_dict()["weight"], linear.weight) and packed.weight_numel() == 24 * 70 + 70
    assert torch.equal(packed.to_linear().weight, linear.weight)


def test_a_packed_model_saves_and_loads_the_dense_state_dict():
    model = tiny_model(8)
    dense = {k: v.clone() for k, v in model.state_dict().items()}
    pack_linears(model)
    state = model.state_dict()
    assert state.keys() == dense.keys() and all(torch.equal(state[k], dense[k]) for k in dense)
    other = tiny_model(9)
    pack_linears(other)
    other.load_state_dict(dense)
    ids = torch.tensor([[2, 4, 6, 8]])
    assert torch.equal(other(ids).logits, model(ids).logits)


def test_dense_linears_is_a_reversible_context():
    model = tiny_model(4)
    pack_linears(model)
    with dense_linears(model):
        assert not is_packed(model)
        assert all(not isinstance(m, PackedLinear) for m in model.modules())
    assert is_packed(model)


def test_dense_linears_swaps_in_modules_kept_from_before_packing():
    model = tiny_model(10)
    kept = linear_modules(model)
    pack_linears(model)
    packed = linear_modules(model)
    with dense_linears(model, kept):
        assert linear_modules(model) == kept  # the very same module objects, nothing converted
    assert linear_modules(model) == packed


def test_packing_is_a_no_op_where_onednn_does_not_apply():
    model = tiny_model(5).to(torch.float16)
    assert pack_linears(model) == 0 and not is_packed(model)


def test_float32_copy_of_a_packed_bf16_model():
    model = tiny_model(6).to(torch.bfloat16)
    pack_linears(model)
    copy = float32_copy(model)
    assert not is_packed(copy) and next(copy.parameters()).dtype == torch.float32
    assert is_packed(model)  # the original is packed again


def test_static_pass_packs_and_still_decodes_plain_greedy():
    reference = tiny_model(7)
    prompt = [3, 8, 1, 4, 4, 9, 2]
    expected = hf_greedy(reference, prompt, 24)
    model = tiny_model(7)
    target = make_target_pass(model, "static")
    assert target.packed and is_packed(model)
    got = SpeculativeEngine(model, None, backend=target).generate(prompt, DecodeConfig(max_new_tokens=24))
    assert got.tokens == expected
    fresh = tiny_model(7)
    assert not make_target_pass(fresh, "static", pack=False).packed and not is_packed(fresh)
