"""The compiled target pass: one request over transformers' ``StaticCache``, each tree-size bucket a compiled graph.

Every tensor the pass touches has one of a few fixed shapes, so ``torch.compile`` builds a handful of graphs (one
per bucket and cache size) that serve every step, and on CUDA they are recorded as CUDA graphs ("reduce-overhead"):

    cache     (1, kv_heads, max_len, head_dim) per layer, allocated once per engine and reused by every request
              (grown, in steps of ``CACHE_STEP``, when one needs more; each size is another set of graphs)
    a pass    root + tree (n nodes) padded to the bucket b >= n: node i is written into slot cache_len + i; the mask
              (1, 1, b, max_len) lets node i see slots < cache_len, itself and its ancestors; a padding node sees
              only its own slot and its logits are dropped
    keep      the accepted path is copied into the slots after the root and the cache is cropped back
    weights   on a CPU the packed linears are called as opaque operators; inductor fuses what lies between them

It is never exact (a compiled graph fuses rows' arithmetic as it likes): the exact pass, for one request or many, is
``selfspec/target/rows.py``. Inductor keeps what it compiled on disk (``$SELFSPEC_HOME/inductor`` unless
``TORCHINDUCTOR_CACHE_DIR`` is set) for a second process.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
from transformers import StaticCache

from ..context import context_length
from ..errors import SelfspecError
from ..paths import selfspec_home
from ..tree import DraftTree, chain
from ..verify import Verification
from .attention import static_attention
from .common import BUCKETS, PREFILL_CHUNK, Target, ancestor_block, bucket_for, grown, static_mask
from .exact import ExactSupport


@dataclass
class StaticHandle:
    """A request's claim on the shared static cache: a newer request invalidates older handles."""

    cache: StaticCache
    epoch: int


def _inductor_cache_dir() -> None:
    """Keep compiled kernels and graphs across processes under ``$SELFSPEC_HOME`` (unless the user chose)."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(selfspec_home() / "inductor"))


class CompiledPass:
    """The target over a static cache, each tree-size bucket run as a compiled graph (one request at a time)."""

    name = "compiled"
    exact = False
    exact_prefill = False
    support = ExactSupport(False, reason="the compiled pass is not exact")

    def __init__(self, model: torch.nn.Module, buckets: tuple[int, ...] = BUCKETS, pack: bool = True) -> None:
        self.target = Target(model, pack)
        self.model, self.device, self.dtype, self.packed = self.target.parts()
        self.buckets = tuple(sorted(buckets))
        self.cache: StaticCache | None = None
        self.max_len = 0
        self.epoch = 0
        self.last_shape = (0, 0)
        self.compiled_shapes: set[tuple[int, int]] = set()  # (bucket, max_len) graphs built so far
        _inductor_cache_dir()
        dynamo = torch._dynamo.config
        dynamo.recompile_limit = max(dynamo.recompile_limit, 4 * len(self.buckets))  # one graph per bucket x size
        mode = "reduce-overhead" if self.device.type == "cuda" else None
        self.step = torch.compile(self._step, mode=mode, dynamic=False)

    def _step(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, layers: tuple[int, ...] = ()
              ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        return self.target.forward(self.cache, ids, positions, mask, layers)

    def pass_shape(self, rows: int, nodes: int) -> tuple[int, int]:
        """(rows, nodes) a pass of trees of ``nodes`` nodes runs: one row, the bucket holding them."""
        return rows, bucket_for(nodes, self.buckets)

    def new_cache(self, max_len: int) -> StaticHandle:
        """Claim the shared cache for a request of at most ``max_len`` positions (grown if too small)."""
        need = max_len + self.buckets[-1]  # a pass may pad past the request's last position
        if self.cache is None or need > self.max_len:
            self.max_len = grown(need, context_length(self.model.config), self.buckets[-1])
            self.cache = StaticCache(config=self.model.config, max_cache_len=self.max_len)
        else:
            self._truncate(0)
        self.epoch += 1
        return StaticHandle(self.cache, self.epoch)

    def release(self, handle: StaticHandle) -> None:
        """The request is done with the cache (the next request claims it anyway)."""

    def _own(self, handle: StaticHandle) -> StaticCache:
        if handle.epoch != self.epoch or handle.cache is not self.cache:
            raise SelfspecError("this request's KV cache was taken by a newer request on the same engine: "
                                "a static-cache engine decodes one request at a time")
        return handle.cache

    def _truncate(self, length: int) -> None:
        extra = int(self.cache.get_seq_length()) - length
        if extra > 0:
            self.cache.crop(-extra)

    @torch.no_grad()
    def prefill(self, handle: StaticHandle, ids: torch.Tensor, layers: tuple[int, ...] = ()
                ) -> tuple[torch.Tensor, ...] | None:
        """Cache ``ids`` (1-D) from slot 0, eagerly (prompt lengths vary), in chunks of ``PREFILL_CHUNK`` tokens
        under a causal mask; the asked layers' states, (n, H) each."""
        self._own(handle)
        n = ids.numel()
        if n + self.buckets[-1] > self.max_len:
            raise SelfspecError(f"the prompt ({n} tokens) does not fit the static cache ({self.max_len})")
        parts = []
        for start in range(0, n, PREFILL_CHUNK):
            part = ids[start:start + PREFILL_CHUNK]
            c = part.numel()
            positions = torch.arange(start, start + c, device=self.device)[None]
            with static_attention(self.model) as cut:  # eager: attend over the slots written so far
                mask = static_mask(torch.ones(c, c, dtype=torch.bool).tril(), start,
                                   start + c if cut else self.max_len, self.dtype, self.device)
                _, states = self.target.forward(self.cache, part.to(self.device)[None], positions, mask, layers,
                                                logits=False)
            parts.append(tuple(h[0] for h in states))
            self._truncate(start + c)
        return tuple(torch.cat(states) for states in zip(*parts)) if layers else None

    @torch.no_grad()
    def verify(self, handle: StaticHandle, tree: DraftTree, cache_len: int, layers: tuple[int, ...] = ()
               ) -> Verification:
        """One pass over root + tree padded to its bucket; nodes land in slots cache_len .. cache_len + n - 1."""
        self._own(handle)
        n = tree.size
        _, b = self.pass_shape(1, n)
        if cache_len + b > self.max_len:
            raise SelfspecError(f"the static cache ({self.max_len} positions) is full at {cache_len}")
        ids = torch.zeros(1, b, dtype=torch.long)
        ids[0, :n] = tree.tokens
        positions = torch.full((1, b), cache_len, dtype=torch.long)
        positions[0, :n] += torch.tensor(tree.depth)
        self.compiled_shapes.add((b, self.max_len))
        with static_attention(self.model):  # compiled graphs have fixed shapes: every slot
            mask = static_mask(ancestor_block(tree.parents, b), cache_len, self.max_len, self.dtype, self.device)
            logits, states = self.step(ids.to(self.device), positions.to(self.device), mask, layers)
        self.last_shape = (1, b)
        # clone: a CUDA-graph replay reuses its output buffers at the next call
        return Verification(logits[0, :n].clone(), tuple(h[0, :n].clone() for h in states) if layers else None)

    def precompile(self, max_len: int, max_nodes: int, layers: tuple[int, ...] = ()) -> float:
        """Build, up front, the graphs a request of at most ``max_len`` positions drafting trees of at most
        ``max_nodes`` nodes will use (every bucket up to the one holding ``max_nodes``, asking for the states
        ``layers``), so that no compiling lands inside a timed request. Seconds spent."""
        start = time.perf_counter()
        handle = self.new_cache(max_len)
        self.prefill(handle, torch.zeros(1, dtype=torch.long))
        for b in self.buckets[:self.buckets.index(bucket_for(max_nodes, self.buckets)) + 1]:
            self.verify(handle, chain(0, [0] * (b - 1)), 1, layers)
            self.keep(handle, 1, [])
        return time.perf_counter() - start

    def keep(self, handle: StaticHandle, start: int, keep: list[int]) -> None:
        """Copy the pass's entries ``keep`` (ascending) into slots ``start..`` and crop to the committed length."""
        cache = self._own(handle)
        n = len(keep)
        if keep != list(range(n)):
            idx = torch.tensor(keep, device=self.device) + start
            for layer in cache.layers:  # (1, kv_heads, max_len, head_dim): gather first, then write in place
                layer.keys[:, :, start:start + n] = layer.keys.index_select(2, idx)
                layer.values[:, :, start:start + n] = layer.values.index_select(2, idx)
        self._truncate(start + n)

    def length(self, handle: StaticHandle) -> int:
        """Positions the request's cache holds."""
        return int(self._own(handle).get_seq_length())

    def draft_view(self, handle: StaticHandle):
        """None: drafters that would draft inside the target's cache (early exit) keep their own instead."""
        return None
