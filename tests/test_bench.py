"""selfspec bench: the report's arithmetic, the memory prediction against tensors actually held, budgets."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from selfspec.drafters.draft_model import DraftModelDrafter
from selfspec.drafters.prompt_lookup import PromptLookupDrafter
from selfspec.engine import DecodeConfig, SpeculativeEngine
from selfspec.errors import SelfspecError
from selfspec.heads import init_heads, make_drafter
from selfspec.target.kv_cache import new_cache
from selfspec.memory import (MemoryEstimate, counted_added, counted_bytes, kv_bytes_per_token, max_context,
                             parse_bytes, predict_added, predict_target, storages)
from selfspec.target import make_target_pass
from selfspec.verify import forward_with_cache
from selfspec_eval.budgets import budget_table
from selfspec_eval.metrics import complete_prompts, pooled_acceptance, summarize

pytestmark = pytest.mark.usefixtures("one_thread")


def own_buffer_bytes(drafter, target) -> int:
    """Buffers (rotary tables, index maps) the drafter holds beside the target: counted, but not parameters."""
    theirs = storages(target)
    mods = [v for v in vars(drafter).values() if isinstance(v, torch.nn.Module)]
    bufs = storages([b for m in mods for b in m.buffers() if not b.is_mkldnn])  # packed weights are weights
    return sum(n for ptr, n in bufs.items() if ptr not in theirs)


def _row(prompt, method, n_tokens, seconds, cat="chat", tau=None, reached=(), accepted=(), tokens=None):
    return {"prompt": prompt, "method": method, "category": cat, "tokens": tokens or list(range(n_tokens)),
            "seconds": seconds, "tau": tau, "reached_depth": list(reached), "accepted_at_depth": list(accepted)}


def test_summary_arithmetic():
    rows = [
        _row("a", "hf", 10, 10.0), _row("a", "eagle", 10, 2.0, tau=4.0, reached=[3, 2], accepted=[2, 1]),
        _row("b", "hf", 20, 5.0, cat="code"),
        _row("b", "eagle", 20, 2.0, cat="code", tau=2.0, reached=[1, 0], accepted=[0, 0], tokens=[7] * 20),
        _row("c", "hf", 5, 1.0),  # eagle never ran c: left out of every average
    ]
    s = summarize(rows, ["hf", "eagle"])
    assert s["baseline"] == "hf" and s["questions"] == 2
    overall = s["categories"]["overall"]
    assert overall["hf"]["tokens_per_s"] == pytest.approx((1.0 + 4.0) / 2)  # per-question throughput, then mean
    assert overall["eagle"]["tokens_per_s"] == pytest.approx((5.0 + 10.0) / 2)
    assert overall["eagle"]["speedup"] == pytest.approx(7.5 / 2.5)
    assert overall["eagle"]["tau"] == pytest.approx(3.0)
    assert overall["eagle"]["acceptance_by_depth"] == pytest.approx([2 / 4, 1 / 2])  # pooled counts, not mean of ratios
    assert overall["eagle"]["identical"] == 1 and overall["hf"]["identical"] == 2
    assert s["categories"]["code"]["eagle"]["speedup"] == pytest.approx(10.0 / 4.0)
    assert s["categories"]["chat"]["eagle"]["questions"] == 1
    assert overall["hf"]["tau"] is None


def test_complete_prompts_and_pooling_edges():
    rows = [_row("a", "x", 1, 1.0), _row("a", "y", 1, 1.0), _row("b", "x", 1, 1.0)]
    assert complete_prompts(rows, ["x", "y"]) == ["a"]
    assert pooled_acceptance([_row("a", "x", 1, 1.0)]) == []
    assert pooled_acceptance([_row("a", "x", 1, 1.0, reached=[2, 0], accepted=[0, 0])]) == [0.0, 0.0]
    assert summarize(rows, ["y"])["baseline"] == "y"  # no hf: the first method is the baseline


def test_parse_bytes_and_errors():
    assert parse_bytes("4GiB") == 4 * 2**30
    assert parse_bytes("1.5 gb") == 1_500_000_000
    assert parse_bytes("512MiB") == 512 * 2**20 and parse_bytes("100") == 100
    with pytest.raises(SelfspecError, match="memory size"):
        parse_bytes("4 parsecs")


def test_kv_prediction_equals_cache_bytes():
    model = tiny_model(0, vocab=64, layers=3)
    cache = new_cache(model)
    n = 11
    forward_with_cache(model, torch.arange(n)[None], cache, position_ids=torch.arange(n)[None])
    assert counted_bytes(cache) == n * kv_bytes_per_token(model.config, torch.float32)


def test_draft_model_prediction_matches_counted():
    target, draft = tiny_model(0, vocab=64), tiny_model(1, vocab=64, layers=1)
    drafter = DraftModelDrafter(draft, 64)
    pred = predict_added(target, drafter, max_nodes=8)
    res = SpeculativeEngine(target, drafter).generate(list(range(1, 9)), DecodeConfig(max_new_tokens=20, max_nodes=8))
    counted = counted_added(target, drafter, res.stats.draft_state_bytes, res.stats.max_tree_nodes)
    assert pred.weights == sum(p.numel() * 4 for p in draft.parameters())
    assert counted["weights"] == pred.weights + own_buffer_bytes(drafter, target)
    # the draft cache holds at most prompt + output + one draft chain, at least the prompt
    per_tok = kv_bytes_per_token(draft.config, torch.float32)
    assert pred.kv_per_token == per_tok
    assert 8 * per_tok <= counted["kv_cache"] <= (8 + 20 + 7) * per_tok
    assert counted["kv_cache"] % per_tok == 0
    assert counted["tree"] <= pred.transient


@pytest.mark.parametrize("family", ["eagle", "medusa", "early-exit"])
def test_heads_prediction_matches_counted(family):
    target = tiny_model(0, vocab=64, layers=4)
    kw = {"draft_vocab_size": 32} if family == "eagle" else {"exit_layer": 2} if family == "early-exit" else {}
    heads = init_heads(family, target, **kw)
    drafter = make_drafter(heads, target)
    pred = predict_added(target, drafter, max_nodes=16)
    counted = counted_added(target, drafter, 0, 16)
    assert counted["weights"] == pred.weights + own_buffer_bytes(drafter, target)
    assert counted["tree"] == pred.transient
    if family == "medusa":
        assert pred.kv_per_token == 0  # no cache
    if family == "early-exit":  # its own cache of the first 2 layers where it cannot draft in the target's
        assert pred.kv_per_token == kv_bytes_per_token(target.config, torch.float32, 2)


def test_head_method_with_lookup_wraps_the_same_heads(tmp_path):
    """``eagle+lookup``: the checkpoint's drafter behind prompt lookup, same memory, output equal to plain."""
    from selfspec.checkpoint import save_heads
    from selfspec.drafters.lookup_first import LookupFirstDrafter
    from selfspec_eval.methods import build_methods

    target = tiny_model(0, vocab=64)
    save_heads(init_heads("eagle", target, draft_vocab_size=32), target, tmp_path / "e")
    plain, heads, both = build_methods(["plain", "eagle", "eagle+lookup"], target, None, None,
                                       {"eagle": str(tmp_path / "e")})
    assert isinstance(both.drafter, LookupFirstDrafter) and not isinstance(heads.drafter, LookupFirstDrafter)
    assert both.heads_dir == heads.heads_dir
    assert predict_added(target, both.drafter, 16) == predict_added(target, heads.drafter, 16)
    ids = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]  # repeats: lookup drafts
    runs = [m.run(target, ids, 24, 4, 8) for m in (plain, heads, both)]
    assert runs[1].tokens == runs[0].tokens and runs[2].tokens == runs[0].tokens
    with pytest.raises(SelfspecError, match="medusa\\+lookup|available: .*eagle\\+lookup"):
        build_methods(["medusa+lookup"], target, None, None, {"eagle": str(tmp_path / "e")})


def test_fixed_tree_drafts_at_every_step():
    """``--fixed-tree``: every target pass checks a draft (the heads' own tau); adaptive steps plain at first."""
    from selfspec_eval.methods import Method

    target = tiny_model(0, vocab=64)
    drafter = make_drafter(init_heads("eagle", target, draft_vocab_size=32), target)
    method, ids = Method("eagle", "selfspec", drafter), [5, 6, 7, 8, 9, 10]
    fixed, adaptive = method.run(target, ids, 16, 3, 8, adaptive=False), method.run(target, ids, 16, 3, 8)
    assert fixed.tokens == adaptive.tokens == Method("plain", "selfspec").run(target, ids, 16, 3, 8).tokens
    assert fixed.reached_depth[0] == fixed.target_forwards - 1  # a draft at every pass but the last (1 token left)
    assert adaptive.reached_depth[0] <= adaptive.target_forwards - 3  # it times two plain steps first


def test_prompt_lookup_adds_only_the_tree():
    target = tiny_model(0, vocab=64)
    drafter = PromptLookupDrafter()
    assert predict_added(target, drafter, 4).weights == 0
    assert counted_added(target, drafter, 0, 4)["weights"] == 0


def test_budget_arithmetic():
    target = tiny_model(0, vocab=64, layers=2)
    base = predict_target(target)
    extra = MemoryEstimate(weights=1000, kv_per_token=10, transient=50)
    budget = base.weights + 1000 + 50 + (base.kv_per_token + 10) * 300
    assert max_context(budget, base + extra) == 300
    assert max_context(budget, base + extra, limit=100) == 100
    assert max_context(base.weights, base + extra) == 0
    rows = budget_table(["plain", "x"], target, {"plain": MemoryEstimate(), "x": extra}, [budget], 300, None)
    assert [r["fits"] for r in rows] == [True, True]
    assert rows[1]["max_context"] == 300 and rows[0]["max_context"] > 300
    rows = budget_table(["x"], target, {"x": extra}, [budget], 301, None)
    assert rows[0]["fits"] is False


@pytest.mark.integration
def test_bench_small_run_writes_report(tmp_path):
    """A small real run: JSON, Markdown and the three PNGs; every selfspec method identical to hf."""
    import json

    from selfspec_cli.main import main

    out = tmp_path / "bench"
    methods = "hf,hf-assisted,plain,draft-model,prompt-lookup"  # the target doubles as its own draft model
    code = main(["bench", "--model", "smollm2-135m-instruct", "--draft-model", "smollm2-135m-instruct",
                 "--methods", methods, "--n", "1", "--max-new-tokens", "8", "--memory-budget", "600MiB,1GiB",
                 "--dtype", "float32", "--out", str(out)])  # float32: the budgets below are sized for its weights
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    overall = report["summary"]["categories"]["overall"]
    assert [overall[m]["identical"] for m in methods.split(",")] == [2] * 5
    assert {r["method"] for r in report["budgets"]} == set(methods.split(","))
    assert [r["fits"] for r in report["budgets"] if r["method"] == "plain"] == [False, True]  # 513 MiB of weights
    for name in ("report.md", "speedup_by_category.png", "speedup_vs_memory.png", "acceptance_by_depth.png"):
        assert (out / name).stat().st_size > 0
    assert "prompt lookup where the context repeats" in (out / "report.md").read_text()
    env = report["environment"]  # the report names its machine, versions and commit
    assert env["cpu"] and env["cores"] >= 1 and env["torch"] and env["transformers"] and env["date"]
    assert f"Measured: {env['date']}, {env['cpu']}" in (out / "report.md").read_text()
    # resumed: nothing re-runs, the same report comes back, with the environment it was measured in
    assert main(["bench", "--model", "smollm2-135m-instruct", "--draft-model", "smollm2-135m-instruct",
                 "--methods", methods, "--out", str(out), "--report-only", "--no-plots"]) == 0
    assert json.loads((out / "report.json").read_text())["environment"] == env


def test_a_bench_folder_refuses_to_resume_runs_of_other_heads_or_settings(tmp_path):
    """Runs resume by method name: heads retrained in the same folder, or other decoding settings, would be
    reported from the old runs. The folder records what its runs were measured with and refuses the rest."""
    from argparse import Namespace

    from selfspec.errors import SelfspecError
    from selfspec_eval.bench import resume_guard

    heads, out = tmp_path / "heads", tmp_path / "out"
    heads.mkdir()
    out.mkdir()
    (heads / "heads.safetensors").write_bytes(b"1")
    args = Namespace(model="m", max_new_tokens=8, max_depth=6, max_nodes=16, fixed_tree=False, vllm_spec_tokens=3)
    resume_guard(out, args, "bfloat16", {"eagle": str(heads)})
    (out / "runs.jsonl").write_text("{}\n")
    resume_guard(out, args, "bfloat16", {"eagle": str(heads)})  # the same: resumes
    resume_guard(out, args, "bfloat16", {"other": str(heads)})  # a method added beside them: fine
    with pytest.raises(SelfspecError, match="other max_nodes"):
        resume_guard(out, Namespace(**{**vars(args), "max_nodes": 4}), "bfloat16", {})
    (heads / "heads.safetensors").write_bytes(b"22")  # retrained
    with pytest.raises(SelfspecError, match="other heads eagle: pass another --out"):
        resume_guard(out, args, "bfloat16", {"eagle": str(heads)})


def test_bench_bad_model_is_one_line(capsys, tmp_path):
    from selfspec_eval.bench import main

    code = main(["--model", "/nonexistent/model/folder", "--out", str(tmp_path / "out")])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("selfspec bench: error: could not load model") and err.count("\n") == 1
    assert not (tmp_path / "out").exists()  # nothing written


def test_verify_cost_times_each_k_and_leaves_the_cache_as_it_was() -> None:
    from selfspec_eval.verify_cost import main, measure, measure_backends, parse_ks, pass_ms, table

    model = tiny_model(4)
    for backend in ("eager", "static"):
        target = make_target_pass(model, backend)
        cache = target.new_cache(32)
        target.prefill(cache, torch.tensor([1, 2, 3, 4, 5]))
        assert pass_ms(target, cache, 5, 3, 64) > 0
        assert target.length(cache) == 5  # the k timed tokens were rolled back again
        medians, first = measure(model, context=6, ks=[1, 4], reps=2, backend=backend)
        assert list(medians) == list(first) == [1, 4] and all(ms > 0 for ms in medians.values())
    medians, first = measure_backends(model, context=6, ks=[1, 4], reps=2, backends=["eager", "static"])
    assert list(medians) == list(first) == ["eager", "static"] and all(list(m) == [1, 4] for m in medians.values())
    assert table({1: 10.0, 4: 15.0}).splitlines()[2:] == ["| 1 | 10.0 | 1.00 |", "| 4 | 15.0 | 1.50 |"]
    assert table({2: 10.0, 8: 20.0}).splitlines()[0] == "| k | ms | x k=2 |"
    assert parse_ks("1,2,8") == [1, 2, 8]
    with pytest.raises(SystemExit, match="2"):  # a one-line error as the line is parsed, before any model loads
        main(["--context", "0"])
    with pytest.raises(SystemExit, match="2"):
        main(["--target-pass", "static,fast"])
    for bad in ("", "0,2", "two"):
        with pytest.raises(SelfspecError, match="--k takes positive integers"):
            parse_ks(bad)


@pytest.mark.integration
def test_batch_steps_counts_every_token_and_step(capsys):
    """``python -m selfspec_eval.batch_steps``: the tokens it reports are every request's (12 each: no answer ends
    that soon), and the steps by shape add up to the steps run."""
    from selfspec_eval.batch_steps import main

    assert main(["--model", "smollm2-135m-instruct", "--dtype", "float32", "--rows", "3", "--max-new-tokens", "12",
                 "--heads", "checkpoints/smollm2-135m-instruct-eagle"]) == 0
    summary, shapes = capsys.readouterr().out.strip().splitlines()[-2:]
    assert "3 requests at once" in summary and " 36 tokens in " in summary
    steps = int(summary.rsplit(", ", 1)[1].split()[0])
    assert sum(int(cell.split(": ")[1]) for cell in shapes.split(": ", 1)[1].split(", ")) == steps


@pytest.mark.integration
def test_batch_steps_breakdown_splits_a_step_into_parts_that_add_up(capsys):
    """``--breakdown``: the parts of a profiled step add up to its wall time (what no operator accounts for is
    Python's), and the linears show as linears."""
    from selfspec_eval.batch_steps import PARTS, main, part_of

    assert part_of("mkldnn::_linear_pointwise") == "packed linears" and part_of("aten::rsqrt") == PARTS[-1][0]
    with pytest.raises(SystemExit):
        main(["--model", "smollm2-135m-instruct", "--rows", "2", "--max-new-tokens", "8", "--breakdown", "4"])
    assert main(["--model", "smollm2-135m-instruct", "--dtype", "bfloat16", "--rows", "2", "--max-new-tokens", "12",
                 "--breakdown", "3"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    head = next(i for i, line in enumerate(lines) if "ms per step by part" in line)
    assert "2 rows" in lines[head]
    table = {line.rsplit(None, 1)[0].strip(): float(line.rsplit(None, 1)[1]) for line in lines[head + 1:]}
    assert table["packed linears"] > 0
    parts = sum(v for k, v in table.items() if not k.startswith("step ms"))
    assert parts == pytest.approx(table["step ms (profiled)"], abs=0.05)  # printed to 2 decimals
