"""The target pass over a preallocated KV cache, tree sizes bucketed, optionally compiled.

Every tensor the pass touches has one of a few fixed shapes, so ``torch.compile`` builds a handful of
graphs (one per tree-size bucket) that serve every step, and CUDA graphs can replay them:

    cache     transformers' ``StaticCache``: (1, kv_heads, max_len, head_dim) per layer, allocated once
              per engine and reused by every request (grown, in steps of ``CACHE_STEP``, when one needs more)
    a pass    root + tree (n nodes) padded to the bucket b >= n: node i is written into slot cache_len + i;
              the mask (1, 1, b, max_len) lets node i see slots < cache_len, itself and its ancestors;
              a padding node sees only its own slot and its logits are dropped
    weights   on a CPU: every linear packed into oneDNN's blocked layout (``selfspec/packed_linear.py``;
              memory-neutral, 1.3-1.6x faster passes on this project's CPU); compiled graphs call the packed
              matmuls as opaque operators and fuse what lies between them
    attention grouped-query attention without copying K/V, over the slots a pass can see
              (``selfspec/attention.py``); uncompiled, the mask (and so the K/V read) is cut to cache_len + b
    keep      the accepted path is copied into the slots after the root and the cache is cropped back
              (``crop``), so stale slots past the committed length are never seen: the mask hides them
              until the next pass overwrites them

exact     (uncompiled, the default where the start-up self-test passes) every row attends as a one-token plain
              step does, over the same keys in the same order and width, and every pass runs on at least as many
              rows as keep each row's bits in the linears (``selfspec/exact.py``): speculative output is then
              bit-identical to plain decoding, bf16 included

On CUDA the compiled graphs are recorded as CUDA graphs ("reduce-overhead"). Inductor keeps what it compiled
on disk (``$SELFSPEC_HOME/inductor`` unless ``TORCHINDUCTOR_CACHE_DIR`` is set) for a second process.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from functools import cached_property

import torch
from transformers import StaticCache

from .attention import static_attention
from .errors import SelfspecError
from . import row_attention
from .exact import ExactPlan, ExactSupport, check_exact, log as exact_log, plan_pass, prefill_parts, prefill_rows
from .memory import attention_layout
from .packed_linear import is_packed, pack_linears
from .paths import selfspec_home
from .tree import DraftTree, chain
from .verify import Verification, cache_kwarg

BUCKETS = (1, 4, 8, 16, 32, 64)  # tree sizes (root included) a pass is padded to; one compiled graph each
CACHE_STEP = 512  # the static cache grows in multiples of this (each size is another set of graphs)
PREFILL_CHUNK = 256  # prompts are cached this many tokens per forward (a batch's other rows wait one chunk at most)


def bucket_for(n: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket holding ``n`` nodes."""
    for b in buckets:
        if b >= n:
            return b
    raise SelfspecError(f"a draft tree of {n} nodes exceeds the largest static bucket ({buckets[-1]}); "
                        "lower --max-nodes or pass larger buckets")


def ancestor_block(parents: list[int], bucket: int) -> torch.Tensor:
    """(bucket, bucket) bool: node i may see node j (j is i or an ancestor of i); padding rows see themselves."""
    own = torch.eye(bucket, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            own[i] |= own[p]  # parents come first, so own[p] already holds p's ancestors
    return own


def static_mask(block: torch.Tensor, cache_len: int, width: int, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
    """Additive mask (1, 1, b, width): every row sees slots < cache_len and, at cache_len.., its ``block`` row;
    slots from ``width`` on are not attended at all (``selfspec/attention.py`` cuts K/V to the mask)."""
    b = block.shape[0]
    mask = torch.full((b, width), torch.finfo(dtype).min, dtype=dtype, device=device)
    mask[:, :cache_len] = 0
    mask[:, cache_len:cache_len + b].masked_fill_(block.to(device), 0)
    return mask[None, None]


@dataclass
class StaticHandle:
    """A request's claim on the shared static cache: a newer request invalidates older handles."""

    cache: StaticCache
    epoch: int


def _inductor_cache_dir() -> None:
    """Keep compiled kernels and graphs across processes under ``$SELFSPEC_HOME`` (unless the user chose)."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(selfspec_home() / "inductor"))


class StaticPass:
    """The target over a static cache; ``compile=True`` runs each tree-size bucket as a compiled graph; ``exact``
    (uncompiled only) computes every row as a plain step does, if this device's self-test allows (``self.exact``
    says whether it does, ``self.support.reason`` why not)."""

    def __init__(self, model: torch.nn.Module, compile: bool = False, buckets: tuple[int, ...] = BUCKETS,
                 pack: bool = True, exact: bool = True) -> None:
        self.model = model
        if pack:  # on a CPU: the linears' weights in oneDNN's layout, shared by the eager and compiled paths
            pack_linears(model)
        self.packed = is_packed(model)
        self.compiled = compile
        self.name = "compiled" if compile else "static"
        self.buckets = tuple(sorted(buckets))
        self.device = next(model.parameters()).device
        self.dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
        self.decoder = model.get_decoder()
        self.head = model.get_output_embeddings()
        self.kwarg = cache_kwarg(type(self.decoder))
        self.cache: StaticCache | None = None
        self.max_len = 0
        self.epoch = 0
        self.compiled_shapes: set[tuple[int, int]] = set()  # (bucket, max_len) graphs built so far
        self.step = self._compile() if compile else self._forward
        self.support = ExactSupport(False, reason="off (--no-exact)")
        if exact and compile:
            self.support = ExactSupport(False, reason="the compiled pass is not exact")
        elif exact:
            self.support = check_exact(model)
            self.support.bound(model)  # the linears' row bounds, set once
            self.head = model.get_output_embeddings()  # a bounded dense LM head is another module
        if exact and not self.support.exact:
            exact_log.warning("exact target pass unavailable: %s; speculative output may differ from plain "
                              "decoding by rounding (each difference is diagnosed)", self.support.reason)
        self.exact = self.support.exact
        self.exact_requested = exact and not compile
        if self.exact:  # a plain step too runs on the rows that give a row the bits it gets in every larger pass
            self.buckets = tuple(sorted({max(b, self.support.least) for b in self.buckets}))

    def _compile(self):
        _inductor_cache_dir()
        dynamo = torch._dynamo.config
        dynamo.recompile_limit = max(dynamo.recompile_limit, 4 * len(self.buckets))  # one graph per bucket x size
        if self.device.type == "cuda":
            return torch.compile(self._forward, mode="reduce-overhead", dynamic=False)
        return torch.compile(self._forward, dynamic=False)

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, layers: tuple[int, ...] = (),
                 plan: ExactPlan | None = None) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """(1, b) tokens at (1, b) positions under a (1, 1, b, max_len) mask -> logits (1, b, V) and the states
        (1, b, H) of ``layers`` (indices into ``hidden_states``; only the final one needs no extra outputs).
        ``plan``: every row attends as the exact pass's plan says (``selfspec/exact.py``)."""
        extra = {} if plan is None else {"selfspec_exact": plan}
        out = self.decoder(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=True,
                           output_hidden_states=any(i != -1 for i in layers), **{self.kwarg: self.cache}, **extra)
        h = out.last_hidden_state
        return self.head(h), tuple(h if i == -1 else out.hidden_states[i] for i in layers)

    def new_cache(self, max_len: int) -> StaticHandle:
        """Claim the shared cache for a request of at most ``max_len`` positions (grown if too small)."""
        need = max_len + self.buckets[-1]  # a pass may pad past the request's last position
        limit = getattr(self.model.config, "max_position_embeddings", None)
        if self.cache is None or need > self.max_len:
            self.max_len = -(-need // CACHE_STEP) * CACHE_STEP
            if limit:
                self.max_len = max(min(self.max_len, limit + self.buckets[-1]), need)
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
        """Cache ``ids`` (1-D) from slot 0, eagerly (prompt lengths vary), in chunks of ``PREFILL_CHUNK`` tokens;
        the asked layers' states, (n, H) each."""
        self._own(handle)
        n = ids.numel()
        if n + self.buckets[-1] > self.max_len:
            raise SelfspecError(f"the prompt ({n} tokens) does not fit the static cache ({self.max_len})")
        parts = [self.prefill_chunk(handle, ids[start:start + PREFILL_CHUNK], start, layers)
                 for start in range(0, n, PREFILL_CHUNK)]
        return tuple(torch.cat(states) for states in zip(*parts)) if layers else None

    def prefill_chunk(self, handle: StaticHandle, ids: torch.Tensor, start: int, layers: tuple[int, ...]
                      ) -> tuple[torch.Tensor, ...]:
        """Cache ``ids`` (1-D) at slots ``start..`` behind the ``start`` already cached; the ``layers``' states.
        Where the exact pass attends through the row kernel (``exact_prefill``), every token is computed as its plain
        step would compute it, in forwards of row counts the self-test checked: a prompt's cache then has the same
        bits however it is chunked, and a cached prefix can be reused exactly (``selfspec/prefix_cache.py``)."""
        exact, n = self.exact_prefill, ids.numel()
        parts = prefill_parts(n, self.prefill_rows[1], self.prefill_rows[0]) if exact else [(n, n)]
        states, done = [], 0
        for c, rows in parts:
            part = torch.zeros(rows, dtype=torch.long)
            part[:c] = ids[done:done + c]
            plan = plan_pass(list(range(-1, c - 1)), list(range(c)), start + done, self.max_len, self.dtype,
                             self.device) if exact else None
            states.append(self._prompt_forward(handle, part, start + done, c, layers, plan))
            done += c
        self._prefilled(handle, start + done)
        return tuple(torch.cat(pieces) for pieces in zip(*states)) if layers else ()

    @cached_property
    def exact_prefill(self) -> bool:
        """Whether every prompt token is cached with bits that depend on the tokens before it alone (exact asked for,
        the row attention kernel used, the decoder's linears self-tested for the prompt forwards' row counts): then
        as a plain step computes it where the pass is exact, and a cached prefix is reusable exactly in any case
        (an inexact LM head does not matter: prompts need no logits)."""
        return bool(self.exact_requested and getattr(self.model.config, "_attn_implementation", None) == "sdpa"
                    and row_attention.used(self.device, self.dtype, attention_layout(self.model.config)[1:])
                    and self.prefill_rows[1])

    @cached_property
    def prefill_rows(self) -> tuple[int, int]:
        """(least, most) rows of a prompt's forward (``exact.prefill_rows``), self-tested at first use."""
        return prefill_rows(self.model)

    def _prompt_forward(self, handle, ids: torch.Tensor, start: int, real: int, layers: tuple[int, ...],
                      plan: ExactPlan | None) -> tuple[torch.Tensor, ...]:
        """One forward caching ``ids`` at slots ``start..`` (the first ``real`` of them tokens, the rest padding);
        under ``plan`` as the exact pass attends, else under a causal mask."""
        c = ids.numel()
        self._place(handle, start, c)
        positions = torch.arange(start, start + c, device=self.device)[None]
        extra = {} if plan is None else {"selfspec_exact": plan}
        with static_attention(self.model) as cut:  # eager: attend over the slots written so far
            if plan is not None:
                mask = torch.zeros(1, 1, c, 1, dtype=self.dtype, device=self.device)  # the plan says who sees what
            else:
                mask = static_mask(torch.ones(c, c, dtype=torch.bool).tril(), start,
                                   start + c if cut else self.max_len, self.dtype, self.device)
            out = self.decoder(input_ids=ids.to(self.device)[None], position_ids=positions, attention_mask=mask,
                               use_cache=True, output_hidden_states=any(i != -1 for i in layers),
                               **{self.kwarg: self.cache}, **extra)
        return tuple((out.last_hidden_state if i == -1 else out.hidden_states[i])[0, :real] for i in layers)

    def _place(self, handle, start: int, n: int) -> None:
        """Before a prefill forward of ``n`` rows at slots ``start..``: the static cache writes behind what it
        holds (``start``)."""

    def _prefilled(self, handle, length: int) -> None:
        """After a prompt chunk: the cache holds ``length`` positions (padding rows cropped)."""
        self._truncate(length)

    @torch.no_grad()
    def verify(self, handle: StaticHandle, tree: DraftTree, cache_len: int, layers: tuple[int, ...] = ()
               ) -> Verification:
        """One pass over root + tree padded to its bucket; nodes land in slots cache_len .. cache_len + n - 1."""
        self._own(handle)
        n = tree.size
        b = bucket_for(n, self.buckets)
        if cache_len + b > self.max_len:
            raise SelfspecError(f"the static cache ({self.max_len} positions) is full at {cache_len}")
        ids = torch.zeros(1, b, dtype=torch.long)
        ids[0, :n] = tree.tokens
        positions = torch.full((1, b), cache_len, dtype=torch.long)
        positions[0, :n] += torch.tensor(tree.depth)
        self.compiled_shapes.add((b, self.max_len))
        with static_attention(self.model) as cut:
            # compiled graphs have fixed shapes (every slot); uncompiled, the pass reads only the slots it can see
            width = cache_len + b if cut and not self.compiled else self.max_len
            mask = static_mask(ancestor_block(tree.parents, b), cache_len, width, self.dtype, self.device)
            if self.exact:
                plan = plan_pass(tree.parents, tree.depth, cache_len, self.max_len, self.dtype, self.device,
                                 self.support.batched)
                logits, states = self._forward(ids.to(self.device), positions.to(self.device), mask, layers, plan)
            else:
                logits, states = self.step(ids.to(self.device), positions.to(self.device), mask, layers)
        # clone: a CUDA-graph replay reuses its output buffers at the next call
        return Verification(logits[0, :n].clone(), tuple(h[0, :n].clone() for h in states) if layers else None)

    def precompile(self, max_len: int, max_nodes: int, layers: tuple[int, ...] = ()) -> float:
        """Build, up front, the graphs a request of at most ``max_len`` positions drafting trees of at most
        ``max_nodes`` nodes will use (every bucket up to the one holding ``max_nodes``, asking for the states
        ``layers``), so that no compiling lands inside a timed request. Seconds spent (0 uncompiled)."""
        if not self.compiled:
            return 0.0
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
