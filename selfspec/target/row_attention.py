"""Row attention: each query row of a pass attends over exactly its own keys, in one call for the whole pass.

The exact pass needs every row's attention computed as a one-token plain step computes it. Through torch's
attention kernel that takes one call per key width, a copy of the keys for every tree path but the first, and
query blocks padded for the kernel's thread buffers (``selfspec/target/exact.py``). This kernel
(``selfspec/target/csrc/row_attention.cpp``) is written so that no row's arithmetic depends on the call: a row's keys are
a prefix of its cache row (the cache) then a list of slots (its ancestors and itself), every score (16 keys at a
time, a key's lane its index mod 16), weight and sum runs in key order with the same vector code, and the work is
split by rows, never within one. A plain step
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

import torch

from . import extension
from ..disk_cache import cached, machine

log = logging.getLogger(__name__)

NAME = "selfspec_row_attention"
MAX_HEAD_DIM = 256  # the kernel keeps a key's head_dim in 16 vector registers
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def build_name() -> str:
    """The extension's name, carrying this CPU's model and flags (``selfspec/target/extension.py``)."""
    return extension.build_name(NAME)


@functools.cache
def kernel():
    """The built extension, or None where it is off or cannot be built here (said once)."""
    if os.environ.get("SELFSPEC_ROW_ATTENTION", "1") == "0":
        return None
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        return None
    module = extension.load_kernel(NAME, "row_attention.cpp", "row attention kernel",
                                   "the exact pass uses torch's attention kernel", openmp=True)
    return module if module is not None and module.row_attention_available() else None


def used(device: torch.device, dtype: torch.dtype, shape: tuple[int, int, int] | None = None) -> bool:
    """Whether an exact pass on ``device`` in ``dtype`` attends through the kernel; given ``shape`` (heads, K/V
    heads, head_dim), only where the start-up self-test finds every row's bits independent of the call."""
    if torch.device(device).type != "cpu" or dtype not in DTYPES or kernel() is None:
        return False
    return shape is None or (shape[2] <= MAX_HEAD_DIM and keeps_rows(*shape, dtype))


@functools.cache
def keeps_rows(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
    """The start-up self-test (per shape and dtype, kept on disk per build: ``selfspec/disk_cache.py``): a 10-node
    tree on a 300-token cache beside another request's rows, in one call, each row alone, and each row as a plain
    step (its keys copied in order to contiguous slots), must give every row the same bits. The kernel is written so
    that they do; this checks the build (compiler, CPU) rather than assuming it. Where it fails, the exact pass uses
    torch's kernel (said once)."""
    key = {"test": "row_kernel_keeps_rows", "build": build_name(), **machine(), "threads": torch.get_num_threads(),
           "shape": [heads, kv_heads, head_dim], "dtype": str(dtype)}
    return bool(cached("selftest", key, lambda: (_keeps_rows(heads, kv_heads, head_dim, dtype), {}))[0])


def _keeps_rows(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
    """``keeps_rows``, measured."""
    gen = torch.Generator().manual_seed(0)
    k, v = ((torch.randn(2, kv_heads, 512, head_dim, generator=gen) * 2).to(dtype) for _ in range(2))
    parents = [-1, 0, 1, 2, 0, 4, 1, 6, 6, 3]
    rows = row_keys([(300, parents), (137, [-1, 0, 1])], q=len(parents))
    q = (torch.randn(rows.entry.numel(), heads, head_dim, generator=gen) * 2).to(dtype)
    run, scale = kernel().row_attention, head_dim ** -0.5
    together = run(q, k, v, rows.entry, rows.prefix, rows.extra, rows.count, scale)
    ok = True
    for r in range(len(parents)):
        one = slice(r, r + 1)
        alone = run(q[one], k, v, rows.entry[one], rows.prefix[one], rows.extra[one], rows.count[one], scale)
        slots = list(range(300)) + rows.extra[r, :int(rows.count[r])].tolist()
        n = len(slots)
        plain_k, plain_v = torch.zeros_like(k[:1]), torch.zeros_like(v[:1])
        plain_k[0, :, :n], plain_v[0, :, :n] = k[0][:, slots], v[0][:, slots]
        step = run(q[one], plain_k, plain_v, torch.tensor([0]), torch.tensor([n - 1]), torch.tensor([[n - 1]]),
                   torch.tensor([1]), scale)
        ok &= torch.equal(alone, together[one]) and torch.equal(step, together[one])
    if not ok:
        log.warning("the row attention kernel gave a row other bits beside other rows on this CPU (%d heads, %d K/V "
                    "heads, head_dim %d, %s); the exact pass uses torch's attention kernel", heads, kv_heads,
                    head_dim, dtype)
    return ok


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
