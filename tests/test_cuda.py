"""On a CUDA GPU: the core invariant on every target pass, the compiled one replayed as CUDA graphs.

Marked ``cuda`` and skipped without a GPU: ``pytest -m cuda`` runs them, and ``make gpu-check``
(``python -m selfspec_eval.gpu_check``) runs them first. Tiny in-process models, seconds each on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from conftest import HEADS_HYPER, OracleTreeDrafter, hf_greedy, perturb, prompt_for, tiny_model
from selfspec.engine import DecodeConfig, SpeculativeEngine
from selfspec.heads import init_heads, make_drafter
from selfspec.target import make_target_pass, resolve_backend

DEVICE = "cuda"
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_auto_runs_the_compiled_pass_on_cuda() -> None:
    assert resolve_backend("auto", tiny_model(0).to(DEVICE)) == "compiled"


@pytest.mark.parametrize("backend", ["eager", "static", "compiled"])
def test_tree_drafts_are_lossless_on_cuda(backend: str) -> None:
    model = tiny_model(21).to(DEVICE)
    target = make_target_pass(model, backend)  # one pass for every prompt: the compiled graphs are built once
    for seed in range(3):
        prompt = prompt_for(seed, 11)
        expected = hf_greedy(model, prompt, 32)
        drafter = OracleTreeDrafter(prompt + expected, vocab=64, seed=seed)
        cfg = DecodeConfig(max_new_tokens=32, max_depth=5, max_nodes=12, adaptive=False)
        got = SpeculativeEngine(model, drafter, backend=target).generate(prompt, cfg)
        assert got.tokens == expected
        assert got.stats.mean_accepted > 1.5  # speculation really happened
        assert got.stats.target_pass == backend


@pytest.mark.parametrize("family", ["eagle", "eagle3", "medusa"])
def test_heads_draft_losslessly_through_cuda_graphs(family: str) -> None:
    model = tiny_model(4, layers=3)
    heads = perturb(init_heads(family, model, **HEADS_HYPER[family]), 4)  # perturbed on the CPU: its generator
    model, heads = model.to(DEVICE), heads.to(DEVICE)
    target = make_target_pass(model, "compiled")
    cfg = DecodeConfig(max_new_tokens=24, max_depth=4, max_nodes=16, adaptive=False)
    for seed in range(2):
        prompt = prompt_for(seed)
        got = SpeculativeEngine(model, make_drafter(heads, model), backend=target).generate(prompt, cfg)
        assert got.tokens == hf_greedy(model, prompt, 24)


def test_the_exact_pass_matches_plain_bit_for_bit_in_bf16_on_cuda() -> None:
    """Flat bf16 logits (near-ties common): wide random trees still give plain decoding's tokens."""
    model = tiny_model(7, vocab=256, layers=3, hidden=64)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.2)
    model = model.to(DEVICE, torch.bfloat16)
    target = make_target_pass(model, "static")
    if not target.exact:
        pytest.skip(f"this GPU's start-up self-test refuses the exact pass: {target.support.reason}")
    cfg = DecodeConfig(max_new_tokens=40, max_depth=6, max_nodes=64, adaptive=False)
    for length in (7, 23):
        prompt = prompt_for(length, length, 256)
        plain = SpeculativeEngine(model, None, backend=target).generate(prompt, cfg).tokens
        drafter = OracleTreeDrafter(prompt + plain, 256, seed=length, width=8, corrupt=0.5)
        got = SpeculativeEngine(model, drafter, backend=target).generate(prompt, cfg)
        assert got.tokens == plain and got.stats.exact
