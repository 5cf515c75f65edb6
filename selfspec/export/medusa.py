"""medusa heads as vLLM's Medusa drafter: the residual blocks renamed, the target's LM head copied in once."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ..errors import SelfspecError
from ..checkpoint.format import read_tensors
from .common import base_name, load_target


def medusa_tensor_names(num_heads: int, num_layers: int) -> dict[str, str]:
    """selfspec's Medusa tensor names -> vLLM's (``Medusa`` with ``medusa_fc_bias``)."""
    return {f"heads.{i}.{j}.linear.{p}": f"blocks.{i}.layers.{j}.{p}"
            for i in range(num_heads) for j in range(num_layers) for p in ("weight", "bias")}


def export_medusa(folder: str | Path, meta: dict[str, Any], out: Path, base: str | None, dtype: torch.dtype) -> Path:
    """vLLM's Medusa drafter: the residual blocks renamed, the target's LM head copied in once."""
    from ..heads.config import config_from_dict
    from ..zoo import resolve

    name = base_name(meta, base)
    config = config_from_dict("medusa", meta["config"])
    names = medusa_tensor_names(config.num_heads, config.num_layers)
    tensors = read_tensors(folder)
    missing, unexpected = sorted(set(names) - set(tensors)), sorted(set(tensors) - set(names))
    if missing or unexpected:
        raise SelfspecError(f"these tensors do not form Medusa heads: missing {missing}, unexpected {unexpected}")
    head = load_target(name, dtype).get_output_embeddings()
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
