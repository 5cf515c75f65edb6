"""What the exports share: the base model's name and config, the checks of tensor names and shapes, the writer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ..errors import SelfspecError
from ..checkpoint.format import read_tensors


def base_name(meta: dict[str, Any], base: str | None) -> str:
    """The base model the heads were trained on: ``base`` if given, else the name the heads folder records."""
    name = base or meta["base"].get("name_or_path")
    if not name:
        raise SelfspecError("the heads folder does not name its base model: pass base= (a zoo name, folder or hub id)")
    return name


LLAMA_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "rms_norm_eps", "max_position_embeddings", "rope_parameters", "hidden_act", "attention_bias",
                "mlp_bias")


def llama_fields(layer: dict[str, Any], *extra: str) -> dict[str, Any]:
    """The one-layer Llama config's fields an engine reads (and ``extra`` ones), the rotary base also flat: older
    readers (SGLang, transformers < 5) look for ``rope_theta``."""
    core = {k: layer[k] for k in LLAMA_FIELDS + extra if layer.get(k) is not None}
    rope = core.get("rope_parameters") or {}
    if "rope_theta" in rope:
        core["rope_theta"] = rope["rope_theta"]
    return core


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


def eagle_layer(folder: str | Path, meta: dict[str, Any], base: str | None
                 ) -> tuple[dict[str, torch.Tensor], torch.Tensor, dict[str, Any], str, Any]:
    """An eagle heads folder's tensors (``decoder.`` dropped) and its ``d2t``, its layer's config as a dict (the
    target's vocabulary, ``qkv_bias`` and ``attention_bias`` as the tensors have them), the base model's name and
    text config."""
    from ..heads.config import config_from_dict
    from ..heads.eagle3 import layer_config
    from ..zoo import load_config

    name = base_name(meta, base)
    target_config = load_config(name)
    tc = target_config.get_text_config()
    tensors = {k.removeprefix("decoder."): v for k, v in read_tensors(folder).items()}
    d2t = tensors.pop("d2t")
    attn = "layers.0.self_attn."
    layer = layer_config(target_config, config_from_dict("eagle", meta["config"])).to_dict()
    layer.update(vocab_size=tc.vocab_size, hidden_act=getattr(tc, "hidden_act", "silu"),
                 qkv_bias=attn + "q_proj.bias" in tensors, attention_bias=attn + "o_proj.bias" in tensors)
    return tensors, d2t, layer, name, tc


def load_target(name: str, dtype: torch.dtype) -> torch.nn.Module:
    """The base model itself, for the embedding and LM head an engine's checkpoint carries."""
    from transformers import AutoModelForCausalLM

    from ..zoo import _from_pretrained

    return _from_pretrained(AutoModelForCausalLM, name, dtype=dtype)


def save(tensors: dict[str, torch.Tensor], config: dict[str, Any], out: Path, dtype: torch.dtype) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in tensors.items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
