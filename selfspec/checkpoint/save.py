"""Writing a heads folder: the trained tensors only, then ``selfspec_heads.json`` (format: ``format.py``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from ..frozen import placement, trained_parameter_count
from ..heads.config import config_to_dict
from .format import CONFIG_FILE, FORMAT_VERSION, INDEX_FILE, SHARD_PATTERN, WEIGHTS_FILE, read_heads_json, read_tensors
from .identity import base_identity, display_name


def _trained_tensors(heads: nn.Module) -> dict[str, torch.Tensor]:
    """The head module's own tensors, detached, contiguous, on CPU (each with its own storage)."""
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in heads.state_dict().items()}


def _cast(tensors: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Floating-point tensors in ``dtype`` (None: as they are); integer buffers (EAGLE's ``d2t``) untouched."""
    if dtype is None:
        return tensors
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}


def _write_tensors(tensors: dict[str, torch.Tensor], folder: Path, family: str,
                   max_shard_size: int | str | None) -> None:
    """``heads.safetensors``, or shards + ``heads.safetensors.index.json`` when they exceed ``max_shard_size``.

    The other layout's files are removed first, so a folder never holds both.
    """
    from huggingface_hub import split_torch_state_dict_into_shards

    for old in [folder / WEIGHTS_FILE, folder / INDEX_FILE, *folder.glob("heads-*-of-*.safetensors")]:
        old.unlink(missing_ok=True)
    metadata = {"format": "pt", "selfspec_family": family}
    split = split_torch_state_dict_into_shards(tensors, filename_pattern=SHARD_PATTERN,
                                               max_shard_size=max_shard_size or 2**62)
    if not split.is_sharded:  # one file (possibly with no tensors: early exit without a projection)
        save_file(tensors, str(folder / WEIGHTS_FILE), metadata=metadata)
        return
    for filename, names in split.filename_to_tensors.items():
        save_file({n: tensors[n] for n in names}, str(folder / filename), metadata=metadata)
    index = {"metadata": {**split.metadata, "selfspec_family": family}, "weight_map": split.tensor_to_filename}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _write_folder(folder: Path, meta: dict[str, Any], tensors: dict[str, torch.Tensor],
                  max_shard_size: int | str | None) -> Path:
    """The weights first, then ``selfspec_heads.json`` (a folder with the JSON has its weights)."""
    _write_tensors(tensors, folder, meta["family"], max_shard_size)
    (folder / CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return folder


def save_heads(heads_module: nn.Module, base_model: nn.Module, folder: str | Path, tokenizer=None,
               base_name: str | None = None, merged: bool = False, dtype: torch.dtype | None = None,
               max_shard_size: int | str | None = None) -> Path:
    """Write ``selfspec_heads.json`` and the trained weights only into ``folder``.

    ``dtype`` stores floating-point tensors in another dtype (e.g. ``torch.bfloat16``; loading casts
    them to the base's). ``max_shard_size`` (bytes or "16MB", as in ``save_pretrained``) splits the
    weights into shards with an index when they are larger; by default they go to one file.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = _cast(_trained_tensors(heads_module), dtype)
    stored = dtype or (placement(heads_module)[1] if tensors else placement(base_model)[1])
    meta = {
        "format_version": FORMAT_VERSION,
        "family": heads_module.config.family,
        "config": config_to_dict(heads_module.config),
        "base": base_identity(base_model, tokenizer, base_name),
        "trained_parameters": trained_parameter_count(heads_module),
        "dtype": str(stored).removeprefix("torch."),
        "merged": merged,
    }
    _write_folder(folder, meta, tensors, max_shard_size)
    companions = getattr(heads_module, "write_companions", None)  # e.g. a LoRA exit adapter's peft folder
    if companions is not None:
        companions(folder, base_model, base_name or meta["base"].get("name_or_path"))
    return folder


def export_heads(source: str | Path, folder: str | Path, dtype: torch.dtype | None = None,
                 max_shard_size: int | str | None = None) -> Path:
    """Copy a heads folder to ``folder`` with its weights cast to ``dtype`` and/or re-sharded; no base model needed.

    The model card (README.md), train_config.json and a peft adapter folder come along when present.
    """
    import shutil

    source, folder = Path(source), Path(folder)
    meta = read_heads_json(source)
    tensors = _cast(read_tensors(source), dtype)
    folder.mkdir(parents=True, exist_ok=True)
    if dtype is not None:
        meta["dtype"] = str(dtype).removeprefix("torch.")
    _write_folder(folder, meta, tensors, max_shard_size)
    if source.resolve() == folder.resolve():
        return folder
    for extra in ("README.md", "train_config.json"):
        if (source / extra).is_file():
            (folder / extra).write_bytes((source / extra).read_bytes())
    if (source / "peft").is_dir():  # a LoRA exit adapter's peft folder, its tensors cast as the others
        shutil.copytree(source / "peft", folder / "peft", dirs_exist_ok=True)
        weights = folder / "peft" / "adapter_model.safetensors"
        if dtype is not None and weights.is_file():
            from safetensors.torch import load_file

            save_file(_cast(load_file(str(weights)), dtype), str(weights), metadata={"format": "pt"})
    return folder


def save_merged(heads_module: nn.Module, base_model: nn.Module, folder: str | Path, tokenizer=None,
                base_name: str | None = None, **kwargs) -> Path:
    """Save base (``save_pretrained``: config, weights, tokenizer) and heads into one folder.

    ``kwargs`` (``dtype``, ``max_shard_size``) apply to the heads' weights.
    """
    folder = Path(folder)
    base_model.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return save_heads(heads_module, base_model, folder, tokenizer, base_name or display_name(base_model, None),
                      merged=True, **kwargs)
