"""Prompt lookup: draft the tokens that followed the latest earlier occurrence of the current n-gram.

No training and no extra weights. Code edits, quoting and summarising repeat the context, which is
where this pays. Several earlier occurrences with different continuations become a tree.
"""

from __future__ import annotations

from typing import Any

import torch

from ..tree import DraftTree, from_paths
from .base import DraftContext, DraftRequest, Drafter


def continuation(tokens: list[int], start: int, depth: int) -> list[int]:
    """The ``depth`` tokens predicted if the text goes on as it did from ``start``.

    A match close to the end runs into the text being predicted: with period ``p = len(tokens) - start``
    the prediction repeats itself (a model stuck in a loop keeps looping), so a recent match still
    drafts ``depth`` tokens.
    """
    period = len(tokens) - start
    out = tokens[start:start + depth]
    while len(out) < depth:
        out.append(out[len(out) - period])
    return out


def find_continuations(tokens: torch.Tensor, ngram: int, depth: int, limit: int) -> list[list[int]]:
    """Up to ``limit`` distinct continuations (most recent first) of earlier matches of the last ``ngram`` tokens."""
    n = tokens.numel()
    if n <= ngram:
        return []
    suffix = tokens[-ngram:]
    windows = tokens[:-1].unfold(0, ngram, 1)  # (n - ngram, ngram): every earlier window but the suffix itself
    starts = (windows == suffix).all(dim=1).nonzero().flatten().flip(0) + ngram
    found: list[list[int]] = []
    seq = tokens.tolist()
    for s in starts.tolist():
        cont = continuation(seq, s, depth)
        if cont and cont not in found:
            found.append(cont)
            if len(found) == limit:
                break
    return found


def longest_match(tokens: torch.Tensor, max_ngram: int, min_ngram: int, depth: int, limit: int) -> list[list[int]]:
    """The continuations (``find_continuations``) of the longest n-gram, ``max_ngram`` down to ``min_ngram`` tokens,
    that occurred before; none when not even ``min_ngram`` tokens did."""
    for ngram in range(max_ngram, min_ngram - 1, -1):
        conts = find_continuations(tokens, ngram, depth, limit)
        if conts:
            return conts
    return []


class PromptLookupDrafter(Drafter):
    """N-gram matching against the context (longest n-gram first)."""

    name = "prompt-lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, candidates: int = 3) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram, self.min_ngram, self.candidates = max_ngram, min_ngram, candidates

    def propose(self, state: Any, ctx: DraftContext, req: DraftRequest) -> tuple[DraftTree, Any]:
        """Trie of the continuations of the longest n-gram that has earlier matches."""
        # the most recent continuation first: it is the one kept whole when the tree is full
        conts = longest_match(ctx.tokens, self.max_ngram, self.min_ngram, req.max_depth, self.candidates)
        return from_paths(int(ctx.tokens[-1]), conts, req.max_nodes), state
