"""Normed eagle heads as vLLM's EAGLE-3 drafter with two layers computing what the head computes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..errors import SelfspecError
from .eagle1 import eagle1_tensors
from .eagle3 import ARCHITECTURE
from .common import check_tensors, eagle_layer, llama_fields, load_target, save


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


def export_eagle_as_eagle3(folder: str | Path, meta: dict[str, Any], out: Path, base: str | None,
                            dtype: torch.dtype) -> Path:
    """A normed eagle head as vLLM's EAGLE-3 drafter with two layers (method ``eagle3``, the head's draft vocabulary).

    vLLM's EAGLE-3 layer 0 attends over [norm(embedding); norm(feature)] and adds the normed feature to the
    residual stream. Here its attention sees only the token itself (query = key from biases, ``self_attending``),
    its values are [W_e, W_f - I] over that input and its o_proj the identity, its MLP zero, so the residual stream
    leaving it is fc's output, W_f norm(f) + W_e norm(e); layer 1 is the head's own layer (key/value heads repeated
    to one per query head, as layer 0 needs), the final norm the head's, fed back normed (``norm_output``).
    """
    from ..zoo import resolve

    tensors, d2t, layer, name, tc = eagle_layer(folder, meta, base)
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
    out_tensors["lm_head.weight"] = load_target(name, dtype).get_output_embeddings().weight.detach()[d2t].clone()
    if d2t.numel() < tc.vocab_size:  # vLLM maps draft ids only for a smaller vocabulary
        out_tensors["d2t"] = d2t - torch.arange(d2t.numel())  # EAGLE-3's convention: target id - draft id
    engine = llama_fields(layer, "vocab_size")
    engine.update(model_type="llama", architectures=[ARCHITECTURE], num_hidden_layers=2, num_key_value_heads=heads,
                  head_dim=dim, attention_bias=True, draft_vocab_size=d2t.numel(), vocab_size=tc.vocab_size,
                  target_hidden_size=h, tie_word_embeddings=False, norm_before_residual=True, norm_output=True,
                  eagle_config={"use_aux_hidden_state": False}, base_model=resolve(name))
    return save(out_tensors, engine, out, dtype)
