"""EAGLE-2 dynamic draft trees, for any drafter that can score a batch of tree nodes in one pass.

The root's top-k tokens form depth 1. At each further depth the k frontier nodes with the best
cumulative log-probability are expanded in ONE pass of the drafter (a node at depth d sits at position
``committed + d - 1``; a tree mask lets it see the committed cache, its drafted ancestors and itself), each
adding its top-k children. The best ``budget`` nodes by cumulative log-probability (ancestor-closed) form
the draft. Children are picked deterministically (top-k), so the tree carries no draft probabilities: exact
in sampling mode too (a point mass each), if less accepting than sampled drafts.

The drafter supplies two callables:

    top(outs, k)                        (n, X) outputs -> top-k target token ids and log-probabilities per row
    run(tokens, parent_outs, pos, mask) one pass over the n nodes to expand: their tokens, their parents'
                                        outputs (n, X), positions, a (1, 1, n, cache_len + n) boolean mask
                                        -> (n, X) outputs; it appends the n nodes to its cache(s)

EAGLE heads feed a node's parent's output feature with its token; early exit feeds the token alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..adaptive import tree_size_by_cost
from ..tree import DraftTree


@dataclass
class Candidates:
    """Drafted nodes in creation order (parents before children); parent -1 is the root."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)  # cumulative log-probability of the path

    def add(self, token: int, parent: int, score: float) -> None:
        """Append one node."""
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(1 if parent < 0 else self.depths[parent] + 1)
        self.scores.append(score)

    def ancestors(self, node: int) -> list[int]:
        """Drafted ancestors of ``node`` (root excluded), nearest first."""
        out, p = [], self.parents[node]
        while p >= 0:
            out.append(p)
            p = self.parents[p]
        return out

    def ranked(self, budget: int) -> list[int]:
        """Up to ``budget`` nodes, best score first, each after its parent (every prefix is ancestor-closed)."""
        keep: list[int] = []
        kept: set[int] = set()
        for i in sorted(range(len(self.tokens)), key=lambda i: -self.scores[i]):  # stable: parents win ties
            if len(keep) == budget:
                break
            if self.parents[i] < 0 or self.parents[i] in kept:
                keep.append(i)
                kept.add(i)
        return keep

    def best(self, budget: int) -> list[int]:
        """Up to ``budget`` nodes with the best scores whose parents are kept too, in creation order."""
        return sorted(self.ranked(budget))

    def depth_first(self, nodes: list[int]) -> list[int]:
        """``nodes`` (ancestor-closed) depth first, each node's children best score first: the likeliest path comes
        right after the root, where an exact target pass reads it in place (``selfspec/target/exact.py``)."""
        children: dict[int, list[int]] = {}
        for n in nodes:
            children.setdefault(self.parents[n], []).append(n)
        order, stack = [], sorted(children.get(-1, []), key=lambda n: self.scores[n])
        while stack:
            n = stack.pop()
            order.append(n)
            stack += sorted(children.get(n, []), key=lambda c: self.scores[c])  # the best popped first
        return order

    def to_tree(self, root: int, nodes: list[int]) -> DraftTree:
        """The draft tree of ``nodes`` (ancestor-closed) below ``root``, depth first."""
        nodes = self.depth_first(nodes)
        where = {n: i + 1 for i, n in enumerate(nodes)}
        parents = [-1] + [where.get(self.parents[n], 0) for n in nodes]
        tokens = torch.tensor([root] + [self.tokens[n] for n in nodes], dtype=torch.long)
        return DraftTree(tokens, parents)


def expansion_mask(cand: Candidates, nodes: list[int], slot: dict[int, int], committed: int,
                   cache_len: int, device: torch.device) -> torch.Tensor:
    """(1, 1, n, cache_len + n) boolean: each node sees the committed entries, its drafted ancestors' slots, itself."""
    n = len(nodes)
    mask = torch.zeros(n, cache_len + n, dtype=torch.bool)
    mask[:, :committed] = True
    for i, node in enumerate(nodes):
        mask[i, [slot[a] for a in cand.ancestors(node)]] = True
        mask[i, cache_len + i] = True
    return mask[None, None].to(device)


Top = Callable[[torch.Tensor, int], tuple[list[list[int]], list[list[float]]]]
Run = Callable[[list[int], torch.Tensor, list[int], torch.Tensor], torch.Tensor]


def grow_tree(root_out: torch.Tensor, committed: int, depth: int, budget: int, k: int, top: Top, run: Run
              ) -> Candidates:
    """EAGLE-2 expansion from the root's output, depth by depth, over a cache holding ``committed`` entries;
    the drafter's cache holds the expanded nodes afterwards (the caller crops it back)."""
    cand, out, slot = Candidates(), {-1: root_out}, {}
    toks, scores = top(root_out[None], k)
    for t, s in zip(toks[0], scores[0]):
        cand.add(t, -1, s)
    frontier = list(range(len(cand.tokens)))
    for d in range(1, depth):
        if budget <= d:  # too few nodes left for anything deeper
            break
        expand = sorted(frontier, key=lambda i: -cand.scores[i])[:k]
        cache_len = committed + len(slot)
        mask = expansion_mask(cand, expand, slot, committed, cache_len, root_out.device)
        parents = torch.stack([out[cand.parents[i]] for i in expand])
        outs = run([cand.tokens[i] for i in expand], parents, [committed + d - 1] * len(expand), mask)
        toks, scores = top(outs, k)
        frontier = []
        for j, node in enumerate(expand):
            slot[node], out[node] = cache_len + j, outs[j]
            for t, s in zip(toks[j], scores[j]):
                frontier.append(len(cand.tokens))
                cand.add(t, node, cand.scores[node] + s)
    return cand


def select_tree(cand: Candidates, root: int, budget: int, node_cost: Callable[[float], float] | None) -> DraftTree:
    """The draft: the best ``budget`` nodes (ancestor-closed), cut where the measured verify cost ``node_cost`` says
    more nodes stop paying (EAGLE-2: a node's path probability is its expected acceptance)."""
    ranked = cand.ranked(budget)
    if node_cost is not None:
        ranked = ranked[:tree_size_by_cost([math.exp(cand.scores[i]) for i in ranked], node_cost)]
    return cand.to_tree(root, sorted(ranked))
