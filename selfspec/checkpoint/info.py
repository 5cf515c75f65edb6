"""What a heads folder costs beside its base model, read from the files' headers (no weights loaded)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..heads.config import config_from_dict
from ..memory import weight_numel
from .format import open_weights, read_heads_json, weight_files
from .identity import describe

_BYTES = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "F16": 2, "BF16": 2, "I16": 2}


def _tensor_sizes(path: Path) -> tuple[int, int]:
    """(floating-point parameters, bytes) of a safetensors file, read from its header only."""
    params = nbytes = 0
    with open_weights(path) as f:
        for key in f.keys():
            t = f.get_slice(key)
            n = 1
            for s in t.get_shape():
                n *= s
            nbytes += n * _BYTES.get(t.get_dtype(), 1)
            params += n if t.get_dtype().startswith(("F", "BF")) else 0
    return params, nbytes


def count_parameters(config) -> int:
    """Parameters of a causal LM built from ``config`` on the meta device (no weights loaded or allocated)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return weight_numel(model)


def _local_base_config(folder: Path, name: str | None):
    """The base's config when it is on disk (merged folder, local folder, cached zoo model), else None."""
    from transformers import AutoConfig

    from ..zoo import ZOO, is_cached, model_folder

    for where in (folder, Path(name).expanduser() if name else None,
                  model_folder(name) if name in ZOO and is_cached(name) else None):
        if where is not None and (where / "config.json").is_file():
            return AutoConfig.from_pretrained(where)
    return None


def _ratio(part: int, whole: int | None) -> float | None:
    return round(part / whole, 5) if whole else None


def heads_info(folder: str | Path) -> dict[str, Any]:
    """What the heads in ``folder`` cost beside their base: parameters, bytes, ratio (no base weights loaded).

    *Resident* parameters add what the drafter copies out of the base while drafting (the family says
    how many: EAGLE's gathered LM-head rows of a reduced vocabulary).
    """
    folder = Path(folder)
    meta = read_heads_json(folder)
    base = meta["base"]
    sizes = [_tensor_sizes(path) for path in weight_files(folder)]
    params, nbytes = sum(p for p, _ in sizes), sum(b for _, b in sizes)
    config = _local_base_config(folder, base.get("name_or_path"))
    base_params = count_parameters(config) if config is not None else base.get("parameters")
    head_config = config_from_dict(meta["family"], meta["config"])
    resident = params + head_config.copied_parameters(base.get("vocab_size") or 0, base.get("hidden_size") or 0)
    return {
        "folder": str(folder),
        "family": meta["family"],
        "format_version": meta["format_version"],
        "config": meta["config"],
        "base": describe(base),
        "merged": bool(meta.get("merged")),
        "heads_parameters": params,
        "heads_bytes": nbytes,
        "heads_dtype": meta.get("dtype"),
        "heads_mb_bf16": round(params * 2 / 2**20, 2),
        "base_parameters": base_params,
        "base_mb_bf16": round(base_params * 2 / 2**20, 1) if base_params else None,
        "heads_to_base_ratio": _ratio(params, base_params),
        "resident_parameters": resident,
        "resident_mb_bf16": round(resident * 2 / 2**20, 2),
        "resident_to_base_ratio": _ratio(resident, base_params),
    }
