"""Early exit with LoRA on the first L layers: off during verification (the target's logits bit-identical to the
base's), starts as the plain exit, saves a peft folder that peft loads onto the base and that computes the same exit
states. (Lossless greedy and sampling and the own cache: ``test_exit_adapter.py``, for every adapter kind;
training and exact resume: ``test_training.py``.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import hf_greedy, perturb, prompt_for, tiny_model
from selfspec.checkpoint import export_heads, load_heads, save_heads
from selfspec.drafters.base import DraftContext, DraftRequest
from selfspec.engine import DecodeConfig, SpeculativeEngine
from selfspec.errors import SelfspecError
from selfspec.heads import init_heads, make_drafter
from selfspec.heads.exit_lora import PROJECTIONS
from selfspec.sampling import SamplingConfig

pytestmark = pytest.mark.usefixtures("one_thread")
LORA = {"exit_layer": 2, "adapter": "lora", "lora_rank": 4}


def lora_heads(model: torch.nn.Module, seed: int, scale: float = 0.3, **kw) -> torch.nn.Module:
    return perturb(init_heads("early-exit", model, **{**LORA, **kw}), seed, scale)


def test_the_adapter_is_off_for_verification() -> None:
    """After drafting with a strong adapter, the target computes exactly what it computed before (bit for bit) and
    its module tree holds no LoRA; the drafter's layers do."""
    model = tiny_model(4, layers=3)
    ids = torch.tensor([prompt_for(4, 12)])
    with torch.no_grad():
        before = model(ids).logits
    drafter = make_drafter(lora_heads(model, 4, 1.0), model)
    ctx = DraftContext(ids[0], ids.shape[1] - 1)
    tree, _ = drafter.propose(drafter.start(ctx), ctx, DraftRequest(5, 16, SamplingConfig()))
    with torch.no_grad():
        after = model(ids).logits
    assert torch.equal(before, after)
    assert not any("pair" in name or "lora" in name for name, _ in model.named_modules())
    adapted = [name for name, m in drafter.decoder.named_modules() if type(m).__name__ == "LoraLinear"]
    assert len(adapted) == 2 * len(PROJECTIONS)  # every projection of the first 2 layers
    # the drafter's layers share the target's weights (no copy)
    assert drafter.decoder.layers[0].self_attn.q_proj.base is model.model.layers[0].self_attn.q_proj


def test_an_untrained_lora_adapter_drafts_what_the_plain_exit_drafts() -> None:
    model = tiny_model(1, layers=3)
    plain = make_drafter(init_heads("early-exit", model, exit_layer=2, exit_projection=False), model)
    lora = make_drafter(init_heads("early-exit", model, **LORA), model)
    ctx = DraftContext(torch.tensor(prompt_for(1, 12)), 11)
    req = DraftRequest(5, 16, SamplingConfig())
    a, _ = plain.propose(plain.start(ctx), ctx, req)
    b, _ = lora.propose(lora.start(ctx), ctx, req)
    assert a.tokens.tolist() == b.tokens.tolist()
    strong = make_drafter(lora_heads(model, 1, 2.0), model)
    trained, _ = strong.propose(strong.start(ctx), ctx, req)
    assert trained.tokens.tolist() != a.tokens.tolist()  # a perturbed adapter changes the draft


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_peft_folder_loads_with_peft_and_computes_the_same_exit(tmp_path: Path, arch: str) -> None:
    peft = pytest.importorskip("peft")
    model = tiny_model(5, layers=3, arch=arch)
    heads = lora_heads(model, 5, 0.5)
    folder = save_heads(heads, model, tmp_path / "heads", base_name="tiny")
    config = json.loads((folder / "peft" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["layers_to_transform"] == [0, 1]
    assert sorted(config["target_modules"]) == sorted(PROJECTIONS)
    stored = load_file(str(folder / "peft" / "adapter_model.safetensors"))
    assert len(stored) == 2 * 2 * len(PROJECTIONS)

    base = tiny_model(5, layers=3, arch=arch)  # peft changes the model it wraps: a second copy of the base
    wrapped = peft.PeftModel.from_pretrained(base, str(folder / "peft"))
    q = wrapped.base_model.model.model.layers[1].self_attn.q_proj
    assert torch.equal(q.lora_B["default"].weight, heads.lora[1]["q_proj"].lora_B.weight)
    assert not hasattr(wrapped.base_model.model.model.layers[2].self_attn.q_proj, "lora_A")  # layer 2: untouched
    ids = torch.tensor([prompt_for(5, 14)])
    with torch.no_grad():
        peft_states = wrapped(ids, output_hidden_states=True).hidden_states[2]  # after layer 2, before the norm
        ours = heads.exit_model(model)(input_ids=ids).last_hidden_state
    torch.testing.assert_close(model.model.norm(peft_states), ours, rtol=1e-5, atol=1e-5)
    with torch.no_grad(), wrapped.disable_adapter():  # and peft's adapter off is the base
        assert torch.equal(wrapped(ids).logits, model(ids).logits)


def test_lora_checkpoint_round_trip_and_export(tmp_path: Path) -> None:
    model = tiny_model(3, layers=3, arch="qwen2")
    heads = lora_heads(model, 3)
    folder = save_heads(heads, model, tmp_path / "heads")
    loaded, drafter = load_heads(model, folder)
    assert loaded.config == heads.config and loaded.config.lora_alpha == 8
    a, b = heads.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    prompt = prompt_for(3)
    got = SpeculativeEngine(model, drafter).generate(prompt, DecodeConfig(max_new_tokens=20, adaptive=False))
    assert got.tokens == hf_greedy(model, prompt, 20)
    copy = export_heads(folder, tmp_path / "bf16", dtype=torch.bfloat16)
    cast = load_file(str(copy / "peft" / "adapter_model.safetensors"))
    assert len(cast) == 2 * 2 * len(PROJECTIONS) and all(t.dtype == torch.bfloat16 for t in cast.values())


def test_bad_lora_settings_are_one_line_errors() -> None:
    model = tiny_model(0, layers=3)
    with pytest.raises(SelfspecError, match="lora_rank must be >= 1"):
        init_heads("early-exit", model, adapter="lora", lora_rank=0)
