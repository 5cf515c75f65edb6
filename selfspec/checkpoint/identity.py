"""What a heads checkpoint records about its base model, and the check that a base is the same one."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from torch import nn

from ..errors import SelfspecError
from ..frozen import placement, text_config
from ..memory import weight_numel

COMPARED = ("architecture", "hidden_size", "num_hidden_layers", "vocab_size")


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of the tokenizer's vocabulary (token -> id), sorted: equal iff the same tokens have the same ids."""
    items = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(items, ensure_ascii=False).encode()).hexdigest()


def embedding_fingerprint(model: nn.Module) -> str:
    """sha256 of the embedding shape and special token ids: a weaker check when no tokenizer is given."""
    cfg = text_config(model.config)
    shape = list(model.get_input_embeddings().weight.shape)
    special = [getattr(cfg, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")]
    return hashlib.sha256(json.dumps([shape, special]).encode()).hexdigest()


def display_name(model: nn.Module, base_name: str | None) -> str:
    """A zoo name when the model was loaded from a zoo folder, else its name or path."""
    if base_name:
        return base_name
    path = getattr(model, "name_or_path", "") or getattr(model.config, "_name_or_path", "")
    from ..zoo import ZOO, model_folder

    for name in ZOO:
        if path and Path(path).expanduser().resolve() == model_folder(name).resolve():
            return name
    return path or "an unnamed model"


def base_identity(model: nn.Module, tokenizer=None, base_name: str | None = None) -> dict[str, Any]:
    """What a heads checkpoint records about its base model."""
    cfg = text_config(model.config)
    archs = getattr(model.config, "architectures", None)
    return {
        "name_or_path": display_name(model, base_name),
        "architecture": archs[0] if archs else type(model).__name__,
        "model_type": getattr(cfg, "model_type", None),
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "vocab_size": model.get_output_embeddings().out_features,
        "parameters": weight_numel(model),  # packed linears included (selfspec/target/packed_linear.py)
        "dtype": str(placement(model)[1]).removeprefix("torch."),
        "tokenizer_sha256": tokenizer_fingerprint(tokenizer) if tokenizer is not None else None,
        "embedding_sha256": embedding_fingerprint(model),
    }


def describe(base: dict[str, Any]) -> str:
    """One line naming a recorded base: name, architecture and shapes."""
    return (f"{base.get('name_or_path')} ({base.get('architecture')}, hidden {base.get('hidden_size')}, "
            f"{base.get('num_hidden_layers')} layers, vocab {base.get('vocab_size')})")


def check_base(saved: dict[str, Any], actual: dict[str, Any], folder: Path) -> None:
    """Raise one clear error when the heads in ``folder`` were trained for a different base."""
    diffs = [k for k in COMPARED if saved.get(k) != actual.get(k)]
    if not diffs:  # same shapes: then the tokens themselves must agree
        for key, what in (("tokenizer_sha256", "tokenizer vocabulary"), ("embedding_sha256", "special token ids")):
            if saved.get(key) and actual.get(key) and saved[key] != actual[key]:
                diffs.append(what)
    if diffs:
        raise SelfspecError(f"heads in {folder} were trained for {describe(saved)} but the base is "
                            f"{describe(actual)}: {', '.join(diffs)} differ")
