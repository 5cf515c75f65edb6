"""How the engines run the target: prefill, one pass over root + draft tree (one request's or many), and keeping
the accepted path. The target's passes, their kernels and caches live in this package.

``TargetPass`` declares the interface; the implementations:

    RowPass       a preallocated KV cache with a row per request, tree nodes written into their slots, trees padded
                  to a few buckets, exact where the self-test allows (``rows.py``): the fast path, for one request
                  ("static": one row that grows as requests need) and for a batch (``BatchEngine``)
    CompiledPass  one request over a static cache, each bucket a compiled graph, CUDA graphs on a GPU
                  (``compiled.py``; never exact)
    EagerPass     the model's own modules over a growing ``DynamicCache`` (any model, any shape: the reference)

    exact.py, row_attention.py (+ csrc/)   what makes a pass compute every row as a plain step does
    attention.py, packed_linear.py         the attention over the slots a pass sees; the linears in oneDNN's layout
    decoder.py, row_ops.py (+ csrc/)       the exact pass's layers as one loop, its small operations in C++
    extension.py                           building the C++ kernels for this CPU
    kv_cache.py, common.py                 the caches; buckets, masks and the decoder call every pass shares

A pass object is made once per engine and reused by every request; the cache it hands out per request
is opaque to the engine, which only passes it back.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..errors import SelfspecError
from ..tree import DraftTree
from ..verify import Verification
from .compiled import CompiledPass
from .eager import EagerPass
from .exact import log as exact_log
from .rows import RowPass, Slot

BACKENDS = ("eager", "static", "compiled")  # what ``--target-pass`` / ``SpeculativeEngine(backend=...)`` accept
AUTO_BACKEND_HELP = "compiled on CUDA (CUDA graphs), static on a CPU (compiled: 5-10%% faster passes after compiling)"


def resolve_backend(name: str, model: torch.nn.Module) -> str:
    """The backend ``name`` means for ``model``: ``"auto"`` is the compiled static pass on CUDA and the static
    pass uncompiled on a CPU, where compiling costs ~25-45 s per tree-size bucket for 5-10% faster passes
    (Qwen2.5-Coder-1.5B, bf16, 2 cores): worth it for a server or a benchmark, who ask for "compiled"."""
    if name != "auto":
        return name
    return "compiled" if next(model.parameters()).device.type == "cuda" else "static"


class TargetPass(Protocol):
    """What the engines ask of a target pass. A request's cache (``handle``) is opaque: it is made by ``new_cache``
    and passed back. ``layers`` name the hidden states a drafter reads, as indices into ``transformers``'
    ``hidden_states`` (-1: the final, normed layer; () none)."""

    name: str  # eager, static, compiled or batched: what the stats report
    exact: bool  # every row of a pass computed as a plain step computes it (output bit-identical to plain decoding)
    buckets: tuple[int, ...] | None  # tree sizes a pass is padded to (None: any size, unpadded)
    last_shape: tuple[int, int]  # (rows, nodes per row) the last pass ran, padding included: what it cost is of that

    def pass_shape(self, rows: int, nodes: int) -> tuple[int, int]: ...

    def new_cache(self, max_len: int): ...

    def release(self, handle) -> None: ...

    def prefill(self, handle, ids: torch.Tensor, layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, ...] | None: ...

    def verify(self, handle, tree: DraftTree, cache_len: int, layers: tuple[int, ...] = ()) -> Verification: ...

    def keep(self, handle, start: int, keep: list[int]) -> None: ...

    def length(self, handle) -> int: ...

    def draft_view(self, handle): ...


def make_target_pass(model: torch.nn.Module, backend: str = "eager", exact: bool = True, **options) -> TargetPass:
    """The target pass named ``backend`` (one of ``BACKENDS``) for ``model``; ``exact``: the static pass computes
    every row as a plain step does where this device allows (``exact.py``; the eager and compiled passes never do)."""
    backend = resolve_backend(backend, model)
    if backend == "eager":
        return EagerPass(model)
    if backend == "static":
        return RowPass(model, exact=exact, **options)
    if backend == "compiled":
        if exact:
            exact_log.warning("exact target pass unavailable: the compiled pass is not exact; speculative output may "
                              "differ from plain decoding by rounding (each difference is diagnosed)")
        return CompiledPass(model, **options)
    raise SelfspecError(f"unknown target pass '{backend}'; choose one of {', '.join(BACKENDS)}")
