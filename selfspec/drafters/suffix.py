"""Suffix speculation: draft what followed the longest earlier match of the context's end, in this request's own
context and in every answer the engine finished before (SuffixDecoding, arXiv 2411.04975, in a compact form).

Traffic repeats itself across requests (agents re-emit tool calls, templated tasks share their skeleton, structured
outputs their keys): the text a server already produced is the cheapest good draft there is.

    SuffixIndex     earlier answers as compact token arrays, and for every position an entry under a hash of the
                    ``KEY`` tokens that end there (at most ``PER_KEY`` entries per key, the newest kept); bounded
                    by ``max_bytes`` of its own accounting, checked against tracemalloc (the least recently used
                    answers, added or drafted from, go first); shared by every request of an engine
    SuffixDrafter   per step, every earlier occurrence of the context's end, each extended backwards to its match
                    length m (up to ``MAX_MATCH``): in the request's own context (of its last token, ``own_matches``,
                    m counted ``OWN`` times) and in the index (of its last ``KEY``); the ``CANDIDATES`` longest
                    matches' continuations, each weighted m^2, make a trie of counts, and the tree drafted is its likeliest nodes by estimated
                    path probability (``frequency_tree``, SuffixDecoding's rule): where earlier text agrees the tree
                    goes deep, where it forks the tree branches; a request that ended well joins the index, prompt
                    and answer (``finished``;
                    repeated prompts are what templated traffic shares), unless it asked not to be kept
                    (``DecodeConfig.remember`` false: ``"store": false``); with ``scoped_bytes``, each scope
                    (``DecodeConfig.scope``: the server's ``--suffix-scope key`` makes it the API key's) reads and
                    joins an index of its own, so one client's answers never shape another's drafts, nor, by
                    evicting, their timing

Drafts are deterministic proposals (as prompt lookup's), so verification stays lossless, greedy and sampled.
"""

from __future__ import annotations

import heapq
import itertools
from array import array
from collections import OrderedDict
from typing import Any

import torch

from ..tree import DraftTree
from .base import DraftContext, Drafter, DraftRequest
from .prompt_lookup import continuation

KEY = 3  # tokens hashed per index entry: the shortest match the index finds
MAX_MATCH = 32  # a match is extended backwards at most this far (longer ones rank the same)
PER_KEY = 32  # index entries kept per key, the newest (common keys: "the", indentation)
CANDIDATES = 32  # matches a tree is built from, the longest (then the newest)
DEPTH_PER_MATCH = 4  # a tree reaches at most this many tokens per token of its longest match (SuffixDecoding's spec
# factor): a weak match drafts short; neutral on the recorded templated answers, it bounds the nodes a guess costs
OWN = 2  # a match in the request's own context counts as one this many times as long as an earlier answer's: its
# own text repeats its specifics (names, values), another request's only the skeleton (+2-4% tau on templated tests)
# what the index's Python objects cost (tracemalloc, CPython 3.12): a token 4 bytes in its array, an entry (one int
# in a key's list) ~40, a key (its hash, dict slot and list) ~170
TOKEN_BYTES, ENTRY_BYTES, KEY_BYTES = 4, 40, 170


class SuffixIndex:
    """Earlier sequences, searchable by their last ``KEY`` tokens, within ``max_bytes`` (the least recently used
    evicted first)."""

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
        """Index ``tokens`` (a request's prompt and answer); the least recently used sequences (added or drafted from)
        go while over ``max_bytes``."""
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
        """Drop the least recently used sequence and its entries."""
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

    def matches(self, context: list[int], depth: int) -> list[tuple[int, list[int]]]:
        """Every indexed earlier occurrence of ``context``'s last ``KEY`` tokens, the newest first: (match length,
        up to ``MAX_MATCH``, the up to ``depth`` tokens that followed; fewer where its sequence ends)."""
        self.lookups += 1
        if len(context) < KEY or depth < 1:
            return []
        tail = context[-KEY:]
        found = []
        for entry in reversed(self.table.get(hash(tuple(tail)), ())):
            sid, end = entry >> 32, entry & 0xFFFFFFFF
            seq = self.seqs.get(sid)
            if seq is None or end >= len(seq) or list(seq[end - KEY:end]) != tail:
                continue  # evicted, nothing follows, or a hash collision
            m = KEY
            while m < MAX_MATCH and m < end and m < len(context) and seq[end - m - 1] == context[-m - 1]:
                m += 1
            found.append((m, seq[end:end + depth].tolist()))
            self.seqs.move_to_end(sid)  # drafted from: the least recently used sequences are evicted first
        self.hits += bool(found)
        return found


def own_matches(tokens: list[int], depth: int) -> list[tuple[int, list[int]]]:
    """Every earlier occurrence of ``tokens``' last token in ``tokens``, the most recent first: (match length, up to
    ``MAX_MATCH``, the ``depth`` tokens predicted if the text goes on as it did there: ``continuation``)."""
    n, found = len(tokens), []
    last = tokens[-1]
    for s in range(n - 2, -1, -1):
        if tokens[s] != last:
            continue
        m = 1
        while m < MAX_MATCH and m <= s and tokens[s - m] == tokens[n - 1 - m]:
            m += 1
        found.append((m, continuation(tokens, s + 1, depth)))
    return found


def frequency_tree(root: int, matches: list[tuple[int, list[int]]], max_nodes: int, max_depth: int) -> DraftTree:
    """The likeliest tree of at most ``max_nodes`` nodes (root included) and ``max_depth`` levels under ``root``:
    the ``CANDIDATES`` longest ``matches``' continuations (at most ``DEPTH_PER_MATCH`` tokens per token of the longest
    match) as a trie of counts, each weighted by its match length squared (a longer match predicts better), expanded
    best first by estimated path probability (the product of
    each step's share of its parent's weight)."""
    matches = sorted(matches, key=lambda mc: mc[0], reverse=True)[:CANDIDATES]  # stable: the newest among equals
    if matches:
        max_depth = min(max_depth, int(DEPTH_PER_MATCH * matches[0][0]))
    weight: dict[tuple[int, ...], float] = {(): 0.0}
    children: dict[tuple[int, ...], list[int]] = {}
    for m, cont in matches:
        prefix = ()
        weight[prefix] += m * m
        for tok in cont[:max_depth]:
            node = (*prefix, tok)
            if node not in weight:
                weight[node] = 0.0
                children.setdefault(prefix, []).append(tok)
            weight[node] += m * m
            prefix = node
    tokens, parents = [root], [-1]
    heap: list[tuple[float, int, tuple[int, ...], int]] = []  # (-path probability, order, node, parent index)
    order = itertools.count()  # among equally likely nodes, the one offered first (the longer, newer match's)

    def offer(prefix: tuple[int, ...], index: int, p: float) -> None:
        for tok in children.get(prefix, ()):
            node = (*prefix, tok)
            heapq.heappush(heap, (-p * weight[node] / weight[prefix], next(order), node, index))

    offer((), 0, 1.0)
    while heap and len(tokens) < max_nodes:
        p, _, node, parent = heapq.heappop(heap)
        tokens.append(node[-1])
        parents.append(parent)
        offer(node, len(tokens) - 1, -p)
    return DraftTree(torch.tensor(tokens, dtype=torch.long), parents)


class SuffixDrafter(Drafter):
    """The request's own context (prompt lookup), then every earlier answer in ``index`` (a new one by default).

    ``scoped_bytes``: every scope gets an index of its own of that many bytes at its first request (the caller bounds
    the number of scopes: the server's API keys); requests without a scope share ``index``. ``min_match``: matches
    shorter than this many tokens are not drafted from (beside heads: 3, as lookup-first's n-grams, so the heads draft
    where the context only repeats a token or two; alone: 1, every match).
    """

    name = "suffix"

    def __init__(self, index: SuffixIndex | None = None, scoped_bytes: int | None = None, min_match: int = 1) -> None:
        self.index = index if index is not None else SuffixIndex()
        self.scoped_bytes, self.min_match = scoped_bytes, min_match
        self.scoped: dict[str, SuffixIndex] = {}

    def index_for(self, scope: str | None) -> SuffixIndex:
        """The index requests of ``scope`` read and join."""
        if scope is None or self.scoped_bytes is None:
            return self.index
        if scope not in self.scoped:
            self.scoped[scope] = SuffixIndex(self.scoped_bytes)
        return self.scoped[scope]

    def indexes(self) -> list[SuffixIndex]:
        """Every index this drafter holds (the shared one first)."""
        return [self.index, *self.scoped.values()]

    def propose(self, state: Any, ctx: DraftContext, req: DraftRequest) -> tuple[DraftTree, Any]:
        """The likeliest tree over the matches in the request's own context and in its scope's index."""
        tokens, depth = ctx.tokens.tolist(), req.max_depth
        if depth < 1:
            return DraftTree(ctx.tokens[-1:].clone(), [-1]), state
        found = [(OWN * m, cont) for m, cont in own_matches(tokens, depth) if m >= self.min_match]
        found += [(m, cont) for m, cont in self.index_for(ctx.scope).matches(tokens[-MAX_MATCH:], depth)
                  if m >= self.min_match]
        return frequency_tree(tokens[-1], found, req.max_nodes, depth), state

    def finished(self, state: Any, tokens: torch.Tensor, scope: str | None = None) -> None:
        """The request ended well: its prompt and answer join its scope's index."""
        self.index_for(scope).add(tokens.tolist())
