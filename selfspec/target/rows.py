"""The target pass: one preallocated KV cache with a row per request, one pass for any number of rows.

    cache     (rows, kv_heads, slots, head_dim) per layer: ``slots`` = the context a request may use + the largest
              tree bucket. Every request claims a row (``Slot``) and keeps its own length; the rows claimed are
              always 0..n-1 (a request that leaves hands its row to the last one, whose committed entries are
              copied over), so a pass reads a prefix of the rows without copying K/V. A single request is one row:
              the engine's "static" pass is this pass with one row whose context grows (in ``CACHE_STEP``s) as
              requests need, a newer request taking the row from an older one (one request at a time)
    a pass    every row's root + tree padded to one node bucket b (``pass_shape``); row r's node i is written at
              slot len_r + i (per-row positions, per-row masks: row r sees its slots < len_r and its own tree's
              ancestors); claimed rows with nothing to verify this step (a request still being prefilled) and
              padding rows take part as dummies that write into the last b slots, which no request's tokens reach
    keep      per row: the accepted path gathered behind the row's root, the row's length moved; rejected entries
              stay as stale slots the masks hide until overwritten
    prefill   one request's row at a time, in chunks (``PREFILL_CHUNK``); exact: each token as its plain step
              computes it, in forwards of row counts the self-test checked, so a prompt's cache has the same bits
              however it is chunked and a cached prefix can be reused exactly (``selfspec/prefix_cache.py``)
    order     the exact pass through torch's attention kernel gives a pass's requests rows 0..n-1, longest first,
              when rows of one key width are not adjacent (``arrange``): each width's rows then attend in one call
              over their cache rows in place (the row attention kernel reads every row in place in one call)

Exact (the default where the start-up self-test passes): each row attends over its own cache row exactly as a
one-token plain step of that request would (``exact.BatchPlan``), and a pass's rows are padded (with dummy rows)
until its tokens, rows x nodes, are a size of the row grid the self-test checked for every linear
(``exact.ROW_SIZES``: 1, 2, 4, then multiples of 8, the sizes prompts are cached in too), passes of more than
``exact.ROW_MAX`` tokens running in parts of at most that: a request's tokens are then bit-identical to its plain
decoding, whoever shares its batch, bf16 included. Batch shapes vary every step (nothing is compiled here: the
compiled CUDA-graph pass is ``selfspec/target/compiled.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from ..context import context_length
from ..errors import SelfspecError
from ..memory import attention_layout, kv_bytes_per_token
from ..tree import DraftTree
from ..verify import Verification
from . import row_attention
from .attention import static_attention
from .common import BUCKETS, PREFILL_CHUNK, Target, ancestor_block, bucket_for, grown, static_mask
from .exact import (ROW_MAX, BatchPlan, ExactSupport, check_exact, log as exact_log, on_grid, plan_pass,
                    prefill_parts, prefill_rows, width_for)
from .kv_cache import RowCache


def grid_rows(rows: int, nodes: int) -> int:
    """The fewest rows >= ``rows`` for which a pass of ``nodes`` nodes a row is on the row grid (``exact.on_grid``)."""
    while not on_grid(rows * nodes):
        rows += 1
    return rows


@dataclass
class Slot:
    """A request's row of the cache and how many positions it holds (``row`` -1 once released)."""

    row: int
    length: int = 0


class RowPass:
    """The target over a cache of ``max_batch`` rows of ``context`` positions each (refused, with one line, when it
    does not fit ``memory_bytes``, if given); ``context=None``: one request at a time in a row that grows as
    requests need. ``exact``: every row computed as a plain step computes it, if this device's self-test allows
    (``self.exact`` says whether it does, ``self.support.reason`` why not)."""

    def __init__(self, model: torch.nn.Module, max_batch: int = 1, context: int | None = None, exact: bool = True,
                 pack: bool = True, memory_bytes: int | None = None, buckets: tuple[int, ...] = BUCKETS) -> None:
        if max_batch < 1:
            raise SelfspecError(f"a batch holds at least one request, got {max_batch}")
        if context is None and max_batch != 1:
            raise SelfspecError("a cache of several rows needs a context per row")
        self.target = Target(model, pack)
        self.model, self.device, self.dtype, self.packed = self.target.parts()
        self.support = ExactSupport(False, reason="off (--no-exact)")
        if exact:
            self.support = check_exact(model)
            self.support.bound(model)  # the linears' row bounds, set once
            if not self.support.exact:
                exact_log.warning("exact target pass unavailable: %s; speculative output may differ from plain "
                                  "decoding by rounding (each difference is diagnosed)", self.support.reason)
        self.exact, self.exact_requested = self.support.exact, exact
        self.buckets = tuple(sorted(buckets))
        self.max_batch, self.memory_bytes = max_batch, memory_bytes
        self.growable = context is None
        self.name = "static" if self.growable else "batched"
        self.cache: RowCache | None = None
        self.context = self.max_len = 0  # positions per request; slots per row (the context + the largest bucket)
        self.claimed: list[Slot] = []  # claimed[r] holds row r
        self.last_shape = (0, 0)  # (rows, nodes per row) the last pass ran, padding included
        if context is not None:
            self._allocate(context)

    def _allocate(self, context: int) -> None:
        rows = grid_rows(self.max_batch, 1) if self.exact else self.max_batch  # exact passes pad rows onto the grid
        slots = context + self.buckets[-1]  # a pass pads past a request's last position
        need = kv_bytes_per_token(self.model.config, self.dtype) * rows * slots
        if self.memory_bytes is not None and need > self.memory_bytes:
            raise SelfspecError(f"the KV cache for {self.max_batch} requests of {context:,} positions needs "
                                f"{need / 2**30:.1f} GiB, more than the {self.memory_bytes / 2**30:.1f} GiB available: "
                                "lower --max-batch or --max-context")
        self.cache = None  # the old one goes before the new one is made
        self.cache = RowCache(self.model.config, rows, slots, self.dtype, self.device)
        self.context, self.max_len = context, slots

    # --- rows ------------------------------------------------------------------------------------------------

    def new_cache(self, max_len: int) -> Slot:
        """Claim a row for a request of at most ``max_len`` positions (growable: the row, grown if too short)."""
        if self.growable:
            for slot in list(self.claimed):  # one request at a time: a newer one takes the row
                self.release(slot)
            if max_len > self.context:
                self._allocate(grown(max_len, context_length(self.model.config), 0))
        elif max_len > self.context:
            raise SelfspecError(f"a request of {max_len:,} positions (prompt + max new tokens) exceeds the batch "
                                f"cache's {self.context:,} per request: raise --max-context or shorten it")
        if len(self.claimed) >= self.max_batch:
            raise SelfspecError(f"all {self.max_batch} rows of the batch cache are taken")
        slot = Slot(len(self.claimed))
        self.claimed.append(slot)
        return slot

    def release(self, slot: Slot) -> None:
        """Free ``slot``'s row (nothing if it was freed already): the last claimed row moves into it (its committed
        entries copied), keeping 0..n-1."""
        if slot.row < 0:
            return
        self._own(slot)
        last = self.claimed.pop()
        if last is not slot:
            n = last.length
            for layer in self.cache.layers:
                layer.keys[slot.row, :, :n] = layer.keys[last.row, :, :n]
                layer.values[slot.row, :, :n] = layer.values[last.row, :, :n]
            last.row = slot.row
            self.claimed[slot.row] = last
        slot.row = -1

    @property
    def free(self) -> int:
        """Rows not claimed."""
        return self.max_batch - len(self.claimed)

    def arrange(self, slots: list[Slot]) -> None:
        """Give ``slots`` (the requests of the next pass) rows 0..n-1, longest first, where their key widths are not
        yet in runs: rows of one width are then adjacent and attend in one call over their cache rows in place
        (else their K/V are gathered in every layer). Requests grow at the same pace, so the order mostly holds;
        moving a row copies its committed entries once. Outputs do not depend on the rows."""
        slots = sorted(slots, key=lambda slot: slot.row)
        widths = [width_for(slot.length, self.max_len) for slot in slots]
        runs = sum(1 for i, w in enumerate(widths) if not i or w != widths[i - 1])
        if slots[-1].row == len(slots) - 1 and runs == len(set(widths)):
            return
        order = sorted(slots, key=lambda slot: (-slot.length, slot.row))
        placed = {id(slot) for slot in order}
        order += [slot for slot in self.claimed if id(slot) not in placed]  # claimed, not in this pass: behind
        moved = [(slot.row, new) for new, slot in enumerate(order) if slot.row != new]
        if not moved:
            return
        src = torch.tensor([old for old, _ in moved], device=self.device)
        dst = torch.tensor([new for _, new in moved], device=self.device)
        n = max(order[new].length for _, new in moved)
        for layer in self.cache.layers:  # gather first, then write: rows may trade places
            layer.keys[:, :, :n].index_copy_(0, dst, layer.keys[:, :, :n].index_select(0, src))
            layer.values[:, :, :n].index_copy_(0, dst, layer.values[:, :, :n].index_select(0, src))
        for new, slot in enumerate(order):
            slot.row = new
        self.claimed = order

    def _own(self, slot: Slot) -> Slot:
        if not (0 <= slot.row < len(self.claimed)) or self.claimed[slot.row] is not slot:
            if self.growable:
                raise SelfspecError("this request's KV cache was taken by a newer request on the same engine: "
                                    "a single-request engine decodes one request at a time")
            raise SelfspecError("this request's row of the batch cache was released")
        return slot

    def length(self, slot: Slot) -> int:
        """Positions ``slot``'s row holds."""
        return self._own(slot).length

    def draft_view(self, slot: Slot):
        """None: drafters that would draft inside the target's cache (early exit) keep their own instead."""
        return None

    # --- prompts ---------------------------------------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, slot: Slot, ids: torch.Tensor, layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, ...] | None:
        """Cache ``ids`` (1-D) from slot 0 in chunks of ``PREFILL_CHUNK`` tokens; the asked layers' states, (n, H)
        each."""
        n = ids.numel()
        if n > self.context:
            raise SelfspecError(f"the prompt ({n} tokens) does not fit the cache ({self.context} positions a row)")
        parts = [self.prefill_chunk(slot, ids[start:start + PREFILL_CHUNK], start, layers)
                 for start in range(0, n, PREFILL_CHUNK)]
        return tuple(torch.cat(states) for states in zip(*parts)) if layers else None

    def prefill_chunk(self, slot: Slot, ids: torch.Tensor, start: int, layers: tuple[int, ...]
                      ) -> tuple[torch.Tensor, ...]:
        """Cache ``ids`` (1-D) at slots ``start..`` of ``slot``'s row, behind the ``start`` already cached; the
        ``layers``' states. Where ``exact_prefill``, every token is computed as its plain step would compute it."""
        self._own(slot)
        exact, n = self.exact_prefill, ids.numel()
        parts = prefill_parts(n, self.prefill_rows[1], self.prefill_rows[0]) if exact else [(n, n)]
        states, done = [], 0
        for c, rows in parts:
            part = torch.zeros(rows, dtype=torch.long)
            part[:c] = ids[done:done + c]
            plan = plan_pass(list(range(-1, c - 1)), list(range(c)), start + done, self.max_len, self.dtype,
                             self.device) if exact else None
            states.append(self._prompt_forward(slot, part, start + done, c, layers, plan))
            done += c
        slot.length = start + done
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

    def _prompt_forward(self, slot: Slot, ids: torch.Tensor, start: int, real: int, layers: tuple[int, ...],
                        plan) -> tuple[torch.Tensor, ...]:
        """One forward caching ``ids`` at slots ``start..`` of ``slot``'s row (the first ``real`` of them tokens, the
        rest padding); under ``plan`` as the exact pass attends, else under a causal mask."""
        c = ids.numel()
        self.cache.rows = slice(slot.row, slot.row + 1)
        self.cache.write = torch.arange(start, start + c, device=self.device)[None]
        positions = torch.arange(start, start + c, device=self.device)[None]
        with static_attention(self.model) as cut:  # eager: attend over the slots written so far
            if plan is not None:
                mask = torch.zeros(1, 1, c, 1, dtype=self.dtype, device=self.device)  # the plan says who sees what
            else:
                mask = static_mask(torch.ones(c, c, dtype=torch.bool).tril(), start,
                                   start + c if cut else self.max_len, self.dtype, self.device)
            _, states = self.target.forward(self.cache, ids.to(self.device)[None], positions, mask, layers, plan,
                                            logits=False)
        return tuple(h[0, :real] for h in states)

    def read_prefix(self, slot: Slot, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the K and V of ``slot``'s first ``n`` positions: (layers, kv_heads, n, head_dim) each."""
        r = self._own(slot).row
        return (torch.stack([layer.keys[r, :, :n] for layer in self.cache.layers]),
                torch.stack([layer.values[r, :, :n] for layer in self.cache.layers]))

    def write_prefix(self, slot: Slot, keys: torch.Tensor, values: torch.Tensor, n: int) -> None:
        """Fill ``slot``'s first ``n`` positions from ``keys``/``values`` (as ``read_prefix`` gives them)."""
        r = self._own(slot).row
        for layer, k, v in zip(self.cache.layers, keys, values):
            layer.keys[r, :, :n] = k[:, :n]
            layer.values[r, :, :n] = v[:, :n]
        slot.length = n

    # --- passes ----------------------------------------------------------------------------------------------

    def pass_shape(self, rows: int, nodes: int) -> tuple[int, int]:
        """(rows, nodes per row) a pass over the first ``rows`` rows, trees of at most ``nodes`` nodes, runs (with
        padding): nodes to a bucket; exact, rows x nodes on the row grid the self-test checked (and at least its
        least rows, and the fewest this CPU runs fastest: ``exact.fastest_rows``). The one bucket function, for one
        row and for many."""
        nodes = bucket_for(nodes, self.buckets)
        if not self.exact:
            return rows, nodes
        nodes = max(nodes, -(-self.support.least // rows))
        if grid_rows(rows, nodes) * nodes < self.support.fast:  # padding rows first, then nodes
            nodes = bucket_for(-(-self.support.fast // grid_rows(rows, nodes)), self.buckets)
        return grid_rows(rows, nodes), nodes

    def verify(self, slot: Slot, tree: DraftTree, cache_len: int, layers: tuple[int, ...] = ()) -> Verification:
        """One request's pass (a batch of one)."""
        if cache_len != self._own(slot).length:
            raise SelfspecError(f"the request's row holds {slot.length} positions, not {cache_len}")
        return self.verify_batch([(slot, tree)], layers)[0]

    @torch.no_grad()
    def verify_batch(self, items: list[tuple[Slot, DraftTree]], layers: tuple[int, ...] = ()) -> list[Verification]:
        """One pass over every request's root + tree (``items``, one per row, each row at most once): the
        target's logits (and the asked layers' states) per request, in the order of ``items``."""
        if len({self._own(slot).row for slot, _ in items}) != len(items):
            raise SelfspecError("a batched pass verifies each request once")
        if self.exact and not row_attention.used(self.device, self.dtype):
            self.arrange([slot for slot, _ in items])  # the row kernel reads any rows in place
        by_row = {slot.row: (slot, tree) for slot, tree in items}
        for slot, tree in items:
            if slot.length + tree.size > self.max_len:
                raise SelfspecError(f"a request's row is full ({slot.length} of {self.max_len} slots)")
        n_rows, b = self.pass_shape(max(by_row) + 1, max(tree.size for _, tree in items))
        part = max(1, ROW_MAX // b) if self.exact else n_rows
        out: dict[int, Verification] = {}
        for lo in range(0, n_rows, part):
            if any(lo <= r < lo + part for r in by_row):
                out.update(self._pass(by_row, lo, min(lo + part, n_rows), b, layers))
        self.last_shape = (n_rows, b)
        return [out[slot.row] for slot, _ in items]

    def _pass(self, by_row: dict[int, tuple[Slot, DraftTree]], lo: int, hi: int, b: int, layers: tuple[int, ...]
              ) -> dict[int, Verification]:
        """One forward over rows lo..hi-1, each padded to ``b`` nodes (rows without a tree are dummies)."""
        m = hi - lo
        ids = torch.zeros(m, b, dtype=torch.long)
        positions = torch.zeros(m, b, dtype=torch.long)
        write = torch.arange(self.max_len - b, self.max_len).repeat(m, 1)  # dummies: the last b slots
        plans = [None] * m
        mine = {r: item for r, item in by_row.items() if lo <= r < hi}
        width = max(slot.length for slot, _ in mine.values()) + b
        with static_attention(self.model) as cut:
            width = 1 if self.exact else width if cut else self.max_len  # exact: the plans say who sees what
            mask = torch.full((m, 1, b, width), torch.finfo(self.dtype).min, dtype=self.dtype, device=self.device)
            for r, (slot, tree) in mine.items():
                i, n, start = r - lo, tree.size, slot.length
                ids[i, :n] = tree.tokens
                positions[i] = start
                positions[i, :n] += torch.tensor(tree.depth)
                write[i] = torch.arange(start, start + b)
                if self.exact:
                    plans[i] = plan_pass(tree.parents, tree.depth, start, self.max_len, self.dtype, self.device,
                                         self.support.batched)
                else:
                    mask[i] = static_mask(ancestor_block(tree.parents, b), start, width, self.dtype, self.device)[0]
            self.cache.rows, self.cache.write = slice(lo, hi), write.to(self.device)
            logits, states = self.target.forward(self.cache, ids.to(self.device), positions.to(self.device), mask,
                                                 layers, BatchPlan(plans, self.support.batched) if self.exact else None)
        return {r: Verification(logits[r - lo, :tree.size], tuple(h[r - lo, :tree.size] for h in states) if layers
                                else None) for r, (_, tree) in mine.items()}

    def keep(self, slot: Slot, start: int, keep: list[int]) -> None:
        """Copy the pass's entries ``keep`` (ascending) of ``slot``'s row into slots ``start..``; its length moves."""
        r, n = self._own(slot).row, len(keep)
        if keep != list(range(n)):
            idx = torch.tensor(keep, device=self.device) + start
            for layer in self.cache.layers:  # gather first, then write in place
                layer.keys[r, :, start:start + n] = layer.keys[r].index_select(1, idx)
                layer.values[r, :, start:start + n] = layer.values[r].index_select(1, idx)
        slot.length = start + n
