"""A soak at smoke size (``python -m selfspec_eval.soak`` against a tiny in-process server): a few hundred requests
with fresh prompts, mixed lengths, greedy and sampled, streamed and not, from concurrent clients, all answered;
afterwards every per-request structure of the server is empty again and every bounded cache is within its bound."""

from __future__ import annotations

import argparse
import json
import os

import pytest
from conftest import Live, perturb
from selfspec_eval import soak

from selfspec.checkpoint import load_heads, save_heads
from selfspec.heads import init_heads
from selfspec.heads.eagle_drafter import CONTEXT_ROWS_CACHED

pytest.importorskip("uvicorn")
pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_verdict_reads_growth_over_the_second_half() -> None:
    rows = [{"rss_mib": m} for m in (100, 150, 200, 200, 201, 201.5)]
    flat = soak.verdict(rows, 0.01)
    assert flat["flat"] is True and flat["from_mib"] == 200 and flat["to_mib"] == 201.5
    assert flat["slope_mib_per_min"] == 0.75  # the least-squares line through 200, 201, 201.5
    assert soak.slope([5, 5, 5, 5]) == 0 and soak.slope([1, 0, 1, 0]) < 0
    assert soak.verdict(rows + [{"rss_mib": 230}], 0.01)["flat"] is False
    assert soak.verdict(rows[:3], 0.01)["flat"] is None


def test_a_few_hundred_fresh_requests_leave_every_structure_within_its_bounds(tmp_path, monkeypatch) -> None:
    def heads(model, tokenizer):
        save_heads(perturb(init_heads("eagle", model), 1), model, tmp_path / "heads", tokenizer=tokenizer,
                   base_name="tiny")
        return load_heads(model, tmp_path / "heads", tokenizer)[1]

    server = Live("tiny", batch=4, drafter=heads, smooth=False)
    engine = server.engine
    if engine.prefix is not None:
        engine.prefix.max_bytes = 64 * 2**10  # small, so fresh prompts keep evicting
    monkeypatch.setattr(soak, "questions", lambda model: [f"Question {i}: what comes next?" for i in range(20)])
    args = argparse.Namespace(model="tiny", server="", url=f"http://127.0.0.1:{server.port}", pid=os.getpid(),
                              clients=4, minutes=10.0, interval=2.0, max_requests=240, max_growth=0.01, seed=0,
                              out=str(tmp_path / "soak.json"))
    try:
        assert soak.run(args) == 0  # every request answered 200
        worker = server.app.state.server.worker
        assert not worker.active and not engine.busy
        assert (engine.waiting, engine.joining, engine.running, engine.target.claimed) == ([], [], [], [])
        if engine.prefix is not None:
            assert 0 < engine.prefix.nbytes <= engine.prefix.max_bytes
        drafter = engine.drafter
        assert drafter.head_rows.rows == 0  # every request gave its head-cache row back
        assert len(drafter.row_cache) <= CONTEXT_ROWS_CACHED
        for weight, _ in drafter.row_cache.values():  # each cached LM-head row holds its own bytes, not a batch's
            assert weight.untyped_storage().nbytes() == weight.numel() * weight.element_size()
    finally:
        server.close()
    result = json.loads((tmp_path / "soak.json").read_text())
    assert result["requests"] == {"200": 240} and result["minutes"]
    if "malloc_in_use" in result["minutes"][-1]["parts"]:  # glibc: the heap in use and free over the second half
        assert result["heap"]["malloc_in_use"]["to_mib"] > 0 and result["heap"]["malloc_free"] is not None
    table = soak.summary({"smoke": result}, at=(m["minute"] for m in result["minutes"][:2])).splitlines()
    assert table[2].startswith("| smoke | 240 x 200 | ") and len(table) == 3
    parts = result["minutes"][-1]["parts"]  # /metrics: the memory by part, each cache as accounted and as held
    assert parts["kv_cache"] > 0 and parts["lm_rows_cache_entries"] <= CONTEXT_ROWS_CACHED
    if engine.prefix is not None:
        assert parts["prefix_cache_held"] == parts["prefix_cache"] <= parts["prefix_cache_max"] == 0.06


def test_kernel_cache_counts_what_onednn_compiled_in_each_round() -> None:
    from selfspec_eval.kernel_cache import ROUND, count_misses

    miss = "onednn_verbose,v1,primitive,create:cache_miss,cpu,{},brg_matmul:avx512_core_bf16,undef,src,,mb9ic8oc8,0.1"
    hit = miss.replace("cache_miss", "cache_hit")
    lines = [miss.format("reorder"), miss.format("inner_product"), ROUND + '{"round": "start"}',
             miss.format("inner_product"), hit.format("inner_product"), miss.format("matmul"),
             ROUND + '{"round": 0, "malloc_in_use": 12.5}', hit.format("matmul"), ROUND + '{"round": 1}']
    rounds = count_misses(lines)
    assert [r["compiled"] for r in rounds] == [2, 2, 0]
    assert rounds[1] == {"round": 0, "malloc_in_use": 12.5, "compiled": 2, "by_kind": {"inner_product": 1, "matmul": 1}}
