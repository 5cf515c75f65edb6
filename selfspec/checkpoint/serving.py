"""Heads in the layouts serving engines load: vLLM's and SGLang's EAGLE-3 drafter, the speculators format, and
vLLM's MTP, EAGLE-1 and Medusa drafters.

    export_for_serving(heads_folder, out, "vllm" | "sglang" | "speculators", num_speculative_tokens=3)
    vllm_speculative_config(out)  # {"method": "eagle3" | "mtp" | "eagle" | "medusa", "model": out, ...}

writes ``out/config.json`` and ``out/model.safetensors``. The ``eagle3`` family has a place in all three: its
tensors already carry the EAGLE-3 names (``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t`` as target id
minus draft id, ``t2d``), so the export is a copy (cast to ``dtype``), checked against the names and shapes
those engines' EAGLE-3 model classes declare (``expected_tensors``: their loaders drop unexpected tensors and
leave missing ones uninitialised without an error, so the check has to be here). The configs differ:

    vllm         a Llama config, ``architectures: [LlamaForCausalLMEagle3]``, ``draft_vocab_size``,
                 ``target_hidden_size`` and ``eagle_aux_hidden_state_layer_ids`` as indices into
                 ``hidden_states`` (vLLM captures the input of layer k: what selfspec's ``aux_layers`` mean)
    sglang       the same layout, the layer ids one less (SGLang and SpecForge capture after layer k)
    speculators  ``speculators_model_type: eagle3``, the layer config under ``transformer_layer_config``,
                 ``norm_before_residual: false`` written out (the format's default is true), the verifier
                 and a greedy proposal of ``num_speculative_tokens``; ``vllm serve OUT`` alone serves it

``eagle`` heads go to vLLM only. With their norms (the default) they go, by default, as vLLM's EAGLE-3 drafter
with two layers computing what the head computes (``_export_eagle_as_eagle3``: no aux states, the head's draft
vocabulary), or with ``layout="mtp"`` as the MTP layer vLLM runs for MiMo (``MiMoMTP``, method ``mtp``), which is
the head tensor for tensor: ``hidden_layernorm`` (feature_norm), ``token_layernorm`` (embed_norm), ``input_proj``
(fc, the same [feature; embedding] order), a Qwen2 decoder layer, ``final_layernorm``. vLLM builds that layer from
the *target's* config, so a Llama layer's q/k/v get zero biases, the MLP zero rows up to the target's width
(nothing added either way), the target's config needs ``num_nextn_predict_layers`` (``vllm_serve_flags``), and the
embedding and LM head are copied in for vLLM's loader (it then shares the target's). ``eagle`` heads built with
``norms=False`` (EAGLE-1's layout) go as vLLM's ``EagleLlamaForCausalLM`` (method ``eagle``): a one-layer Llama
config (``qkv_bias`` where the layer's q/k/v carry biases, as Qwen2's do), ``fc.weight`` with its two input halves
swapped (vLLM concatenates [embedding; feature], selfspec [feature; embedding]) and the layer as ``layers.0.*``;
the embedding and LM head are the target's, shared, and vLLM drafts over the whole vocabulary (``d2t`` stays
behind).

``medusa`` heads go to vLLM only (SGLang and speculators have no Medusa drafter): ``model_type: medusa``,
``blocks.{i}.layers.{j}.{weight,bias}`` (``medusa_fc_bias: true``), and the target's own LM head once as
``lm_heads.0.weight`` with ``original_lm_head: true`` (vLLM shares it among the heads, as selfspec does); vLLM
drafts a chain of each head's top-1 token, fed the target's final (normed) hidden state, as selfspec's heads
were trained. Other families refuse with one line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ..errors import SelfspecError
from .format import check_heads_folder, read_tensors

FORMATS = ("vllm", "sglang", "speculators")
ARCHITECTURE = "LlamaForCausalLMEagle3"


def expected_tensors(layer: dict[str, Any], vocab_size: int, num_aux: int = 3) -> dict[str, tuple[int, ...]]:
    """Names and shapes of an EAGLE-3 drafter checkpoint for a Llama layer config ``layer`` (as a dict), before
    the engines stack q/k/v and gate/up: what vLLM's ``Eagle3LlamaForCausalLM`` and SGLang's
    ``LlamaForCausalLMEagle3`` read (the token embedding is the target's, shared)."""
    h, inter = layer["hidden_size"], layer["intermediate_size"]
    heads, kv = layer["num_attention_heads"], layer["num_key_value_heads"]
    dim = layer.get("head_dim") or h // heads
    vd = layer["draft_vocab_size"]
    attn, mlp = "midlayer.self_attn.", "midlayer.mlp."
    return {
        "fc.weight": (h, num_aux * h),
        attn + "q_proj.weight": (heads * dim, 2 * h), attn + "k_proj.weight": (kv * dim, 2 * h),
        attn + "v_proj.weight": (kv * dim, 2 * h), attn + "o_proj.weight": (h, heads * dim),
        mlp + "gate_proj.weight": (inter, h), mlp + "up_proj.weight": (inter, h), mlp + "down_proj.weight": (h, inter),
        "midlayer.input_layernorm.weight": (h,), "midlayer.hidden_norm.weight": (h,),
        "midlayer.post_attention_layernorm.weight": (h,),
        "norm.weight": (h,), "lm_head.weight": (vd, h), "d2t": (vd,), "t2d": (vocab_size,),
    }


def check_tensors(tensors: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]],
                  what: str = "an EAGLE-3 drafter") -> None:
    """One error naming every missing, unexpected or misshapen tensor."""
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    shapes = [f"{k} {tuple(tensors[k].shape)} != {expected[k]}" for k in sorted(set(tensors) & set(expected))
              if tuple(tensors[k].shape) != expected[k]]
    if missing or unexpected or shapes:
        raise SelfspecError(f"these tensors do not form {what}: missing {missing}, unexpected "
                            f"{unexpected}, shapes {shapes}")


def _base_name(meta: dict[str, Any], base: str | None) -> str:
    """The base model the heads were trained on: ``base`` if given, else the name the heads folder records."""
    name = base or meta["base"].get("name_or_path")
    if not name:
        raise SelfspecError("the heads folder does not name its base model: pass base= (a zoo name, folder or hub id)")
    return name


LLAMA_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "rms_norm_eps", "max_position_embeddings", "rope_parameters", "hidden_act", "attention_bias",
                "mlp_bias")


def _llama_fields(layer: dict[str, Any], *extra: str) -> dict[str, Any]:
    """The one-layer Llama config's fields an engine reads (and ``extra`` ones), the rotary base also flat: older
    readers (SGLang, transformers < 5) look for ``rope_theta``."""
    core = {k: layer[k] for k in LLAMA_FIELDS + extra if layer.get(k) is not None}
    rope = core.get("rope_parameters") or {}
    if "rope_theta" in rope:
        core["rope_theta"] = rope["rope_theta"]
    return core


def _layer_dict(meta: dict[str, Any], base: str | None) -> tuple[dict[str, Any], int, str]:
    """The midlayer's Llama config as a dict, the target's vocabulary size, the base's folder or hub id."""
    from ..heads.config import config_from_dict
    from ..heads.eagle3 import layer_config
    from ..zoo import load_config, resolve

    name = _base_name(meta, base)
    target_config = load_config(name)
    name = resolve(name)  # a zoo name becomes its local folder: what an engine can load
    config = config_from_dict("eagle3", meta["config"])
    layer = layer_config(target_config, config).to_dict()
    layer["draft_vocab_size"] = config.draft_vocab_size
    vocab = target_config.get_text_config().vocab_size
    return layer, vocab, name


def _engine_config(layer: dict[str, Any], aux: list[int], vocab: int, fmt: str, base: str, tokens: int,
                   dtype: torch.dtype) -> dict[str, Any]:
    core = _llama_fields(layer, "draft_vocab_size")
    core.update(model_type="llama", num_hidden_layers=1, vocab_size=vocab, tie_word_embeddings=False,
                target_hidden_size=layer["hidden_size"], torch_dtype=str(dtype).removeprefix("torch."))
    if fmt == "speculators":
        return {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
                "transformer_layer_config": {**core, "architectures": ["LlamaForCausalLM"]},
                "draft_vocab_size": core["draft_vocab_size"], "target_hidden_size": core["hidden_size"],
                "norm_before_residual": False, "eagle_aux_hidden_state_layer_ids": aux,
                "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                       "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": tokens}],
                                       "verifier": {"name_or_path": base, "architectures": []}}}
    ids = aux if fmt == "vllm" else [i - 1 for i in aux]
    return {**core, "architectures": [ARCHITECTURE], "eagle_aux_hidden_state_layer_ids": ids,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids}}


EAGLE_LAYOUTS = ("eagle3", "mtp")  # where normed eagle heads go in vLLM; the first is the default


def vllm_method(meta: dict[str, Any], layout: str | None = None) -> str | None:
    """The vLLM drafter a heads folder's metadata exports to (its ``speculative_config`` method), or None;
    ``layout`` picks one of ``EAGLE_LAYOUTS`` for normed eagle heads."""
    family = meta["family"]
    normed_eagle = family == "eagle" and meta["config"].get("norms") is not False
    if layout is not None and (not normed_eagle or layout not in EAGLE_LAYOUTS):
        raise SelfspecError(f"layout '{layout}' is for eagle heads with their norms, one of {', '.join(EAGLE_LAYOUTS)}")
    if family == "eagle":
        return (layout or EAGLE_LAYOUTS[0]) if normed_eagle else "eagle"
    return family if family in ("eagle3", "medusa") else None


def export_for_serving(folder: str | Path, out: str | Path, fmt: str = "vllm", base: str | None = None,
                       num_speculative_tokens: int = 3, dtype: torch.dtype = torch.bfloat16,
                       layout: str | None = None) -> Path:
    """Write the heads in ``folder`` as a drafter ``fmt`` loads (``layout``: see ``vllm_method``); returns ``out``."""
    if fmt not in FORMATS:
        raise SelfspecError(f"unknown export format '{fmt}'; choose one of {', '.join(FORMATS)}")
    meta = check_heads_folder(folder)
    family = meta["family"]
    if fmt == "vllm" and family != "eagle3":
        export = {"medusa": _export_medusa, "eagle": _export_eagle1, "mtp": _export_mtp,
                  "eagle3": _export_eagle_as_eagle3}.get(vllm_method(meta, layout))
        if export is not None:
            return export(folder, meta, Path(out), base, dtype)
    if family != "eagle3":
        why = {"eagle": f"{fmt} takes EAGLE-3 drafters only; train an eagle3 head (or export to vllm)",
               "medusa": f"{fmt} has no Medusa drafter (export to vllm)"}.get(
                   family, "only eagle3 heads (and medusa heads, for vllm) have a layout there")
        raise SelfspecError(f"{family} heads cannot be exported to {fmt}: {why}")
    layer, vocab, name = _layer_dict(meta, base)
    aux = list(meta["config"]["aux_layers"])
    tensors = read_tensors(folder)
    check_tensors(tensors, expected_tensors(layer, vocab, len(aux)))
    if fmt == "sglang" and min(aux) < 1:
        raise SelfspecError(f"aux layers {aux} include the embeddings, which SGLang cannot capture")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cast = {k: v.to(dtype) if v.is_floating_point() else v.contiguous() for k, v in tensors.items()}
    save_file(cast, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = _engine_config(layer, aux, vocab, fmt, name, num_speculative_tokens, dtype)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def eagle1_tensors(layer: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Names and shapes of an EAGLE-1 drafter for vLLM's ``EagleLlamaForCausalLM`` with the one-layer Llama config
    ``layer`` (a dict): ``fc``, the layer without its input norm, no final norm (embedding and LM head shared)."""
    h, inter = layer["hidden_size"], layer["intermediate_size"]
    heads, kv = layer["num_attention_heads"], layer["num_key_value_heads"]
    dim = layer.get("head_dim") or h // heads
    attn, mlp = "layers.0.self_attn.", "layers.0.mlp."
    out = {"fc.weight": (h, 2 * h), attn + "q_proj.weight": (heads * dim, h), attn + "k_proj.weight": (kv * dim, h),
           attn + "v_proj.weight": (kv * dim, h), attn + "o_proj.weight": (h, heads * dim),
           mlp + "gate_proj.weight": (inter, h), mlp + "up_proj.weight": (inter, h),
           mlp + "down_proj.weight": (h, inter), "layers.0.post_attention_layernorm.weight": (h,)}
    if layer.get("qkv_bias"):
        out.update({attn + "q_proj.bias": (heads * dim,), attn + "k_proj.bias": (kv * dim,),
                    attn + "v_proj.bias": (kv * dim,)})
    if layer.get("attention_bias"):
        out[attn + "o_proj.bias"] = (h,)
    return out


def _eagle_layer(folder: str | Path, meta: dict[str, Any], base: str | None
                 ) -> tuple[dict[str, torch.Tensor], torch.Tensor, dict[str, Any], str, Any]:
    """An eagle heads folder's tensors (``decoder.`` dropped) and its ``d2t``, its layer's config as a dict (the
    target's vocabulary, ``qkv_bias`` and ``attention_bias`` as the tensors have them), the base model's name and
    text config."""
    from ..heads.config import config_from_dict
    from ..heads.eagle3 import layer_config
    from ..zoo import load_config

    name = _base_name(meta, base)
    target_config = load_config(name)
    tc = target_config.get_text_config()
    tensors = {k.removeprefix("decoder."): v for k, v in read_tensors(folder).items()}
    d2t = tensors.pop("d2t")
    attn = "layers.0.self_attn."
    layer = layer_config(target_config, config_from_dict("eagle", meta["config"])).to_dict()
    layer.update(vocab_size=tc.vocab_size, hidden_act=getattr(tc, "hidden_act", "silu"),
                 qkv_bias=attn + "q_proj.bias" in tensors, attention_bias=attn + "o_proj.bias" in tensors)
    return tensors, d2t, layer, name, tc


def _load_target(name: str, dtype: torch.dtype) -> torch.nn.Module:
    """The base model itself, for the embedding and LM head an engine's checkpoint carries."""
    from transformers import AutoModelForCausalLM

    from ..zoo import _from_pretrained

    return _from_pretrained(AutoModelForCausalLM, name, dtype=dtype)


def _save(tensors: dict[str, torch.Tensor], config: dict[str, Any], out: Path, dtype: torch.dtype) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in tensors.items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def _export_eagle1(folder: str | Path, meta: dict[str, Any], out: Path, base: str | None, dtype: torch.dtype) -> Path:
    """vLLM's EAGLE-1 drafter: the layer renamed, ``fc``'s halves swapped, a Llama config with the target's shapes."""
    from ..zoo import resolve

    tensors, _, layer, name, _ = _eagle_layer(folder, meta, base)
    check_tensors(tensors, eagle1_tensors(layer), "an EAGLE-1 drafter")
    fc, h = tensors["fc.weight"], layer["hidden_size"]
    tensors["fc.weight"] = torch.cat([fc[:, h:], fc[:, :h]], dim=1)  # [feature; embedding] -> [embedding; feature]
    engine = _llama_fields(layer, "qkv_bias", "vocab_size")
    engine.update(model_type="llama", architectures=["LlamaForCausalLM"], num_hidden_layers=1,
                  tie_word_embeddings=False, base_model=resolve(name))
    return _save(tensors, engine, out, dtype)


MTP = "model.mtp_layers.0."


def mtp_tensors(layer: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Names and shapes of one MiMo MTP layer (vLLM's ``MiMoMTP``) holding a normed eagle head: its norms, ``fc`` as
    ``input_proj``, a Qwen2 layer (q/k/v biases), ``final_layernorm``; the embedding and LM head come beside it."""
    h = layer["hidden_size"]
    eagle1 = eagle1_tensors({**layer, "qkv_bias": True})
    out = {MTP + k.removeprefix("layers.0."): v for k, v in eagle1.items() if k != "fc.weight"}
    out.update({MTP + "input_proj.weight": (h, 2 * h), MTP + "input_layernorm.weight": (h,),
                MTP + "hidden_layernorm.weight": (h,), MTP + "token_layernorm.weight": (h,),
                MTP + "final_layernorm.weight": (h,)})
    return out


def _padded_mlp(tensors: dict[str, torch.Tensor], width: int) -> dict[str, torch.Tensor]:
    """The MLP widened to ``width`` with zero rows (gate, up) and columns (down): silu(0) * 0 adds nothing, so the
    layer computes what it did."""
    mlp = MTP + "mlp."
    gate, up, down = (tensors[mlp + k + "_proj.weight"] for k in ("gate", "up", "down"))
    extra = width - gate.shape[0]
    if extra < 0:
        raise SelfspecError(f"the head's MLP ({gate.shape[0]}) is wider than the target's ({width}): vLLM's MTP layer "
                            "takes the target's width")
    rows = gate.new_zeros(extra, gate.shape[1])
    return {mlp + "gate_proj.weight": torch.cat([gate, rows]), mlp + "up_proj.weight": torch.cat([up, rows]),
            mlp + "down_proj.weight": torch.cat([down, down.new_zeros(down.shape[0], extra)], dim=1)}


def _export_mtp(folder: str | Path, meta: dict[str, Any], out: Path, base: str | None, dtype: torch.dtype) -> Path:
    """A normed eagle head as vLLM's MiMo MTP layer (method ``mtp``): the same computation, renamed."""
    from ..zoo import resolve

    tensors, _, layer, name, tc = _eagle_layer(folder, meta, base)
    if layer["attention_bias"] or layer.get("mlp_bias"):
        raise SelfspecError("vLLM's MTP layer (Qwen2's) has no o_proj or MLP biases; these heads carry them")
    renames = {"feature_norm.weight": "hidden_layernorm.weight", "embed_norm.weight": "token_layernorm.weight",
               "fc.weight": "input_proj.weight", "norm.weight": "final_layernorm.weight"}
    mtp = {MTP + renames.get(k, k.removeprefix("layers.0.")): v for k, v in tensors.items()}
    for p in ("q", "k", "v"):  # Qwen2's q/k/v always carry biases: a Llama layer's are zero
        mtp.setdefault(f"{MTP}self_attn.{p}_proj.bias", torch.zeros(mtp[f"{MTP}self_attn.{p}_proj.weight"].shape[0]))
    check_tensors(mtp, mtp_tensors(layer), "an MTP layer")
    layer["intermediate_size"] = tc.intermediate_size  # vLLM builds the layer from the target's own config
    mtp.update(_padded_mlp(mtp, layer["intermediate_size"]))
    target = _load_target(name, dtype)  # vLLM's loader wants both (then shares)
    mtp["model.embed_tokens.weight"] = target.get_input_embeddings().weight.detach()
    mtp["lm_head.weight"] = target.get_output_embeddings().weight.detach().clone()  # tied: a copy of its own
    engine = _llama_fields(layer, "vocab_size")
    engine.update(model_type="qwen2", architectures=["MiMoForCausalLM"], num_hidden_layers=1,
                  num_nextn_predict_layers=1, use_sliding_window=False, tie_word_embeddings=False,
                  base_model=resolve(name))
    return _save(mtp, engine, out, dtype)


def self_attending(theta: float, head_dim: int, max_positions: int, margin_logit: float = 80.0
                   ) -> tuple[torch.Tensor, float]:
    """A query = key vector (head_dim,) whose rotary dot product at offset 0 beats every offset 1..max_positions by
    ``margin_logit`` after the 1/sqrt(head_dim) scale: attention with it sees only the token itself (softmax weight
    1 to float precision). Weight spread evenly over the k fastest rotary frequencies, k chosen for the widest gap
    (about 0.1 of the offset-0 product for rotary bases 1e4-1e6); returns the vector and that gap."""
    half = head_dim // 2
    freqs = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / head_dim)
    offsets = torch.arange(1, max_positions + 1, dtype=torch.float64)[:, None]
    best = (0.0, 1)
    for k in range(1, half + 1):
        gap = 1 - torch.cos(offsets * freqs[:k]).mean(1).max().item()
        best = max(best, (gap, k))
    gap, k = best
    scale = (margin_logit * head_dim ** 0.5 / gap) ** 0.5  # |q|^2 gap / sqrt(d) = margin_logit
    pair = torch.zeros(half, dtype=torch.float64)
    pair[:k] = (scale * scale / (2 * k)) ** 0.5  # each rotary pair (i, i + half) carries 1/k of |q|^2
    return torch.cat([pair, pair]).float(), gap


def _repeat_kv(t: torch.Tensor, groups: int, head_dim: int) -> torch.Tensor:
    """A GQA layer's k or v rows (weight or bias) with each key/value head repeated for its ``groups`` query heads."""
    return t.reshape(-1, head_dim, *t.shape[1:]).repeat_interleave(groups, 0).reshape(-1, *t.shape[1:])


def _export_eagle_as_eagle3(folder: str | Path, meta: dict[str, Any], out: Path, base: str | None,
                            dtype: torch.dtype) -> Path:
    """A normed eagle head as vLLM's EAGLE-3 drafter with two layers (method ``eagle3``, the head's draft vocabulary).

    vLLM's EAGLE-3 layer 0 attends over [norm(embedding); norm(feature)] and adds the normed feature to the
    residual stream. Here its attention sees only the token itself (query = key from biases, ``self_attending``),
    its values are [W_e, W_f - I] over that input and its o_proj the identity, its MLP zero, so the residual stream
    leaving it is fc's output, W_f norm(f) + W_e norm(e); layer 1 is the head's own layer (key/value heads repeated
    to one per query head, as layer 0 needs), the final norm the head's, fed back normed (``norm_output``).
    """
    from ..zoo import resolve

    tensors, d2t, layer, name, tc = _eagle_layer(folder, meta, base)
    rope = layer.get("rope_parameters") or {}
    theta = rope.get("rope_theta", layer.get("rope_theta"))
    if rope.get("rope_type", "default") != "default" or theta is None:
        raise SelfspecError(f"the EAGLE-3 layout needs plain rotary embeddings; {name} uses {rope}: export "
                            "layout='mtp'")
    h, heads, kv = layer["hidden_size"], layer["num_attention_heads"], layer["num_key_value_heads"]
    dim = layer.get("head_dim") or h // heads
    if heads * dim < h or layer["attention_bias"] or layer.get("mlp_bias"):
        raise SelfspecError("the EAGLE-3 layout needs heads x head_dim >= hidden size and no o_proj or MLP biases: "
                            "export layout='mtp'")
    fc = tensors.pop("fc.weight")
    norms = {k: tensors.pop(k) for k in ("embed_norm.weight", "feature_norm.weight", "norm.weight")}
    llama = {k: v for k, v in eagle1_tensors(layer).items() if k != "fc.weight"}
    check_tensors(tensors, {**llama, "layers.0.input_layernorm.weight": (h,)},
                  "the Llama layer vLLM's EAGLE-3 drafter builds")
    w_f, w_e = fc[:, :h].float(), fc[:, h:].float()
    values = torch.zeros(heads * dim, 2 * h)
    values[:h] = torch.cat([w_e, w_f - torch.eye(h)], dim=1)  # input order [embedding; feature]
    qk, gap = self_attending(theta, dim, layer["max_position_embeddings"])
    if gap < 0.02:  # the query would have to be so long that bf16 rounding could move the attention
        raise SelfspecError(f"no query attends to itself alone over {layer['max_position_embeddings']} positions "
                            f"with rotary base {theta} (gap {gap:.3f}): export layout='mtp'")
    inter = layer["intermediate_size"]
    zero = torch.zeros
    out_tensors = {
        "layers.0.input_layernorm.weight": norms["embed_norm.weight"],
        "layers.0.hidden_norm.weight": norms["feature_norm.weight"],
        "layers.0.self_attn.q_proj.weight": zero(heads * dim, 2 * h),
        "layers.0.self_attn.q_proj.bias": qk.repeat(heads),
        "layers.0.self_attn.k_proj.weight": zero(heads * dim, 2 * h),
        "layers.0.self_attn.k_proj.bias": qk.repeat(heads),
        "layers.0.self_attn.v_proj.weight": values, "layers.0.self_attn.v_proj.bias": zero(heads * dim),
        "layers.0.self_attn.o_proj.weight": torch.eye(h, heads * dim), "layers.0.self_attn.o_proj.bias": zero(h),
        "layers.0.post_attention_layernorm.weight": torch.ones(h),
        "layers.0.mlp.gate_proj.weight": zero(inter, h), "layers.0.mlp.up_proj.weight": zero(inter, h),
        "layers.0.mlp.down_proj.weight": zero(h, inter),
        "norm.weight": norms["norm.weight"],
    }
    attn = "layers.0.self_attn."
    for k, v in tensors.items():  # the head's layer, as layer 1
        if k.startswith((attn + "k_proj", attn + "v_proj")):
            v = _repeat_kv(v, heads // kv, dim)
        out_tensors["layers.1." + k.removeprefix("layers.0.")] = v
    for p, rows in (("q", heads * dim), ("k", heads * dim), ("v", heads * dim), ("o", h)):
        out_tensors.setdefault(f"layers.1.self_attn.{p}_proj.bias", zero(rows))
    out_tensors["lm_head.weight"] = _load_target(name, dtype).get_output_embeddings().weight.detach()[d2t].clone()
    if d2t.numel() < tc.vocab_size:  # vLLM maps draft ids only for a smaller vocabulary
        out_tensors["d2t"] = d2t - torch.arange(d2t.numel())  # EAGLE-3's convention: target id - draft id
    engine = _llama_fields(layer, "vocab_size")
    engine.update(model_type="llama", architectures=[ARCHITECTURE], num_hidden_layers=2, num_key_value_heads=heads,
                  head_dim=dim, attention_bias=True, draft_vocab_size=d2t.numel(), vocab_size=tc.vocab_size,
                  target_hidden_size=h, tie_word_embeddings=False, norm_before_residual=True, norm_output=True,
                  eagle_config={"use_aux_hidden_state": False}, base_model=resolve(name))
    return _save(out_tensors, engine, out, dtype)


def medusa_tensor_names(num_heads: int, num_layers: int) -> dict[str, str]:
    """selfspec's Medusa tensor names -> vLLM's (``Medusa`` with ``medusa_fc_bias``)."""
    return {f"heads.{i}.{j}.linear.{p}": f"blocks.{i}.layers.{j}.{p}"
            for i in range(num_heads) for j in range(num_layers) for p in ("weight", "bias")}


def _export_medusa(folder: str | Path, meta: dict[str, Any], out: Path, base: str | None, dtype: torch.dtype) -> Path:
    """vLLM's Medusa drafter: the residual blocks renamed, the target's LM head copied in once."""
    from ..heads.config import config_from_dict
    from ..zoo import resolve

    name = _base_name(meta, base)
    config = config_from_dict("medusa", meta["config"])
    names = medusa_tensor_names(config.num_heads, config.num_layers)
    tensors = read_tensors(folder)
    missing, unexpected = sorted(set(names) - set(tensors)), sorted(set(tensors) - set(names))
    if missing or unexpected:
        raise SelfspecError(f"these tensors do not form Medusa heads: missing {missing}, unexpected {unexpected}")
    head = _load_target(name, dtype).get_output_embeddings()
    if head is None or getattr(head, "bias", None) is not None:
        raise SelfspecError(f"{name} has no plain LM head (a linear layer without bias) for vLLM's Medusa drafter")
    hidden = head.weight.shape[1]
    wrong = [k for k, v in tensors.items() if v.shape[-1] != hidden]
    if wrong:
        raise SelfspecError(f"the heads do not fit {name}'s hidden size {hidden}: {wrong[:3]}")
    cast = {names[k]: v.to(dtype).contiguous() for k, v in tensors.items()}
    cast["lm_heads.0.weight"] = head.weight.detach().to(dtype).contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(cast, str(out / "model.safetensors"), metadata={"format": "pt"})
    vocab = head.weight.shape[0]
    engine = {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": hidden,
              "vocab_size": vocab, "truncated_vocab_size": vocab, "num_heads": config.num_heads,
              "num_hidden_layers": config.num_layers, "medusa_fc_bias": True, "original_lm_head": True,
              "torch_dtype": str(dtype).removeprefix("torch."), "base_model": resolve(name)}
    (out / "config.json").write_text(json.dumps(engine, indent=2) + "\n")
    return out


def misread_by_vllm(path: str | Path) -> bool:
    """vLLM 0.32 names a drafter's method by its path before its config ('eagle-' anywhere: eagle): an MTP drafter
    there would be built as EAGLE and fail."""
    text = str(path).lower()
    return any(word in text for word in ("eagle-", "eagle3", "dflash", "dspark"))


def vllm_speculative_config(exported: str | Path, num_speculative_tokens: int = 3) -> dict[str, Any]:
    """vLLM's ``speculative_config`` for a folder ``export_for_serving(..., "vllm")`` wrote: EAGLE-3 and EAGLE-1
    draft ``num_speculative_tokens``, Medusa one token per head."""
    config = json.loads((Path(exported) / "config.json").read_text())
    if config.get("model_type") == "medusa":
        return {"method": "medusa", "model": str(exported), "num_speculative_tokens": config["num_heads"]}
    if config.get("architectures") == ["LlamaForCausalLM"]:  # EAGLE-1 (vLLM names it EagleLlamaForCausalLM)
        return {"method": "eagle", "model": str(exported), "num_speculative_tokens": num_speculative_tokens}
    if config.get("architectures") == ["MiMoForCausalLM"]:  # one MTP layer, run num_speculative_tokens times
        if misread_by_vllm(exported):
            raise SelfspecError(f"vLLM would take {exported} for an EAGLE drafter by its path (it contains 'eagle-', "
                                "'eagle3', 'dflash' or 'dspark'): export the MTP layout to a folder named otherwise")
        return {"method": "mtp", "model": str(exported), "num_speculative_tokens": num_speculative_tokens}
    return {"method": "eagle3", "model": str(exported), "num_speculative_tokens": num_speculative_tokens}


def vllm_target_overrides(spec: dict[str, Any]) -> dict[str, Any] | None:
    """What the target's config must add for the drafter ``spec`` (``hf_overrides``): vLLM builds an MTP drafter from
    the target's config, which must then say it has one MTP layer."""
    return {"num_nextn_predict_layers": 1} if spec["method"] == "mtp" else None


def vllm_serve_flags(exported: str | Path, num_speculative_tokens: int = 3) -> list[str]:
    """``vllm serve TARGET`` flags that draft with ``exported``: the speculative config and any target overrides."""
    spec = vllm_speculative_config(exported, num_speculative_tokens)
    overrides = vllm_target_overrides(spec)
    return ["--speculative-config", json.dumps(spec)] + (["--hf-overrides", json.dumps(overrides)] if overrides else [])
