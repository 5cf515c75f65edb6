"""The augmented checkpoint: trained draft heads in a folder, attached to a frozen base model.

A heads folder holds two files (format: ``checkpoints/README.md``; a model card README.md and the
training run's train_config.json may sit beside them, and loading ignores them):

    selfspec_heads.json   format_version, head family + config, the base model's identity
    heads.safetensors     the trained tensors only (never the frozen base)

or, saved with ``max_shard_size`` (Hugging Face's sharding convention), ``heads.safetensors.index.json``
and the shards it maps every tensor to (``heads-00001-of-00003.safetensors``, ...).

A *merged* folder also holds the base, saved with ``save_pretrained`` (config, weights, tokenizer),
so ``load_augmented(folder)`` restores model, tokenizer and drafter in one call. Loading is strict
about tensors (missing, unexpected, wrong shape) and about the base (architecture, hidden size,
layers, vocabulary, tokenizer), each failure one :class:`SelfspecError` naming both sides; unknown
config keys are dropped with a warning.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from .drafters.base import Drafter
from .errors import SelfspecError
from .heads import build_heads, make_drafter
from .heads.common import placement, text_config, trained_parameter_count
from .heads.config import config_from_dict, config_to_dict

FORMAT_VERSION = 1
CONFIG_FILE = "selfspec_heads.json"
WEIGHTS_FILE = "heads.safetensors"
INDEX_FILE = WEIGHTS_FILE + ".index.json"
SHARD_PATTERN = "heads{suffix}.safetensors"  # huggingface_hub's filename pattern: heads-00001-of-00002.safetensors
_TOP_KEYS = {"format_version", "family", "config", "base", "trained_parameters", "dtype", "merged"}
_COMPARED = ("architecture", "hidden_size", "num_hidden_layers", "vocab_size")


# --- the base model's identity -------------------------------------------------------------------

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


def _display_name(model: nn.Module, base_name: str | None) -> str:
    """A zoo name when the model was loaded from a zoo folder, else its name or path."""
    if base_name:
        return base_name
    path = getattr(model, "name_or_path", "") or getattr(model.config, "_name_or_path", "")
    from .zoo import ZOO, model_folder

    for name in ZOO:
        if path and Path(path).expanduser().resolve() == model_folder(name).resolve():
            return name
    return path or "an unnamed model"


def base_identity(model: nn.Module, tokenizer=None, base_name: str | None = None) -> dict[str, Any]:
    """What a heads checkpoint records about its base model."""
    cfg = text_config(model.config)
    archs = getattr(model.config, "architectures", None)
    return {
        "name_or_path": _display_name(model, base_name),
        "architecture": archs[0] if archs else type(model).__name__,
        "model_type": getattr(cfg, "model_type", None),
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "vocab_size": model.get_output_embeddings().out_features,
        "parameters": sum(p.numel() for p in model.parameters()),
        "dtype": str(placement(model)[1]).removeprefix("torch."),
        "tokenizer_sha256": tokenizer_fingerprint(tokenizer) if tokenizer is not None else None,
        "embedding_sha256": embedding_fingerprint(model),
    }


def _describe(base: dict[str, Any]) -> str:
    return (f"{base.get('name_or_path')} ({base.get('architecture')}, hidden {base.get('hidden_size')}, "
            f"{base.get('num_hidden_layers')} layers, vocab {base.get('vocab_size')})")


def check_base(saved: dict[str, Any], actual: dict[str, Any], folder: Path) -> None:
    """Raise one clear error when the heads in ``folder`` were trained for a different base."""
    diffs = [k for k in _COMPARED if saved.get(k) != actual.get(k)]
    if not diffs:  # same shapes: then the tokens themselves must agree
        for key, what in (("tokenizer_sha256", "tokenizer vocabulary"), ("embedding_sha256", "special token ids")):
            if saved.get(key) and actual.get(key) and saved[key] != actual[key]:
                diffs.append(what)
    if diffs:
        raise SelfspecError(f"heads in {folder} were trained for {_describe(saved)} but the base is "
                            f"{_describe(actual)}: {', '.join(diffs)} differ")


# --- saving ----------------------------------------------------------------------------------------

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
    return _write_folder(folder, meta, tensors, max_shard_size)


def _write_folder(folder: Path, meta: dict[str, Any], tensors: dict[str, torch.Tensor],
                  max_shard_size: int | str | None) -> Path:
    """The weights first, then ``selfspec_heads.json`` (a folder with the JSON has its weights)."""
    _write_tensors(tensors, folder, meta["family"], max_shard_size)
    (folder / CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return folder


def export_heads(source: str | Path, folder: str | Path, dtype: torch.dtype | None = None,
                 max_shard_size: int | str | None = None) -> Path:
    """Copy a heads folder to ``folder`` with its weights cast to ``dtype`` and/or re-sharded; no base model needed.

    The model card (README.md) and train_config.json come along when present.
    """
    source, folder = Path(source), Path(folder)
    meta = read_heads_json(source)
    tensors = _cast(read_tensors(source), dtype)
    folder.mkdir(parents=True, exist_ok=True)
    if dtype is not None:
        meta["dtype"] = str(dtype).removeprefix("torch.")
    _write_folder(folder, meta, tensors, max_shard_size)
    for extra in ("README.md", "train_config.json"):
        if (source / extra).is_file() and source.resolve() != folder.resolve():
            (folder / extra).write_bytes((source / extra).read_bytes())
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
    return save_heads(heads_module, base_model, folder, tokenizer, base_name or _display_name(base_model, None),
                      merged=True, **kwargs)


# --- loading ---------------------------------------------------------------------------------------

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
    unknown = sorted(set(meta) - _TOP_KEYS)
    if unknown:
        warnings.warn(f"ignoring unknown keys {unknown} in {path}", stacklevel=2)
    return {k: v for k, v in meta.items() if k in _TOP_KEYS}


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


def read_tensors(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every stored tensor of a heads folder, from one file or all its shards."""
    tensors: dict[str, torch.Tensor] = {}
    for path in weight_files(folder):
        tensors.update(load_file(str(path)))
    return tensors


def _check_tensors(module: nn.Module, tensors: dict[str, torch.Tensor], folder: Path) -> None:
    """One error listing every missing, unexpected or misshapen tensor."""
    want = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in tensors.items()}
    problems = []
    if missing := sorted(set(want) - set(got)):
        problems.append(f"missing {missing}")
    if unexpected := sorted(set(got) - set(want)):
        problems.append(f"unexpected {unexpected}")
    wrong = [f"{k}: file {got[k]} vs expected {want[k]}" for k in sorted(set(want) & set(got)) if want[k] != got[k]]
    if wrong:
        problems.append(f"wrong shapes {wrong}")
    if problems:
        raise SelfspecError(f"the weights in {folder} do not match its {module.config.family} config: "
                            f"{'; '.join(problems)}")


def load_heads(base: nn.Module | str, folder: str | Path, tokenizer=None) -> tuple[nn.Module, Drafter]:
    """Attach the heads in ``folder`` to ``base`` (a loaded model, or a zoo name / folder / hub id to load).

    Returns (heads module, drafter); with a name, the loaded base is ``drafter.target``.
    """
    folder = Path(folder)
    meta = read_heads_json(folder)
    if isinstance(base, str):
        from .zoo import load_model

        base, loaded_tokenizer = load_model(base)
        tokenizer = tokenizer if tokenizer is not None else loaded_tokenizer
    check_base(meta["base"], base_identity(base, tokenizer), folder)
    config = config_from_dict(meta["family"], meta["config"])
    device, dtype = placement(base)
    heads = build_heads(config, base.config, device, dtype)
    tensors = read_tensors(folder)
    _check_tensors(heads, tensors, folder)
    heads.load_state_dict(tensors, strict=True)
    heads.eval().requires_grad_(False)
    return heads, make_drafter(heads, base)


def load_augmented(folder: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
                   ) -> tuple[nn.Module, Any, Drafter]:
    """Load a merged folder (``save_merged``): (base model, tokenizer, drafter)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise SelfspecError(f"{folder} holds heads only (no base config.json): use load_heads(base, folder)")
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
        tokenizer = AutoTokenizer.from_pretrained(folder) if (folder / "tokenizer_config.json").is_file() else None
    except OSError as exc:
        raise SelfspecError(f"could not load the base model in {folder}: {str(exc).splitlines()[0]}") from exc
    model.requires_grad_(False)
    _, drafter = load_heads(model, folder, tokenizer)
    return model, tokenizer, drafter


# --- inspection ------------------------------------------------------------------------------------

def _tensor_sizes(path: Path) -> tuple[int, int]:
    """(floating-point parameters, bytes) of a safetensors file, read from its header only."""
    params = nbytes = 0
    with safe_open(str(path), "pt") as f:
        for key in f.keys():
            t = f.get_slice(key)
            n = 1
            for s in t.get_shape():
                n *= s
            size = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "F16": 2, "BF16": 2, "I16": 2}.get(t.get_dtype(), 1)
            nbytes += n * size
            params += n if t.get_dtype().startswith(("F", "BF")) else 0
    return params, nbytes


def count_parameters(config) -> int:
    """Parameters of a causal LM built from ``config`` on the meta device (no weights loaded or allocated)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def _local_base_config(folder: Path, name: str | None):
    """The base's config when it is on disk (merged folder, local folder, cached zoo model), else None."""
    from transformers import AutoConfig

    from .zoo import ZOO, is_cached, model_folder

    for where in (folder, Path(name).expanduser() if name else None,
                  model_folder(name) if name in ZOO and is_cached(name) else None):
        if where is not None and (where / "config.json").is_file():
            return AutoConfig.from_pretrained(where)
    return None


def heads_info(folder: str | Path) -> dict[str, Any]:
    """What the heads in ``folder`` cost beside their base: parameters, bytes, ratio (no base weights loaded)."""
    folder = Path(folder)
    meta = read_heads_json(folder)
    base = meta["base"]
    sizes = [_tensor_sizes(path) for path in weight_files(folder)]
    params, nbytes = sum(p for p, _ in sizes), sum(b for _, b in sizes)
    config = _local_base_config(folder, base.get("name_or_path"))
    base_params = count_parameters(config) if config is not None else base.get("parameters")
    return {
        "folder": str(folder),
        "family": meta["family"],
        "format_version": meta["format_version"],
        "config": meta["config"],
        "base": _describe(base),
        "merged": bool(meta.get("merged")),
        "heads_parameters": params,
        "heads_bytes": nbytes,
        "heads_dtype": meta.get("dtype"),
        "heads_mb_bf16": round(params * 2 / 2**20, 2),
        "base_parameters": base_params,
        "base_mb_bf16": round(base_params * 2 / 2**20, 1) if base_params else None,
        "heads_to_base_ratio": round(params / base_params, 5) if base_params else None,
        **_resident(meta, params, base_params),
    }


def _resident(meta: dict[str, Any], params: int, base_params: int | None) -> dict[str, Any]:
    """Parameters resident while drafting: the heads plus EAGLE's gathered LM-head rows of a reduced vocabulary."""
    copied = 0
    vocab, hidden = meta["base"].get("vocab_size"), meta["base"].get("hidden_size")
    draft_vocab = meta["config"].get("draft_vocab_size") if meta["family"] == "eagle" else None
    if draft_vocab and vocab and hidden and draft_vocab < vocab:
        copied = draft_vocab * hidden
    resident = params + copied
    return {"resident_parameters": resident, "resident_mb_bf16": round(resident * 2 / 2**20, 2),
            "resident_to_base_ratio": round(resident / base_params, 5) if base_params else None}
