"""The head's KV cache for the sequences a batch drafts together: a row each, kept from step to step.

A batched draft (``EagleDrafter.propose_chains``) runs the head over every sequence at once, over one ``RowCache``
with a row per sequence that has drafted in a batch. The rows claimed are always 0..n-1 (a sequence that ends hands
its row to the last one, whose pairs are copied over once, as ``RowPass`` does with the target's rows), and every
row has room for its pairs plus a step's new and drafted ones (slots grown in chunks of ``SLOT_CHUNK``, rows
doubled, copying once). A step writes only the pairs it feeds and drafts, so it costs the same at 256 and 2,048
pairs of context but for attention itself; before, each step copied every row's whole cache into a fresh one and
appended the new pairs back to each sequence's own (O(rows x context) a step, O(context^2) over an answer).

A sequence drafted alone (a batch of one) keeps using its own ``DynamicCache`` (``EagleState.cache``) for EAGLE-2
trees. The two are kept in step lazily: ``EagleState.row_len`` and ``EagleState.dense`` count the committed pairs
each holds, and the missing ones are copied across when a sequence moves from one to the other (the pairs since
it last moved: a few, or a prompt once).

A row is freed by ``release`` (the drafter's, when its request ends); a sequence dropped without it is found by a
weak reference and its row freed at the next ``place``.
"""

from __future__ import annotations

import weakref

import torch

from ..target.kv_cache import RowCache

SLOT_CHUNK = 256  # slots are added this many at a time (a copy of the cache each time)


class HeadRows:
    """A batch's head cache: ``claimed[r]`` refers to the ``EagleState`` in row r."""

    def __init__(self, config, dtype: torch.dtype, device: torch.device) -> None:
        self.config, self.dtype, self.device = config, dtype, device
        self.cache: RowCache | None = None
        self.claimed: list[weakref.ref] = []

    @property
    def rows(self) -> int:
        """Rows claimed (0..rows-1)."""
        return len(self.claimed)

    def states(self) -> list:
        """The state in each claimed row (None where it was dropped without a release)."""
        return [ref() for ref in self.claimed]

    def place(self, states: list, extra: int) -> RowCache:
        """Give every state in ``states`` a row holding its committed pairs, and every row ``extra`` free slots after
        its pairs (this step's new and drafted ones); returns the cache, its ``rows`` set to every claimed row."""
        self._drop_dead()
        for state in states:
            if state.row < 0:
                state.row, state.row_len = len(self.claimed), 0
                self.claimed.append(weakref.ref(state))
        longest = max([state.cached for state in states] + [s.row_len for s in self.states() if s is not None])
        self._reserve(len(self.claimed), longest + extra)
        for state in states:
            if state.row_len < state.cached:
                self._copy_in(state)
        self.cache.rows = slice(0, len(self.claimed))
        return self.cache

    def copy_out(self, state) -> None:
        """Append the committed pairs ``state``'s row holds and its own cache lacks to its own cache."""
        if state.row < 0 or state.dense >= state.cached:
            return
        a, b = state.dense, state.cached
        for index, layer in enumerate(self.cache.layers):
            state.cache.update(layer.keys[state.row:state.row + 1, :, a:b], layer.values[state.row:state.row + 1, :, a:b],
                               index)
        state.dense = b

    def release(self, state) -> None:
        """Free ``state``'s row (its request ended)."""
        if state.row >= 0:
            self._free(state.row)
        state.row, state.row_len = -1, 0

    def _free(self, row: int) -> None:
        """The last claimed row moves into ``row`` (its pairs copied), keeping the rows 0..n-1."""
        last = self.claimed.pop()
        if row == len(self.claimed):
            return
        moved = last()
        if moved is not None:
            n = moved.row_len
            for layer in self.cache.layers:
                layer.keys[row, :, :n] = layer.keys[moved.row, :, :n]
                layer.values[row, :, :n] = layer.values[moved.row, :, :n]
            moved.row = row
        self.claimed[row] = last

    def _drop_dead(self) -> None:
        for row in reversed(range(len(self.claimed))):
            if self.claimed[row]() is None:
                self._free(row)

    def _reserve(self, rows: int, slots: int) -> None:
        """At least ``rows`` rows of at least ``slots`` slots (a larger cache, the old one copied in, when short)."""
        shape = (0, 0, 0) if self.cache is None else self.cache.layers[0].keys.shape  # (rows, kv heads, slots, dim)
        have_rows, have_slots = shape[0], shape[2]
        if rows <= have_rows and slots <= have_slots:
            return
        rows = have_rows if rows <= have_rows else max(rows, 2 * have_rows)
        slots = max(have_slots, -(-slots // SLOT_CHUNK) * SLOT_CHUNK)
        fresh = RowCache(self.config, rows, slots, self.dtype, self.device)
        if self.cache is not None:
            for old, new in zip(self.cache.layers, fresh.layers):
                new.keys[:have_rows, :, :have_slots] = old.keys
                new.values[:have_rows, :, :have_slots] = old.values
        self.cache = fresh

    def _copy_in(self, state) -> None:
        """Copy the committed pairs ``state``'s own cache holds and its row lacks into its row."""
        a, b = state.row_len, state.cached
        for layer, own in zip(self.cache.layers, state.cache.layers):
            layer.keys[state.row, :, a:b] = own.keys[0, :, a:b]
            layer.values[state.row, :, a:b] = own.values[0, :, a:b]
        state.row_len = b
