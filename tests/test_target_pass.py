"""The row (static) and compiled target passes give the eager pass's output: the core invariant on every path.

Every test runs on each backend. The compiled backend builds one graph per tree-size bucket per model,
so its tests share one model and one pass object (``shared_pass``) to compile each bucket once.
"""

from __future__ import annotations

import pytest
import torch

from conftest import OracleTreeDrafter, hf_greedy, tiny_model
from selfspec.drafters.draft_model import DraftModelDrafter
from selfspec.drafters.prompt_lookup import PromptLookupDrafter
from selfspec.engine import DecodeConfig, SpeculativeEngine
from selfspec.errors import SelfspecError
from selfspec.stats import GenerationStats
from selfspec.target import RowPass, make_target_pass
from selfspec.target.common import ancestor_block, bucket_for

BACKENDS = ["eager", "static", "compiled"]
MODEL_SEED = 21


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_model(MODEL_SEED)


@pytest.fixture(scope="module")
def passes(model) -> dict:
    """One pass object per backend for the module's model (compiled graphs are built once). The compiled pass
    traces dense modules and the static one packs its model's linears: the compiled one gets its own copy."""
    return {b: make_target_pass(tiny_model(MODEL_SEED) if b == "compiled" else model, b) for b in BACKENDS}


def _prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(500 + seed)
    base = torch.randint(0, 64, (max(n // 2, 1),), generator=g).tolist()
    return (base * 3)[:n]


@pytest.mark.parametrize("backend", BACKENDS)
def test_plain_decoding_matches_hf(model, passes, backend: str) -> None:
    for seed in range(2):
        prompt = _prompt(seed, 11)
        got = SpeculativeEngine(model, None, backend=passes[backend]).generate(prompt, DecodeConfig(max_new_tokens=30))
        assert got.tokens == hf_greedy(model, prompt, 30)
        assert got.stats.target_pass == backend and got.stats.dtype == "float32"


@pytest.mark.parametrize("backend", BACKENDS)
def test_tree_drafts_are_lossless(model, passes, backend: str) -> None:
    for seed in range(4):
        prompt = _prompt(seed, 9)
        expected = hf_greedy(model, prompt, 40)
        drafter = OracleTreeDrafter(prompt + expected, vocab=64, seed=seed)
        cfg = DecodeConfig(max_new_tokens=40, max_depth=5, max_nodes=12, adaptive=False)
        got = SpeculativeEngine(model, drafter, backend=passes[backend]).generate(prompt, cfg)
        assert got.tokens == expected
        assert got.stats.mean_accepted > 1.5  # speculation really happened


@pytest.mark.parametrize("backend", BACKENDS)
def test_chains_and_lookup_are_lossless(model, passes, backend: str) -> None:
    prompt = _prompt(3, 20)
    expected = hf_greedy(model, prompt, 36)
    for drafter in (DraftModelDrafter(tiny_model(77, layers=1)), PromptLookupDrafter()):
        cfg = DecodeConfig(max_new_tokens=36, max_depth=4, adaptive=False)
        assert SpeculativeEngine(model, drafter, backend=passes[backend]).generate(prompt, cfg).tokens == expected


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("position", [0, 4])
def test_eos_inside_an_accepted_draft_stops_there(model, passes, backend: str, position: int) -> None:
    prompt = _prompt(5, 8)
    free = hf_greedy(model, prompt, 24)
    eos = free[position]
    expected = free[: free.index(eos) + 1]
    drafter = OracleTreeDrafter(prompt + free, vocab=64, seed=1, corrupt=0.0)
    cfg = DecodeConfig(max_new_tokens=24, max_depth=6, adaptive=False, eos_token_ids=(eos,))
    assert SpeculativeEngine(model, drafter, backend=passes[backend]).generate(prompt, cfg).tokens == expected


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("max_new", [1, 2, 7])
def test_max_new_tokens_edge(model, passes, backend: str, max_new: int) -> None:
    prompt = _prompt(2, 8)
    drafter = OracleTreeDrafter(prompt + hf_greedy(model, prompt, 20), vocab=64, seed=2, corrupt=0.0)
    cfg = DecodeConfig(max_new_tokens=max_new, max_depth=4, adaptive=False)
    got = SpeculativeEngine(model, drafter, backend=passes[backend]).generate(prompt, cfg)
    assert got.tokens == hf_greedy(model, prompt, max_new)


def test_static_cache_is_reused_and_grown_across_requests(model) -> None:
    target = RowPass(model, buckets=(1, 4, 16))  # one row that grows: the static backend
    engine = SpeculativeEngine(model, PromptLookupDrafter(), backend=target)
    short, long = _prompt(0, 6), _prompt(1, 20)
    first = engine.generate(short, DecodeConfig(max_new_tokens=10)).tokens
    size = target.max_len
    assert engine.generate(long, DecodeConfig(max_new_tokens=600)).tokens == hf_greedy(model, long, 600)
    assert target.max_len > size  # grown for the longer request
    assert engine.generate(short, DecodeConfig(max_new_tokens=10)).tokens == first  # stale slots never seen


def test_a_newer_request_invalidates_an_older_ones_cache(model) -> None:
    engine = SpeculativeEngine(model, None, backend="static")
    stats = GenerationStats()
    older = engine.steps(_prompt(0, 6), DecodeConfig(max_new_tokens=5), stats)
    next(older)
    engine.generate(_prompt(1, 6), DecodeConfig(max_new_tokens=3))
    with pytest.raises(SelfspecError, match="newer request"):
        next(older)
    assert stats.new_tokens == 1


def test_precompile_builds_the_graphs_a_request_then_uses(model, passes) -> None:
    """The bench's warm-up: after ``precompile`` a request of that size and tree budget compiles nothing new."""
    compiled = passes["compiled"]
    assert compiled.precompile(64, 12, ()) > 0
    built = set(compiled.compiled_shapes)
    assert {b for b, _ in built} >= {1, 4, 8, 16}
    drafter = OracleTreeDrafter(_prompt(2, 9) + hf_greedy(model, _prompt(2, 9), 40), vocab=64, seed=2)
    cfg = DecodeConfig(max_new_tokens=40, max_depth=5, max_nodes=12, adaptive=False)
    SpeculativeEngine(model, drafter, backend=compiled).generate(_prompt(2, 9), cfg)
    assert compiled.compiled_shapes == built


def test_buckets_and_the_padded_mask() -> None:
    assert [bucket_for(n, (1, 4, 16)) for n in (1, 2, 4, 5, 16)] == [1, 4, 4, 16, 16]
    with pytest.raises(SelfspecError, match="largest bucket"):
        bucket_for(17, (1, 4, 16))
    block = ancestor_block([-1, 0, 0, 1], 6)  # root, two children, a grandchild; 2 padding rows
    assert block[3].tolist() == [True, True, False, True, False, False]
    assert block[2].tolist() == [True, False, True, False, False, False]
    assert block[5].tolist() == [False] * 5 + [True]  # padding sees only itself


def test_unknown_backend_is_one_clear_error(model) -> None:
    with pytest.raises(SelfspecError, match="unknown target pass"):
        SpeculativeEngine(model, None, backend="fast")


