"""eagle3 heads as the EAGLE-3 drafter vLLM and SGLang load, and in the speculators format (a copy, checked)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ..errors import SelfspecError
from ..checkpoint.format import read_tensors
from .common import base_name, check_tensors, llama_fields


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


def layer_dict(meta: dict[str, Any], base: str | None) -> tuple[dict[str, Any], int, str]:
    """The midlayer's Llama config as a dict, the target's vocabulary size, the base's folder or hub id."""
    from ..heads.config import config_from_dict
    from ..heads.eagle3 import layer_config
    from ..zoo import load_config, resolve

    name = base_name(meta, base)
    target_config = load_config(name)
    name = resolve(name)  # a zoo name becomes its local folder: what an engine can load
    config = config_from_dict("eagle3", meta["config"])
    layer = layer_config(target_config, config).to_dict()
    layer["draft_vocab_size"] = config.draft_vocab_size
    vocab = target_config.get_text_config().vocab_size
    return layer, vocab, name


def engine_config(layer: dict[str, Any], aux: list[int], vocab: int, fmt: str, base: str, tokens: int,
                   dtype: torch.dtype) -> dict[str, Any]:
    core = llama_fields(layer, "draft_vocab_size")
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


def export_eagle3(folder: str | Path, meta: dict[str, Any], out: Path, fmt: str, base: str | None,
                  num_speculative_tokens: int, dtype: torch.dtype) -> Path:
    """eagle3 heads in ``fmt``'s layout: their tensors copied (cast), the engine's config written."""
    layer, vocab, name = layer_dict(meta, base)
    aux = list(meta["config"]["aux_layers"])
    tensors = read_tensors(folder)
    check_tensors(tensors, expected_tensors(layer, vocab, len(aux)))
    if fmt == "sglang" and min(aux) < 1:
        raise SelfspecError(f"aux layers {aux} include the embeddings, which SGLang cannot capture")
    out.mkdir(parents=True, exist_ok=True)
    cast = {k: v.to(dtype) if v.is_floating_point() else v.contiguous() for k, v in tensors.items()}
    save_file(cast, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = engine_config(layer, aux, vocab, fmt, name, num_speculative_tokens, dtype)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
