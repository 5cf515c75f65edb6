"""The lossless invariant on a real model: SmolLM2-135M-Instruct, greedy, prompt lookup and a separate draft
(alone and behind prompt lookup)."""

from __future__ import annotations

import pytest
import torch

from selfspec.data import apply_chat_template
from selfspec.drafters.draft_model import DraftModelDrafter
from selfspec.drafters.lookup_first import LookupFirstDrafter
from selfspec.drafters.prompt_lookup import PromptLookupDrafter
from selfspec.engine import DecodeConfig, SpeculativeEngine

pytestmark = pytest.mark.integration

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number, with a docstring and two tests.",
    "Repeat this sentence three times: the quick brown fox jumps over the lazy dog.",
]


@pytest.fixture(scope="module")
def smol():
    from selfspec.zoo import load_model

    return load_model("smollm2-135m-instruct", dtype="float32")  # token-identical holds exactly in float32


def _reference(model, ids: list[int], n: int) -> list[int]:
    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n)
    new = out[0, len(ids):].tolist()
    eos = model.generation_config.eos_token_id
    eos = set(eos) if isinstance(eos, list) else {eos}
    for i, t in enumerate(new):
        if t in eos:
            return new[: i + 1]
    return new


@pytest.mark.parametrize("prompt", PROMPTS)
def test_prompt_lookup_equals_greedy(smol, prompt: str) -> None:
    model, tok = smol
    ids = apply_chat_template(tok, [{"role": "user", "content": prompt}])
    got = SpeculativeEngine(model, PromptLookupDrafter(), tok).generate(ids, DecodeConfig(max_new_tokens=64))
    assert got.tokens == _reference(model, ids, 64)


@pytest.mark.parametrize("lookup_first", [False, True])
def test_separate_draft_model_equals_greedy(smol, lookup_first: bool) -> None:
    """The draft is a 6-layer copy of the target's own weights (a small second model with the same tokenizer)."""
    from transformers import AutoModelForCausalLM

    model, tok = smol
    cfg = model.config.to_dict()
    cfg["num_hidden_layers"] = 6
    draft_cfg = type(model.config).from_dict(cfg)
    draft = AutoModelForCausalLM.from_config(draft_cfg).eval()
    missing = draft.load_state_dict(model.state_dict(), strict=False)
    assert not missing.missing_keys  # only the target's deeper layers are left over
    ids = apply_chat_template(tok, [{"role": "user", "content": PROMPTS[0]}])
    drafter = LookupFirstDrafter(DraftModelDrafter(draft)) if lookup_first else DraftModelDrafter(draft)
    got = SpeculativeEngine(model, drafter, tok).generate(
        ids, DecodeConfig(max_new_tokens=48, max_depth=4, adaptive=False))
    assert got.tokens == _reference(model, ids, 48)
    assert got.stats.mean_accepted > 1.0
