"""The exact target pass: in bf16, every method's greedy output equals plain greedy decoding bit for bit.

The negative controls matter as much: the same runs without the exact pass do differ (so the positive tests can
fail), a row's results do not move when the other rows of its pass change, and the start-up self-test catches a
linear made row-variant on purpose.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import OracleTreeDrafter, hf_greedy, perturb, prompt_for, tiny_model
from selfspec.target import exact, row_attention
from selfspec.drafters.draft_model import DraftModelDrafter
from selfspec.drafters.prompt_lookup import PromptLookupDrafter
from selfspec.engine import DecodeConfig, SpeculativeEngine
from selfspec.heads import init_heads, make_drafter
from selfspec.target.packed_linear import PackedLinear, RowBoundLinear, unpack_linears
from selfspec.target import make_target_pass
from selfspec.tree import DraftTree

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(params=["rows", "torch"])
def attention(request, monkeypatch) -> str:
    """The exact pass attends through the row attention kernel or, as where that cannot be built, torch's kernel
    (one call per key width)."""
    if request.param == "torch":
        monkeypatch.setattr(row_attention, "kernel", lambda: None)
    elif row_attention.kernel() is None:
        pytest.skip("the row attention kernel cannot be built here")
    return request.param

VOCAB, NEW = 256, 40


def bf16_model(seed: int, arch: str) -> nn.Module:
    """A tiny bf16 model with flat logits (near-ties are common: what makes bf16 outputs differ)."""
    model = tiny_model(seed, vocab=VOCAB, layers=3, hidden=64, arch=arch)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.2)
    return model.to(torch.bfloat16)


def drafters(name: str, model: nn.Module, reference: list[int], seed: int):
    if name == "tree64":  # wide random trees up to 64 nodes around the true continuation
        return OracleTreeDrafter(reference, VOCAB, seed, width=8, corrupt=0.5)
    if name == "lookup":
        return PromptLookupDrafter()
    if name == "draft-model":
        return DraftModelDrafter(bf16_model(seed + 100, "llama"))
    hyper = {"eagle": {"top_k": 4, "draft_vocab_size": VOCAB}, "eagle3": {"top_k": 4, "draft_vocab_size": VOCAB},
             "medusa": {}, "early-exit": {"exit_layer": 1}}[name]
    heads = perturb(init_heads(name, model, **hyper), seed, 0.2).to(torch.bfloat16)
    return make_drafter(heads, model)


def outputs(exact_pass: bool, arch: str, drafter: str, seeds=range(3)) -> list[tuple[list[int], list[int]]]:
    """(plain, speculative) greedy outputs for several models and prompts of several lengths."""
    pairs = []
    for seed in seeds:
        model = bf16_model(seed, arch)
        target = make_target_pass(model, "static", exact=exact_pass)
        assert target.exact == exact_pass
        cfg = DecodeConfig(max_new_tokens=NEW, max_depth=6, max_nodes=64, adaptive=False)
        for length in (7, 23):
            prompt = prompt_for(seed + length, length, VOCAB)
            plain = SpeculativeEngine(model, None, backend=target).generate(prompt, cfg).tokens
            d = drafters(drafter, model, prompt + plain, seed)
            res = SpeculativeEngine(model, d, backend=target).generate(prompt, cfg)
            assert res.stats.exact == exact_pass
            pairs.append((plain, res.tokens))
    return pairs


@pytest.mark.parametrize("drafter", ["tree64", "lookup", "draft-model", "eagle", "eagle3", "medusa", "early-exit"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_every_method_equals_plain_bit_for_bit_in_bf16(arch: str, drafter: str, attention: str) -> None:
    for plain, spec in outputs(True, arch, drafter):
        assert spec == plain


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_without_the_exact_pass_bf16_outputs_do_differ(arch: str) -> None:
    """Negative control: the same runs on today's pass round some near-ties the other way."""
    pairs = outputs(False, arch, "tree64", seeds=range(4))
    assert any(spec != plain for plain, spec in pairs)


def _tree(tokens: list[int]) -> DraftTree:
    # root, a 5-deep chain (nodes 1-5), and three branches hanging off the chain
    return DraftTree(torch.tensor(tokens), [-1, 0, 1, 2, 3, 4, 0, 6, 1, 2, 8])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_rows_results_do_not_depend_on_the_other_rows(arch: str, attention: str) -> None:
    """The chain's rows give the same bits whatever the other branches hold, and the same as plain steps."""
    model = bf16_model(7, arch)
    target = make_target_pass(model, "static")
    prompt = torch.tensor(prompt_for(3, 30, VOCAB))
    chain_tokens = [5, 17, 42, 99, 3, 250]
    results = []
    for other in ([1, 2, 3, 4, 5], [200, 100, 50, 25, 12]):
        handle = target.new_cache(64)
        target.prefill(handle, prompt[:-1])
        ver = target.verify(handle, _tree([*chain_tokens, *other]), 29, (-1,))
        results.append((ver.logits[:6], ver.hidden_states[0][:6]))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    handle = target.new_cache(64)
    target.prefill(handle, prompt[:-1])
    for i, tok in enumerate(chain_tokens):  # plain steps along the chain
        ver = target.verify(handle, DraftTree(torch.tensor([tok]), [-1]), 29 + i, (-1,))
        target.keep(handle, 29 + i, [0])
        assert torch.equal(ver.logits[0], results[0][0][i]) and torch.equal(ver.hidden_states[0][0], results[0][1][i])


class RowVariant(nn.Linear):
    """A linear whose kernel changes with the number of rows: from ``above`` rows on, a different summation order
    (the product computed in two halves of the input), as a blocked kernel might."""

    def __init__(self, above: int, in_features: int = 64, out_features: int = 48) -> None:
        super().__init__(in_features, out_features, bias=False, dtype=torch.bfloat16)
        self.above = above

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-2] <= self.above:
            return super().forward(x)
        half = self.in_features // 2
        return (nn.functional.linear(x[..., :half], self.weight[:, :half]).float()
                + nn.functional.linear(x[..., half:], self.weight[:, half:]).float()).to(x.dtype)


def test_the_self_test_detects_a_row_variant_linear(monkeypatch, tmp_path) -> None:
    buckets = (1, 4, 8, 16, 32, 64)
    cpu = torch.device("cpu")
    for above in (64, 8, 16):
        monkeypatch.setattr(exact, "_ROWS", {})  # results are cached per shape, in the process and on disk:
        monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path / str(above)))  # these modules share one
        # the most rows found is the variant's limit; the least (1, or 2 where this CPU's one-row bf16 product
        # rounds otherwise, as a matrix-vector kernel does for some weights) is the CPU's
        assert exact.row_range(RowVariant(above), 64, buckets, cpu, torch.bfloat16)[1] == above


def test_a_dense_linear_row_variant_in_large_passes_runs_in_chunks(monkeypatch, tmp_path) -> None:
    """As SmolLM2's tied (so unpacked) LM head above 32 rows on an AMX CPU: the pass stays exact, and that linear,
    bounded once when the pass is built, runs on at most 16 rows per matmul (sharing the original's weight)."""
    monkeypatch.setattr(exact, "_ROWS", {})
    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path))  # verdicts on faked kernels stay out of the real cache
    model = bf16_model(0, "llama")
    down = model.model.layers[1].mlp.down_proj = RowVariant(16, 128, 64)  # dense (unpacked)
    target = make_target_pass(model, "static", pack=False)
    # (this CPU's own dense bf16 kernels may bound other linears too: some round 8 rows otherwise than 1 or 4)
    assert target.exact and target.support.chunked["model.layers.1.mlp.down_proj"] == 16
    bounded = model.model.layers[1].mlp.down_proj
    assert isinstance(bounded, RowBoundLinear) and bounded.max_rows == 16 and bounded.weight is down.weight
    x = torch.randn(64, 128, dtype=torch.bfloat16)
    small = torch.cat([down.forward(part) for part in x.split(16)])  # the bits of passes of up to 16 rows
    assert not torch.equal(down(x), small)  # the negative control: one large matmul rounds otherwise
    assert torch.equal(bounded(x), small)
    make_target_pass(model, "static", pack=False)  # a second pass on the same model keeps the bounds
    assert model.model.layers[1].mlp.down_proj is bounded and bounded.max_rows == 16


class LoneRowVariant(PackedLinear):
    """A packed linear whose one-row product (a matrix-vector kernel) rounds otherwise than 2 or more rows do."""

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        out = super()._matmul(x)
        return out + torch.finfo(out.dtype).eps * out.abs() if x.numel() == self.in_features else out


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN not in this torch build")
def test_a_packed_linear_that_computes_a_lone_row_otherwise_runs_it_beside_a_zero_row(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(exact, "_ROWS", {})
    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path))
    model = bf16_model(0, "llama")
    make_target_pass(model, "static")  # packs the linears
    mlp = model.model.layers[1].mlp
    mlp.down_proj = LoneRowVariant(nn.Linear(128, 64, bias=False, dtype=torch.bfloat16))
    monkeypatch.setattr(exact, "_ROWS", {})
    x = torch.randn(2, 128, dtype=torch.bfloat16)
    assert not torch.equal(mlp.down_proj(x[:1]), mlp.down_proj(x)[:1])  # the negative control, before the self-test
    support = exact.check_exact(model)
    assert support.exact and support.least == 1  # only it runs on two rows, not the whole pass
    assert support.padded == {"model.layers.1.mlp.down_proj": 2}
    support.bound(model)
    assert mlp.down_proj.min_rows == 2 and torch.equal(mlp.down_proj(x[:1]), mlp.down_proj(x)[:1])
    unpack_linears(model)  # the bound travels with the weight: dense, then packed again
    assert mlp.down_proj.min_rows == 2 and isinstance(mlp.down_proj, RowBoundLinear)


def test_an_attention_kernel_that_batches_rows_differently_is_run_row_by_row(monkeypatch, tmp_path) -> None:
    """If batching rows changed a row's bits, every row gets its own call (the plan's fallback)."""
    real = exact.scaled_dot_product_attention

    def batch_dependent(q, k, v, attn_mask=None, scale=None):  # more than one row's query block in the call
        out = real(q, k, v, attn_mask=attn_mask, scale=scale)
        one_row = q.shape[0] == 1 and q.shape[2] == exact.query_rows(2, 16)
        return out if one_row else out + torch.finfo(out.dtype).eps * out.abs()

    monkeypatch.setattr(exact, "scaled_dot_product_attention", batch_dependent)
    monkeypatch.setattr(exact, "_BATCHED", {})
    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path))
    monkeypatch.setattr(row_attention, "kernel", lambda: None)  # the fallback where the row kernel is not built
    assert not exact.batching_keeps_rows(4, 2, 16, torch.device("cpu"), torch.bfloat16)
    plan = exact.plan_pass([-1, 0, 1, 0], [0, 1, 2, 1], 40, 128, torch.bfloat16, torch.device("cpu"), batched=False)
    assert all(g.rows.numel() == 1 for g in plan.groups)


def test_plans_keep_every_rows_keys_in_plain_order() -> None:
    """A branching row sees the cache, then its ancestors in depth order, then itself; the chain after the root reads
    in place; a path's rows share one gathered key sequence."""
    parents = [-1, 0, 1, 0, 3, 0, 4, 4]
    depth = [0, 1, 2, 1, 2, 1, 3, 3]
    plan = exact.plan_pass(parents, depth, 5, 64, torch.float32, torch.device("cpu"))
    rows = {}
    for g in plan.groups:
        for r, node in enumerate(g.rows.tolist()):
            seen = int((g.mask[r, 0, 0] == 0).sum())
            keys = list(range(g.width)) if g.keys is None else g.keys.tolist()
            rows[node] = (keys[:seen], g.width, g.keys is None)
    assert rows[2] == ([0, 1, 2, 3, 4, 5, 6, 7], 32, True)
    assert rows[3] == ([0, 1, 2, 3, 4, 5, 8], 32, False)
    assert rows[4] == ([0, 1, 2, 3, 4, 5, 8, 9], 32, False)
    assert rows[6] == ([0, 1, 2, 3, 4, 5, 8, 9, 11], 32, False)
    assert rows[7] == ([0, 1, 2, 3, 4, 5, 8, 9, 12], 32, False)
    assert rows[5] == ([0, 1, 2, 3, 4, 5, 10], 32, False)
    assert sorted(g.rows.tolist() for g in plan.groups) == [[0, 1, 2], [3, 4, 6], [5], [7]]  # one group per path
    assert exact.width_for(31, 1000) == 32 and exact.width_for(32, 1000) == 64 and exact.width_for(900, 600) == 600


def test_the_eager_pass_and_no_exact_say_they_are_not_exact() -> None:
    model = bf16_model(1, "llama")
    assert not make_target_pass(model, "eager").exact
    off = make_target_pass(model, "static", exact=False)
    assert not off.exact and "off" in off.support.reason
    stats = SpeculativeEngine(model, None, backend=off).generate([1, 2, 3], DecodeConfig(max_new_tokens=3)).stats
    assert stats.exact is False and stats.to_dict()["exact"] is False



def batch_outputs(arch: str, drafter: str, exact_pass: bool, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """(plain alone, batched) greedy outputs of 8 requests, 4 rows at a time (rows joining and leaving)."""
    from selfspec.batching import BatchEngine

    model = bf16_model(seed, arch)
    prompts = [prompt_for(40 + i, n, VOCAB) for i, n in enumerate((7, 23, 40, 12, 30, 50, 9, 3))]
    cfg = DecodeConfig(max_new_tokens=NEW, max_depth=6, max_nodes=32)
    plain = [SpeculativeEngine(model, None, backend="static").generate(p, cfg).tokens for p in prompts]
    d = None if drafter == "none" else drafters(drafter, model, [], seed)
    batch = BatchEngine(model, d, max_batch=4, context=256, exact=exact_pass)
    assert batch.target.exact == exact_pass
    return plain, [r.tokens for r in batch.generate_batch(prompts, cfg)]


@pytest.mark.parametrize("drafter", ["none", "lookup", "eagle"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_each_row_of_a_batch_equals_plain_bit_for_bit_in_bf16(arch: str, drafter: str, attention: str) -> None:
    """Requests decoded together each get the tokens plain bf16 decoding gives them alone, whoever shares the batch."""
    for seed in (5, 6):
        plain, batched = batch_outputs(arch, drafter, True, seed)
        assert batched == plain


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_without_the_exact_pass_a_batch_changes_some_rows_bf16_tokens(arch: str) -> None:
    assert any(batched != plain for plain, batched in (batch_outputs(arch, "none", False, seed) for seed in (5, 6)))


class OffGrid(nn.Module):
    """A linear whose kernel rounds otherwise (here: a coarser product) for any row count off the row grid, as a
    kernel choosing its path by the number of rows might: only forwards of the grid's sizes give plain-step bits."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features, self.weight = linear.in_features, linear.out_features, linear.weight
        self.off_grid = 0  # forwards seen off the grid

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = nn.functional.linear(x, self.weight)
        if x.numel() // self.in_features in exact.ROW_SIZES:
            return out
        self.off_grid += 1
        return out * (1 + 2 ** -5)


def off_grid_batch(monkeypatch, tmp_path, broken: bool) -> tuple[list[list[int]], list[list[int]], int]:
    """(plain, batched, off-grid forwards): 8 requests 3 at a time through a model with an ``OffGrid`` linear."""
    from selfspec.target import rows as row_pass
    from selfspec.batching import BatchEngine

    monkeypatch.setattr(exact, "_ROWS", {})
    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path))
    if broken:  # the negative control: rows no longer padded onto the grid
        monkeypatch.setattr(row_pass, "grid_rows", lambda rows, nodes: rows)
    model = bf16_model(5, "llama")
    odd = model.model.layers[1].mlp.down_proj = OffGrid(model.model.layers[1].mlp.down_proj)
    prompts = [prompt_for(40 + i, n, VOCAB) for i, n in enumerate((7, 23, 40, 12, 30, 50, 9, 3))]
    cfg = DecodeConfig(max_new_tokens=NEW, max_depth=6, max_nodes=32)
    plain = [SpeculativeEngine(model, None, backend="static").generate(p, cfg).tokens for p in prompts]
    assert odd.off_grid == 0  # plain steps and prompts run on the grid
    batch = BatchEngine(model, PromptLookupDrafter(), max_batch=3, context=256)
    return plain, [r.tokens for r in batch.generate_batch(prompts, cfg)], odd.off_grid


def test_every_batched_forward_runs_on_the_self_tested_row_grid(monkeypatch, tmp_path) -> None:
    """Three requests at a time (3 rows: off the grid) still get plain decoding's tokens, because every pass is padded
    onto the grid; with the padding removed, the same run does run off the grid and changes some tokens."""
    plain, batched, off = off_grid_batch(monkeypatch, tmp_path, broken=False)
    assert off == 0 and batched == plain
    plain, batched, off = off_grid_batch(monkeypatch, tmp_path / "broken", broken=True)
    assert off > 0 and batched != plain


class _Timed(torch.nn.Module):
    """A linear whose time depends on its rows as some kernels' do (2 rows slower than 4)."""

    in_features = out_features = 4

    def forward(self, x):
        import time

        time.sleep({1: 0.03, 2: 0.03, 4: 0.01, 8: 0.02}[x.shape[0]])
        return x


def test_fastest_rows_takes_a_larger_count_only_where_it_is_faster() -> None:
    cpu = torch.device("cpu")
    assert exact._fastest_rows([_Timed(), _Timed()], [1, 2, 4, 8], cpu, torch.float32, reps=1) == 4
    assert exact._fastest_rows([_Timed(), _Timed()], [1, 2], cpu, torch.float32, reps=1) == 1  # no faster one


def test_a_pass_padded_to_its_fastest_rows_keeps_plain_output(monkeypatch) -> None:
    """Where the CPU runs 4 tokens faster than 1 or 2, a plain step runs on 4 (its root and 3 padding nodes): the
    root's bits are those of the rows it would have run alone (the self-test's range), so output is unchanged."""
    monkeypatch.setattr(exact, "FAST_PARAMS", 0)
    monkeypatch.setattr(exact, "on_disk", lambda test, key, run: 4 if test == "fastest_rows" else run())
    model = tiny_model(9)
    engine = SpeculativeEngine(model, None)
    assert engine.target.support.fast == 4 and engine.target.pass_shape(1, 1) == (1, 4)
    assert engine.target.pass_shape(2, 1) == (2, 2) and engine.target.pass_shape(3, 1) == (4, 1)
    prompt = [4, 8, 15, 16, 23, 42]
    assert engine.generate(prompt, DecodeConfig(max_new_tokens=16)).tokens == hf_greedy(model, prompt, 16)
