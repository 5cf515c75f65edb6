"""Draft trees: the candidate tokens a drafter proposes, and the attention mask that verifies them.

A tree is stored flat, in topological order. Node 0 is the *root*: the last committed token, which
the target has not processed yet. Every other node is a drafted token whose parent comes before it.
A chain (classic speculative decoding) is the tree where each node's parent is the previous node.

                 root(0)
                /      \\
            "the"(1)   "a"(2)        tokens  = [root, the, a, cat]
              |                      parents = [-1,   0,   0,  1 ]
            "cat"(3)                 depth   = [0,    1,   1,  2 ]
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class DraftTree:
    """Candidate tokens to verify in one target pass.

    ``draft_probs[i]`` (optional) is the drafter's distribution q that node i's children were
    *sampled* from, in child order and without replacement. ``None`` means the children were chosen
    deterministically (top-k, n-gram lookup); acceptance then treats each child as a point mass.
    """

    tokens: torch.Tensor  # (N,) long, node 0 = root
    parents: list[int]  # (N,) parent index, -1 for the root
    draft_probs: torch.Tensor | None = None  # (N, V) float or None
    source: str = ""  # which drafter made it (composite drafters mix sources; acceptance is tracked per source)
    depth: list[int] = field(init=False)
    children: list[list[int]] = field(init=False)

    def __post_init__(self) -> None:
        if self.tokens.dim() != 1 or len(self.parents) != self.tokens.numel() or self.parents[0] != -1:
            raise ValueError("a draft tree needs 1-D tokens, one parent per node and the root (parent -1) first")
        self.depth = [0] * len(self.parents)
        self.children = [[] for _ in self.parents]
        for i, p in enumerate(self.parents[1:], start=1):
            if not 0 <= p < i:
                raise ValueError(f"node {i} has parent {p}: parents must come earlier in the order")
            self.depth[i] = self.depth[p] + 1
            self.children[p].append(i)

    @property
    def size(self) -> int:
        """Number of nodes, root included."""
        return len(self.parents)

    @property
    def max_depth(self) -> int:
        """Depth of the deepest drafted token (0 for a root-only tree: plain decoding)."""
        return max(self.depth)

    @property
    def is_chain(self) -> bool:
        """True when node i's parent is i-1 for every node: ordinary causal attention suffices."""
        return all(p == i - 1 for i, p in enumerate(self.parents))


def chain(root: int, drafted: list[int], draft_probs: torch.Tensor | None = None) -> DraftTree:
    """A chain tree: root followed by the drafted tokens in order."""
    tokens = torch.tensor([root, *drafted], dtype=torch.long)
    return DraftTree(tokens, list(range(-1, len(drafted))), draft_probs)


def from_paths(root: int, paths: list[list[int]], max_nodes: int | None = None) -> DraftTree:
    """A deterministic tree (a trie) holding each path of drafted tokens below ``root``; shared prefixes merge.

    With ``max_nodes``, paths are added in order until the tree is full (a path may be cut short).
    """
    tokens, parents, index = [root], [-1], {}
    for path in paths:
        parent = 0
        for tok in path:
            key = (parent, tok)
            if key not in index and max_nodes is not None and len(tokens) >= max_nodes:
                break
            if key not in index:
                index[key] = len(tokens)
                tokens.append(tok)
                parents.append(parent)
            parent = index[key]
    return DraftTree(torch.tensor(tokens, dtype=torch.long), parents)


def tree_attention_mask(tree: DraftTree, cache_len: int, device: torch.device) -> torch.Tensor:
    """Boolean mask (1, 1, N, cache_len + N): each node sees the whole cache, itself and its ancestors."""
    n = tree.size
    own = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(tree.parents):
        own[i, i] = True
        if p >= 0:
            own[i] |= own[p]  # parents come first, so own[p] already holds p's ancestors
    past = torch.ones(n, cache_len, dtype=torch.bool, device=device)  # built on the device: no O(cache) copy
    return torch.cat([past, own.to(device)], dim=1)[None, None]


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True = may attend) as the additive float mask attention kernels expect (0 / dtype min).

    transformers passes a 4-D mask through unchanged; eager attention *adds* it to the scores, so a
    boolean one would mask nothing there.
    """
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


def tree_position_ids(tree: DraftTree, cache_len: int, device: torch.device) -> torch.Tensor:
    """Position of each node: cache length + depth. Shape (1, N)."""
    return (torch.tensor(tree.depth, dtype=torch.long) + cache_len)[None].to(device)
