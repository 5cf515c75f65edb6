"""Suffix speculation: draft what followed the longest earlier match of the context's end, in this request's own
context and in every answer the engine finished before (SuffixDecoding, arXiv 2411.04975, in a compact form).

Traffic repeats itself across requests (agents re-emit tool calls, templated tasks share their skeleton, structured
outputs their keys): the text a server already produced is the cheapest good draft there is.

    SuffixIndex     earlier answers as compact token arrays, and for every position an entry under a hash of the
                    ``KEY`` tokens that end there (at most ``PER_KEY`` entries per key, the newest kept); bounded
                    by ``max_bytes`` of its own accounting, checked against tracemalloc (the oldest answers go
                    first); shared by every request of an engine
    SuffixDrafter   per step: the indexed positions whose ``KEY`` tokens equal the context's last ``KEY``, each
                    extended backwards to its match length (up to ``MAX_MATCH``); the continuations of the longest
                    matches, the most frequent first, and the request's own context's (prompt lookup) before them,
                    as one trie; a request that ended well joins the index, prompt and answer (``finished``;
                    repeated prompts are what templated traffic shares), unless it asked not to be kept
                    (``DecodeConfig.remember`` false: ``"store": false``)

Drafts are deterministic proposals (as prompt lookup's), so verification stays lossless, greedy and sampled.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from typing import Any

import torch

from ..tree import DraftTree, from_paths
from .base import DraftContext, DraftRequest, Drafter
from .prompt_lookup import find_continuations

KEY = 3  # tokens hashed per index entry: the shortest match the index finds
MAX_MATCH = 32  # a match is extended backwards at most this far (longer ones rank the same)
PER_KEY = 32  # index entries kept per key, the newest (common keys: "the", indentation)
# what the index's Python objects cost (tracemalloc, CPython 3.12): a token 4 bytes in its array, an entry (one int
# in a key's list) ~40, a key (its hash, dict slot and list) ~170
TOKEN_BYTES, ENTRY_BYTES, KEY_BYTES = 4, 40, 170


class SuffixIndex:
    """Earlier sequences, searchable by their last ``KEY`` tokens, within ``max_bytes`` (oldest evicted first)."""

    def __init__(self, max_bytes: int = 64 * 2**20) -> None:
        self.max_bytes = max_bytes
        self.seqs: OrderedDict[int, array] = OrderedDict()
        self.table: dict[int, list[int]] = {}  # key hash -> entries (sequence id << 32 | end), oldest first
        self.tokens = self.entries = 0
        self.added = 0  # sequences ever added (ids)
        self.lookups = self.hits = 0

    @property
    def nbytes(self) -> int:
        """What the index holds, by its accounting (tokens, entries and keys at their measured costs)."""
        return TOKEN_BYTES * self.tokens + ENTRY_BYTES * self.entries + KEY_BYTES * len(self.table)

    def add(self, tokens: list[int]) -> None:
        """Index ``tokens`` (a request's prompt and answer); the oldest sequences go while over ``max_bytes``."""
        if len(tokens) <= KEY or len(tokens) * (TOKEN_BYTES + ENTRY_BYTES + KEY_BYTES) > self.max_bytes:
            return
        sid, seq = self.added, array("i", tokens)
        self.added += 1
        self.seqs[sid] = seq
        self.tokens += len(seq)
        for end in range(KEY, len(seq) + 1):
            bucket = self.table.setdefault(hash(tuple(seq[end - KEY:end])), [])
            bucket.append(sid << 32 | end)
            if len(bucket) > PER_KEY:
                del bucket[0]
            else:
                self.entries += 1
        while self.nbytes > self.max_bytes:
            self._evict()

    def _evict(self) -> None:
        """Drop the oldest sequence and its entries."""
        sid, seq = self.seqs.popitem(last=False)
        self.tokens -= len(seq)
        for end in range(KEY, len(seq) + 1):
            key = hash(tuple(seq[end - KEY:end]))
            bucket = self.table.get(key)
            if bucket is None:
                continue
            kept = [e for e in bucket if e >> 32 != sid]
            self.entries -= len(bucket) - len(kept)
            if not kept:
                del self.table[key]
            else:
                self.table[key] = kept

    def continuations(self, context: list[int], depth: int, limit: int) -> list[list[int]]:
        """Up to ``limit`` distinct continuations of ``depth`` tokens (fewer where a sequence ends) of the earlier
        matches of ``context``'s end: the longest matches first, among equally long ones the most frequent
        continuation first, then the newest."""
        self.lookups += 1
        if len(context) < KEY or depth < 1:
            return []
        tail = context[-KEY:]
        found: dict[tuple[int, ...], list[int]] = {}  # continuation -> [best match length, count, newest]
        for order, entry in enumerate(reversed(self.table.get(hash(tuple(tail)), ()))):
            sid, end = entry >> 32, entry & 0xFFFFFFFF
            seq = self.seqs.get(sid)
            if seq is None or end >= len(seq) or list(seq[end - KEY:end]) != tail:
                continue  # evicted, nothing follows, or a hash collision
            m = KEY
            while m < MAX_MATCH and m < end and m < len(context) and seq[end - m - 1] == context[-m - 1]:
                m += 1
            cont = tuple(seq[end:end + depth])
            best = found.setdefault(cont, [0, 0, -order])
            best[0], best[1] = max(best[0], m), best[1] + 1
        if found:
            self.hits += 1
        ranked = sorted(found.items(), key=lambda kv: kv[1], reverse=True)
        return [list(cont) for cont, _ in ranked[:limit]]


class SuffixDrafter(Drafter):
    """The request's own context (prompt lookup), then every earlier answer in ``index`` (a new one by default)."""

    name = "suffix"

    def __init__(self, index: SuffixIndex | None = None, candidates: int = 4, own_ngram: int = 3) -> None:
        self.index = index if index is not None else SuffixIndex()
        self.candidates, self.own_ngram = candidates, own_ngram

    def propose(self, state: Any, ctx: DraftContext, req: DraftRequest) -> tuple[DraftTree, Any]:
        root, depth = int(ctx.tokens[-1]), req.max_depth
        paths: list[list[int]] = []
        for n in range(self.own_ngram, 0, -1):  # the request's own context first: its most recent repeat
            paths = find_continuations(ctx.tokens, n, depth, 2)
            if paths:
                break
        for cont in self.index.continuations(ctx.tokens[-MAX_MATCH:].tolist(), depth, self.candidates):
            if cont not in paths:
                paths.append(cont)
        return from_paths(root, paths, req.max_nodes), state

    def finished(self, state: Any, tokens: torch.Tensor) -> None:
        """The request ended well: its prompt and answer join the index."""
        self.index.add(tokens.tolist())
