"""Where a server's memory goes, by part, for ``/metrics`` (``selfspec_memory_bytes``) and a long soak.

    parts(engine)      # {"kv_cache": ..., "prefix_cache": ..., "prefix_cache_held": ..., "malloc_free": ...}
    resident_bytes()   # the process's resident memory (``process_resident_memory_bytes``)
    trim()             # give the C allocator's free memory back to the system (glibc ``malloc_trim``)

Each bounded cache is counted twice where it can drift: as it accounts itself (``prefix_cache``) and as its tensors'
storages hold it (``prefix_cache_held``: a view into a larger tensor would keep the whole storage alive unseen).
``malloc_in_use`` / ``malloc_free`` (glibc's ``mallinfo2``) tell a leak (memory in use grows) from fragmentation
(free memory the allocator keeps grows).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from collections.abc import Iterable

import torch

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):  # not glibc (musl, macOS) or a glibc before 2.33
        return None


_LIBC = _libc()


def resident_bytes() -> int | None:
    """The process's resident memory (None where ``/proc`` is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        return None


def malloc_bytes() -> dict[str, int]:
    """glibc's heap: bytes handed out (``in_use``), free but kept (``free``), in chunks mapped on their own
    (``mmapped``); empty where the allocator is not glibc's."""
    if _LIBC is None:
        return {}
    info = _LIBC.mallinfo2()
    return {"malloc_in_use": info.uordblks, "malloc_free": info.fordblks, "malloc_mmapped": info.hblkhd}


def trim() -> bool:
    """Return the allocator's free pages to the system (a no-op where the allocator is not glibc's)."""
    return bool(_LIBC.malloc_trim(0)) if _LIBC is not None else False


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (what keeping them keeps alive)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None:
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _prefix_tensors(prefix) -> list[torch.Tensor]:
    return [t for e in list(prefix.entries.values()) for t in (e.tokens, e.keys, e.values, *e.hidden.values())]


def parts(engine) -> dict[str, int]:
    """The engine's memory by part (bytes; counts end in ``_entries``): the target's KV rows, the prefix cache as
    accounted, held and bounded, the drafter's caches, the C heap. Read from another thread between steps' edits:
    a structure that changes while it is read is read again."""
    for _ in range(3):
        try:
            return _parts(engine)
        except RuntimeError:  # a dict changed size while read: the engine thread edited it
            continue
    return {}


def _parts(engine) -> dict[str, int]:
    out: dict[str, int] = {}
    cache = getattr(engine.target, "cache", None)
    if cache is not None:
        out["kv_cache"] = storage_bytes(t for layer in cache.layers for t in (layer.keys, layer.values))
    prefix = getattr(engine, "prefix", None)
    if prefix is not None:
        out |= {"prefix_cache": prefix.nbytes, "prefix_cache_max": prefix.max_bytes,
                "prefix_cache_held": storage_bytes(_prefix_tensors(prefix)), "prefix_cache_entries": len(prefix)}
    drafter = engine.drafter
    for d in (drafter, getattr(drafter, "inner", None)):  # heads alone, or behind lookup/suffix
        rows = getattr(d, "row_cache", None)
        if rows is not None:
            out["lm_rows_cache"] = storage_bytes(t for pair in list(rows.values()) for t in pair)
            out["lm_rows_cache_entries"] = len(rows)
        head_rows = getattr(d, "head_rows", None)
        if head_rows is not None and head_rows.cache is not None:
            out["head_rows"] = storage_bytes(t for layer in head_rows.cache.layers for t in (layer.keys, layer.values))
    # Python's own allocations (a leak of Python objects); not gc.get_objects(), which from another thread can hold
    # a tuple the engine thread is still filling and make its resize fail (SystemError in tuple(generator))
    out["python_blocks_entries"] = sys.getallocatedblocks()
    return out | malloc_bytes()
