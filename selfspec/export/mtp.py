"""Normed eagle heads as the MTP layer vLLM runs for MiMo (method ``mtp``): the same computation, renamed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..errors import SelfspecError
from .eagle1 import eagle1_tensors
from .common import check_tensors, eagle_layer, llama_fields, load_target, save


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


def export_mtp(folder: str | Path, meta: dict[str, Any], out: Path, base: str | None, dtype: torch.dtype) -> Path:
    """A normed eagle head as vLLM's MiMo MTP layer (method ``mtp``): the same computation, renamed."""
    from ..zoo import resolve

    tensors, _, layer, name, tc = eagle_layer(folder, meta, base)
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
    target = load_target(name, dtype)  # vLLM's loader wants both (then shares)
    mtp["model.embed_tokens.weight"] = target.get_input_embeddings().weight.detach()
    mtp["lm_head.weight"] = target.get_output_embeddings().weight.detach().clone()  # tied: a copy of its own
    engine = llama_fields(layer, "vocab_size")
    engine.update(model_type="qwen2", architectures=["MiMoForCausalLM"], num_hidden_layers=1,
                  num_nextn_predict_layers=1, use_sliding_window=False, tie_word_embeddings=False,
                  base_model=resolve(name))
    return save(mtp, engine, out, dtype)
