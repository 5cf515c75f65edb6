"""Row attention: each query row of a pass attends over exactly its own keys, in one call for the whole pass.

The exact pass needs every row's attention computed as a one-token plain step computes it. Through torch's
attention kernel that takes one call per key width, a copy of the keys for every tree path but the first, and
query blocks padded for the kernel's thread buffers (``selfspec/exact.py``). This kernel
(``selfspec/csrc/row_attention.cpp``) is written so that no row's arithmetic depends on the call: a row's keys are
a prefix of its cache row (the cache) then a list of slots (its ancestors and itself), every score, weight and
sum runs in key order with the same vector code, and the work is split by rows, never within one. A plain step
(prefix = its position, then itself) and any tree, chain or batch row at that position therefore give the same
bits, and a pass makes one call per layer: no widths, no gathers, no padding.

Built on first use for this CPU with torch's C++ extension loader (a C++ compiler and ninja; ~20-40 s once, cached
under ``$TORCH_EXTENSIONS_DIR`` or ~/.cache/torch_extensions); AVX-512 only. Where it cannot be built or used (no
compiler, another CPU, a GPU, ``SELFSPEC_ROW_ATTENTION=0``) the exact pass uses torch's kernel as before.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from importlib.resources import as_file, files

import torch

log = logging.getLogger(__name__)

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@functools.cache
def kernel():
    """The built extension, or None where it is off or cannot be built here (said once)."""
    if os.environ.get("SELFSPEC_ROW_ATTENTION", "1") == "0":
        return None
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        return None
    try:
        from torch.utils.cpp_extension import load

        log.info("building the row attention kernel for this CPU (once)")
        with as_file(files("selfspec") / "csrc" / "row_attention.cpp") as source:  # package data
            module = load(name="selfspec_row_attention", sources=[str(source)], verbose=False,
                          extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"])
    except Exception as err:  # noqa: BLE001 - any build failure means: use torch's kernel
        log.warning("row attention kernel unavailable (%s); the exact pass uses torch's attention kernel",
                    str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__)
        return None
    return module if module.row_attention_available() else None


def used(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether an exact pass on ``device`` in ``dtype`` attends through the kernel."""
    return torch.device(device).type == "cpu" and dtype in DTYPES and kernel() is not None


@dataclass
class RowKeys:
    """Every real row of a pass (B entries x q rows, flattened) and its keys: slots 0..prefix-1 of its entry's
    cache, then ``extra[:count]`` (its ancestors from the root, then itself)."""

    index: torch.Tensor | None  # the real rows among the B x q (None: all of them)
    entry: torch.Tensor
    prefix: torch.Tensor
    extra: torch.Tensor
    count: torch.Tensor


def row_keys(trees: list[tuple[int, list[int]] | None], q: int) -> RowKeys:
    """The keys of every node of ``trees`` (per batch entry: (cache length, tree parents) or None for padding) in a
    pass of ``q`` rows per entry; padding rows are left out."""
    index, entry, prefix, extras = [], [], [], []
    for e, tree in enumerate(trees):
        if tree is None:
            continue
        cache_len, parents = tree
        paths: list[list[int]] = []
        for node, parent in enumerate(parents):
            paths.append([*(paths[parent] if parent >= 0 else []), cache_len + node])
            index.append(e * q + node)
            entry.append(e)
            prefix.append(cache_len)
        extras += paths
    width = max(len(p) for p in extras)
    extra = torch.tensor([p + [0] * (width - len(p)) for p in extras], dtype=torch.long)
    full = index == list(range(len(trees) * q))
    return RowKeys(None if full else torch.tensor(index), torch.tensor(entry), torch.tensor(prefix), extra,
                   torch.tensor([len(p) for p in extras]))


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rows: RowKeys, scale: float | None
           ) -> torch.Tensor:
    """Attention of ``query`` (B, heads, q, d) over the cache ``key``/``value`` (B, kv_heads, slots, d) by ``rows``:
    (B, q, heads, d), zeros in the rows left out."""
    b, heads, q, d = query.shape
    flat = query.transpose(1, 2).reshape(b * q, heads, d)
    if rows.index is not None:
        flat = flat.index_select(0, rows.index)
    out = kernel().row_attention(flat, key, value, rows.entry, rows.prefix, rows.extra, rows.count,
                                 d ** -0.5 if scale is None else scale)
    if rows.index is None:
        return out.view(b, q, heads, d)
    full = out.new_zeros(b * q, heads, d)
    full.index_copy_(0, rows.index, out)
    return full.view(b, q, heads, d)
