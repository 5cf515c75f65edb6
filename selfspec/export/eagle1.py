"""Normed-free eagle heads (EAGLE-1's layout) as vLLM's ``EagleLlamaForCausalLM`` (method ``eagle``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .common import check_tensors, eagle_layer, llama_fields, save


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


def export_eagle1(folder: str | Path, meta: dict[str, Any], out: Path, base: str | None, dtype: torch.dtype) -> Path:
    """vLLM's EAGLE-1 drafter: the layer renamed, ``fc``'s halves swapped, a Llama config with the target's shapes."""
    from ..zoo import resolve

    tensors, _, layer, name, _ = eagle_layer(folder, meta, base)
    check_tensors(tensors, eagle1_tensors(layer), "an EAGLE-1 drafter")
    fc, h = tensors["fc.weight"], layer["hidden_size"]
    tensors["fc.weight"] = torch.cat([fc[:, h:], fc[:, :h]], dim=1)  # [feature; embedding] -> [embedding; feature]
    engine = llama_fields(layer, "qkv_bias", "vocab_size")
    engine.update(model_type="llama", architectures=["LlamaForCausalLM"], num_hidden_layers=1,
                  tie_word_embeddings=False, base_model=resolve(name))
    return save(tensors, engine, out, dtype)
