"""Training examples and the frozen target's hidden states for them, optionally cached on disk.

An example is ``input_ids`` and ``loss_mask`` (1 on assistant tokens) plus the target's hidden
states at the layers the head family learns from. Running the target is most of the cost of an
epoch, so with caching it runs once: tensors go to safetensors shards (bf16) under the run folder,
an index is written last; an interrupted pass resumes, and a larger run reuses the shards it shares.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.utils.data import Dataset
from tqdm.auto import tqdm

from ..data import tokenize_for_training

SHARD = 64  # examples per shard
TOKEN_KEYS = ("input_ids", "loss_mask")


def tokenize_all(tokenizer, conversations: list[list[dict]], max_length: int) -> list[dict[str, torch.Tensor]]:
    """Token ids and assistant-token loss masks; conversations with no assistant token are dropped."""
    out = []
    for messages in tqdm(conversations, desc="tokenize", unit="conv"):
        enc = tokenize_for_training(tokenizer, messages, max_length)
        if sum(enc["loss_mask"]) >= 2:
            out.append({"input_ids": torch.tensor(enc["input_ids"]), "loss_mask": torch.tensor(enc["loss_mask"])})
    return out


class FeatureCache(Dataset):
    """Examples with cached target hidden states, read lazily from safetensors shards."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        index = json.loads((self.folder / "index.json").read_text())
        self.count, self.keys = index["count"], index["keys"]

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        shard = self.folder / f"shard-{i // SHARD:05d}.safetensors"
        with safe_open(str(shard), framework="pt") as f:
            return {k: f.get_tensor(f"{i}.{k}") if k in TOKEN_KEYS else f.get_tensor(f"{i}.{k}").float()
                    for k in self.keys}


# What decides only *which* tokens are cached: each shard's tokens are compared before it is reused, so a change
# here (more examples, another source appended to the data list) keeps every shard that still holds the same
# conversations. The rest (the model, the family's feature layers) names the cache's own subfolder.
VOLATILE = ("count", "max_examples", "data", "max_length", "heldout_fraction")


def _stable(signature: dict) -> dict:
    return {k: v for k, v in signature.items() if k not in VOLATILE}


def cache_folder(folder: Path, signature: dict) -> Path:
    """Where a cache lives under ``folder``: a subfolder per model and feature settings (all but ``VOLATILE``), so
    runs sharing one ``--feature-dir`` with other models or layers never touch each other's files."""
    digest = hashlib.sha256(json.dumps(_stable(signature), sort_keys=True).encode()).hexdigest()[:12]
    return Path(folder) / digest


def _shard_holds(path: Path, examples: list[dict[str, torch.Tensor]], first: int, last: int,
                 keys: tuple[str, ...]) -> bool:
    """Whether a shard on disk holds examples first..last-1 (same tokens, every key). A last shard written by a
    larger run over the same examples holds more after them: it is kept (runs sharing a folder read their own
    examples of it; rewriting it would take theirs from a run still reading it)."""
    if not path.is_file():
        return False
    with safe_open(str(path), framework="pt") as f:
        names = set(f.keys())
        wanted = {f"{i}.{k}" for i in range(first, last) for k in (*TOKEN_KEYS, *keys)}
        if not wanted <= names:
            return False
        return all(torch.equal(f.get_tensor(f"{i}.input_ids"), examples[i]["input_ids"]) for i in range(first, last))


def build_feature_cache(feature_fn: Callable[[torch.Tensor], dict[str, torch.Tensor]],
                        examples: list[dict[str, torch.Tensor]], keys: tuple[str, ...], folder: Path,
                        device: torch.device | str = "cpu", signature: dict | None = None,
                        rank: int = 0, world: int = 1, wait: Callable[[], None] = lambda: None) -> FeatureCache:
    """Run ``feature_fn`` ((1, T) ids -> {key: (1, T, H)}) over ``examples`` once and store it all.

    ``signature`` (base model, feature settings, data settings) is stored with the cache, in its own subfolder of
    ``folder`` (:func:`cache_folder`). Every shard already there that holds exactly the examples it should (same
    tokens) is kept: an interrupted pass resumes, and a run with more examples (``max_examples``, or a source
    appended to ``data``) computes only the new shards. A different model or feature setting has a cache of its own.

    Several processes (``rank`` of ``world``, ``wait`` their barrier) build it together: process r computes the
    shards s with s % world == r, each written under a temporary name of its own and renamed whole; process 0
    alone starts the folder and writes the index last, once every shard is there.
    """
    signature = {**(signature or {}), "count": len(examples), "keys": list(keys)}
    folder = cache_folder(folder, signature)
    index = folder / "index.json"
    if rank == 0:
        _start_cache(folder, signature)
    wait()  # every process now sees the same folder
    if index.is_file() and json.loads(index.read_text())["count"] == len(examples):
        return FeatureCache(folder)
    mine = range(rank, (len(examples) + SHARD - 1) // SHARD, world)
    bar = tqdm(total=sum(min(SHARD, len(examples) - s * SHARD) for s in mine), desc="cache target features",
               unit="conv", disable=rank != 0)
    for s in mine:
        first, last = s * SHARD, min((s + 1) * SHARD, len(examples))
        path = folder / f"shard-{s:05d}.safetensors"
        if not _shard_holds(path, examples, first, last, keys):  # else written whole by an earlier pass
            _write_shard(feature_fn, examples, first, last, keys, path, device)
        bar.update(last - first)
    bar.close()
    wait()
    if rank == 0:
        index.write_text(json.dumps({"count": len(examples), "keys": [*TOKEN_KEYS, *keys]}))
    wait()
    return FeatureCache(folder)


def _start_cache(folder: Path, signature: dict) -> None:
    """Make the folder; drop the index of a cache of other examples (its shards are checked one by one)."""
    sig_file = folder / "signature.json"
    index = folder / "index.json"
    if index.is_file() and json.loads(index.read_text())["count"] == signature["count"]:
        return
    index.unlink(missing_ok=True)
    folder.mkdir(parents=True, exist_ok=True)
    sig_file.write_text(json.dumps(signature))


def _write_shard(feature_fn: Callable[[torch.Tensor], dict[str, torch.Tensor]],
                 examples: list[dict[str, torch.Tensor]], first: int, last: int, keys: tuple[str, ...], path: Path,
                 device: torch.device | str) -> None:
    """Examples first..last-1 with their states, written to a temporary file of this process, then renamed."""
    tensors = {}
    for i in range(first, last):
        ex = examples[i]
        feats = feature_fn(ex["input_ids"][None].to(device))
        tensors[f"{i}.input_ids"] = ex["input_ids"]
        tensors[f"{i}.loss_mask"] = ex["loss_mask"]
        for k in keys:
            tensors[f"{i}.{k}"] = feats[k][0].to(torch.bfloat16).cpu().contiguous()
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # own name: runs sharing the folder never collide
    save_file(tensors, str(tmp))
    tmp.rename(path)


class TokenDataset(Dataset):
    """Examples without cached states: the training loop runs the target per batch."""

    def __init__(self, examples: list[dict[str, torch.Tensor]]) -> None:
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.examples[i]


def pad_batch(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-pad every tensor to the longest sequence; adds ``attention_mask``. Padding has loss_mask 0."""
    length = max(it["input_ids"].numel() for it in items)
    batch = {}
    for key in items[0]:
        rows = []
        for it in items:
            t = it[key]
            pad = length - t.shape[0]
            rows.append(torch.nn.functional.pad(t, (0, 0, 0, pad) if t.dim() == 2 else (0, pad)))
        batch[key] = torch.stack(rows)
    batch["attention_mask"] = torch.stack(
        [torch.arange(length) < it["input_ids"].numel() for it in items]).long()
    return batch
