"""The files of a heads folder, and reading them back checked: every problem is one :class:`SelfspecError`."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from ..errors import SelfspecError

FORMAT_VERSION = 1
CONFIG_FILE = "selfspec_heads.json"
WEIGHTS_FILE = "heads.safetensors"
INDEX_FILE = WEIGHTS_FILE + ".index.json"
SHARD_PATTERN = "heads{suffix}.safetensors"  # huggingface_hub's filename pattern: heads-00001-of-00002.safetensors
TOP_KEYS = {"format_version", "family", "config", "base", "trained_parameters", "dtype", "merged"}


def read_heads_json(folder: str | Path) -> dict[str, Any]:
    """The checked contents of ``selfspec_heads.json`` (unknown top-level keys warned about and dropped)."""
    folder = Path(folder)
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise SelfspecError(f"{folder} is not a selfspec heads folder (no {CONFIG_FILE})")
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise SelfspecError(f"{path} is not valid JSON: {exc}") from exc
    version = meta.get("format_version")
    if not isinstance(version, int):
        raise SelfspecError(f"{path} has no integer format_version")
    if version > FORMAT_VERSION:
        raise SelfspecError(f"{folder} uses heads format {version}; this selfspec reads up to {FORMAT_VERSION}: "
                            "upgrade selfspec")
    missing = [k for k in ("family", "config", "base") if k not in meta]
    if missing:
        raise SelfspecError(f"{path} lacks {missing}")
    unknown = sorted(set(meta) - TOP_KEYS)
    if unknown:
        warnings.warn(f"ignoring unknown keys {unknown} in {path}", stacklevel=2)
    return {k: v for k, v in meta.items() if k in TOP_KEYS}


def weight_files(folder: str | Path) -> list[Path]:
    """The weight files of a heads folder: ``heads.safetensors``, or the shards its index names (all checked to exist)."""
    folder = Path(folder)
    single, index = folder / WEIGHTS_FILE, folder / INDEX_FILE
    if single.is_file() and index.is_file():
        raise SelfspecError(f"{folder} holds both {WEIGHTS_FILE} and {INDEX_FILE}: remove the stale one")
    if single.is_file():
        return [single]
    if not index.is_file():
        raise SelfspecError(f"{folder} has {CONFIG_FILE} but no {WEIGHTS_FILE} (nor {INDEX_FILE}): "
                            "an incomplete heads checkpoint")
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise SelfspecError(f"{index} is not a safetensors index (JSON with a weight_map): {exc}") from exc
    shards = [folder / name for name in sorted(set(weight_map.values()))]
    if missing := [p.name for p in shards if not p.is_file()]:
        raise SelfspecError(f"{index} names shards that are not in {folder}: {missing}")
    return shards


def _unreadable(path: Path, exc: Exception) -> SelfspecError:
    reason = str(exc).removeprefix("Error while deserializing header: ")
    return SelfspecError(f"{path} is not a complete safetensors file ({reason}): cut short or damaged in a copy? "
                         "save or fetch the heads again")


def open_weights(path: Path):
    """``safe_open`` on one weight file (its header is read and checked against the file's size)."""
    try:
        return safe_open(str(path), "pt")
    except SafetensorError as exc:
        raise _unreadable(path, exc) from exc


def read_tensors(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every stored tensor of a heads folder, from one file or all its shards."""
    tensors: dict[str, torch.Tensor] = {}
    for path in weight_files(folder):
        try:
            tensors.update(load_file(str(path)))
        except SafetensorError as exc:
            raise _unreadable(path, exc) from exc
    return tensors


def check_heads_folder(folder: str | Path) -> dict[str, Any]:
    """``selfspec_heads.json`` of ``folder``, after checking that every weight file is whole (headers only:
    cheap, so a command can refuse a broken folder before it loads any model)."""
    meta = read_heads_json(folder)
    for path in weight_files(folder):
        with open_weights(path):
            pass
    return meta
