"""The target pass for many requests at once: one preallocated KV cache with a row per request.

    cache     (rows, kv_heads, slots, head_dim) per layer, allocated once: ``slots`` = the context a request may
              use + the largest tree bucket. Every request claims a row (``Slot``) and keeps its own length;
              the rows claimed are always 0..n-1 (a request that leaves hands its row to the last one, whose
              committed entries are copied over), so a pass reads a prefix of the rows without copying K/V
    a pass    every row's root + tree padded to one node bucket b; row r's node i is written at slot len_r + i
              (per-row positions, per-row 4-D masks: row r sees its slots < len_r and its own tree's ancestors);
              claimed rows with nothing to verify this step (a request still being prefilled) and padding rows
              take part as dummies that write into the last b slots, which no request's tokens reach
    keep      per row: the accepted path gathered behind the row's root, the row's length moved; nothing else
              is copied, rejected entries stay as stale slots the masks hide until overwritten
    prefill   one request's row at a time, in chunks (``PREFILL_CHUNK``), between the batch's passes (exact: each
              token as its plain step computes it, ``StaticPass.prefill_chunk``)
    order     the exact pass through torch's attention kernel gives a pass's requests rows 0..n-1, longest first,
              when rows of one key width are not adjacent (``arrange``): each width's rows then attend in one call
              over their cache rows in place (the row attention kernel reads every row in place in one call)

Exact (the default, as for the single-request static pass): each row attends over its own cache row exactly as
that request's pass alone would (``exact.BatchPlan``), and a pass's rows are padded (with dummy rows) until its
tokens, rows x nodes, are a size of the row grid the start-up self-test checked for every linear (``exact.ROW_SIZES``:
1, 2, 4, then multiples of 8, the sizes prompts are cached in too), passes of more than ``exact.ROW_MAX`` tokens
running in parts of at most that: a request's tokens are then bit-identical whoever shares its batch. Uncompiled:
batch shapes vary every step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import row_attention
from .attention import static_attention
from .errors import SelfspecError
from .exact import ROW_MAX, BatchPlan, on_grid, plan_pass, width_for
from .kv_cache import RowCache
from .memory import kv_bytes_per_token
from .static_pass import BUCKETS, StaticPass, ancestor_block, bucket_for, static_mask
from .tree import DraftTree
from .verify import Verification


def grid_rows(rows: int, nodes: int) -> int:
    """The fewest rows >= ``rows`` for which a pass of ``nodes`` nodes a row is on the row grid (``exact.on_grid``)."""
    while not on_grid(rows * nodes):
        rows += 1
    return rows


@dataclass
class Slot:
    """A request's row of the batch cache and how many positions it holds (``row`` -1 once released)."""

    row: int
    length: int = 0


ROW_BUCKETS = (2, *(b for b in BUCKETS if b > 2))  # nodes a row's tree is padded to: no graphs to build here, so
# a 2-node bucket too (a batch's one-token drafts: 4 rows x 2 cost about what 4 x 1 do, 4 x 4 a good deal more)


class BatchPass(StaticPass):
    """The static pass over a cache of ``max_batch`` rows of ``context`` positions each (refused, with one line,
    when it does not fit ``memory_bytes``, if given). Also a single-request target pass (``verify`` on one slot)."""

    def __init__(self, model: torch.nn.Module, max_batch: int, context: int, exact: bool = True, pack: bool = True,
                 memory_bytes: int | None = None) -> None:
        if max_batch < 1:
            raise SelfspecError(f"a batch holds at least one request, got {max_batch}")
        super().__init__(model, compile=False, buckets=ROW_BUCKETS, exact=exact, pack=pack)
        self.name = "batched"
        self.max_batch, self.context = max_batch, context
        self.max_len = context + self.buckets[-1]  # slots per row: a pass pads past a request's last position
        rows = grid_rows(max_batch, 1) if self.exact else max_batch  # exact passes pad their rows onto the grid
        need = kv_bytes_per_token(model.config, self.dtype) * rows * self.max_len
        if memory_bytes is not None and need > memory_bytes:
            raise SelfspecError(f"the KV cache for {max_batch} requests of {context:,} positions needs "
                                f"{need / 2**30:.1f} GiB, more than the {memory_bytes / 2**30:.1f} GiB available: "
                                "lower --max-batch or --max-context")
        self.cache = RowCache(model.config, rows, self.max_len, self.dtype, self.device)
        self.claimed: list[Slot] = []  # claimed[r] holds row r
        self.last_shape = (0, 0)  # (rows, nodes per row) the last verify_batch ran, padding included

    # --- rows ------------------------------------------------------------------------------------------------

    def new_cache(self, max_len: int) -> Slot:
        """Claim a row for a request of at most ``max_len`` positions."""
        if max_len > self.context:
            raise SelfspecError(f"a request of {max_len:,} positions (prompt + max new tokens) exceeds the batch "
                                f"cache's {self.context:,} per request: raise --max-context or shorten it")
        if len(self.claimed) >= self.max_batch:
            raise SelfspecError(f"all {self.max_batch} rows of the batch cache are taken")
        slot = Slot(len(self.claimed))
        self.claimed.append(slot)
        return slot

    def release(self, slot: Slot) -> None:
        """Free ``slot``'s row: the last claimed row moves into it (its committed entries copied), keeping 0..n-1."""
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
            raise SelfspecError("this request's row of the batch cache was released")
        return slot

    # --- passes ----------------------------------------------------------------------------------------------

    def _place(self, slot: Slot, start: int, n: int) -> None:
        self._own(slot)
        self.cache.rows = slice(slot.row, slot.row + 1)
        self.cache.write = torch.arange(start, start + n, device=self.device)[None]

    def _prefilled(self, slot: Slot, length: int) -> None:
        slot.length = length

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
        if self.exact and not row_attention.used(self.device, self.dtype):  # the row kernel reads any rows in place
            self.arrange([slot for slot, _ in items])
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

    def pass_shape(self, rows: int, nodes: int) -> tuple[int, int]:
        """(rows, nodes per row) a pass over the first ``rows`` rows, trees of ``nodes`` nodes, runs (with padding):
        exact, rows x nodes is on the row grid the self-test checked (and at least its least rows)."""
        nodes = bucket_for(nodes, (1, *self.buckets))
        if not self.exact:
            return rows, nodes
        nodes = max(nodes, -(-self.support.least // rows))
        return grid_rows(rows, nodes), nodes

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
            logits, states = self._forward(ids.to(self.device), positions.to(self.device), mask, layers,
                                           BatchPlan(plans, self.support.batched) if self.exact else None)
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

    def length(self, slot: Slot) -> int:
        """Positions ``slot``'s row holds."""
        return self._own(slot).length

