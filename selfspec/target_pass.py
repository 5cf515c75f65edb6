"""How the engine runs the target: prefill, one pass over root + draft tree, and keeping the accepted path.

``TargetPass`` declares the interface; the implementations:

    EagerPass    the model's own modules over a growing ``DynamicCache`` (any model, any shape: the reference)
    StaticPass   a preallocated KV cache, tree nodes written into their slots, tree sizes padded to a few
                 buckets, optionally compiled (``selfspec/static_pass.py``): the fast path

A pass object is made once per engine and reused by every request; the cache it hands out per request
is opaque to the engine, which only passes it back.
"""

from __future__ import annotations

from typing import Protocol

import torch

from .kv_cache import cache_length, keep_entries, new_cache
from .tree import DraftTree
from .verify import Verification, forward_with_cache, verify_tree

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

    def new_cache(self, max_len: int): ...

    def release(self, handle) -> None: ...

    def prefill(self, handle, ids: torch.Tensor, layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, ...] | None: ...

    def verify(self, handle, tree: DraftTree, cache_len: int, layers: tuple[int, ...] = ()) -> Verification: ...

    def keep(self, handle, start: int, keep: list[int]) -> None: ...

    def length(self, handle) -> int: ...

    def draft_view(self, handle): ...


class EagerPass:
    """The target's forward through public ``transformers`` arguments over a ``DynamicCache``."""

    name = "eager"
    exact = False  # a k-token pass may round a row differently from a one-token step (the reference, not exact)
    buckets = None  # any tree size, unpadded

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.device = next(model.parameters()).device

    def new_cache(self, max_len: int):
        """An empty cache for a request of at most ``max_len`` positions (grows as needed here)."""
        return new_cache(self.model)

    @torch.no_grad()
    def prefill(self, cache, ids: torch.Tensor, layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, ...] | None:
        """Cache ``ids`` (1-D, CPU) from position 0; the states of ``layers``, (n, H) each."""
        x = ids.to(self.device)[None]
        out = forward_with_cache(self.model, x, cache, position_ids=torch.arange(x.shape[1], device=self.device)[None],
                                 hidden_states=bool(layers), logits_to_keep=1)
        return tuple(out.hidden_states[i][0] for i in layers) if layers else None

    def verify(self, cache, tree: DraftTree, cache_len: int, layers: tuple[int, ...] = ()) -> Verification:
        """One pass over root + tree, appending every node to ``cache``."""
        return verify_tree(self.model, cache, tree, cache_len, layers)

    def release(self, cache) -> None:
        """The request is done with ``cache`` (a dynamic cache is simply dropped)."""

    def keep(self, cache, start: int, keep: list[int]) -> None:
        """Keep the pass's entries ``keep`` (tree indices, ascending) at ``start..`` and drop the rest."""
        keep_entries(cache, start, keep)

    def length(self, cache) -> int:
        """Positions the cache holds."""
        return int(cache_length(cache))

    def draft_view(self, cache):
        """What drafters that draft inside the target's cache (early exit) may use: this one is a DynamicCache."""
        return cache


def make_target_pass(model: torch.nn.Module, backend: str = "eager", exact: bool = True, **options) -> TargetPass:
    """The target pass named ``backend`` (one of ``BACKENDS``) for ``model``; ``exact``: the static pass computes
    every row as a plain step does where this device allows (``selfspec/exact.py``; the eager pass never does)."""
    from .errors import SelfspecError

    backend = resolve_backend(backend, model)
    if backend == "eager":
        return EagerPass(model)
    if backend in ("static", "compiled"):
        from .static_pass import StaticPass

        return StaticPass(model, compile=backend == "compiled", exact=exact, **options)
    raise SelfspecError(f"unknown target pass '{backend}'; choose one of {', '.join(BACKENDS)}")
