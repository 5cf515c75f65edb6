"""Acceptance rules: which drafted path the target keeps, and the target's own next token.

Both rules walk the tree from the root. At each node the target's distribution p (from the
verification pass) decides among that node's children; the walk stops at the first node where no
child is kept, and the next token comes from what is left of p there.

* Greedy: keep the child equal to argmax p. Output is exactly the target's greedy output.
* Sampling: recursive rejection sampling over the siblings (Chen et al. 2023 for one child;
  SpecTr / Jeon et al. 2024 for several, drawn without replacement). For each child x, in the order
  it was drafted, with q the drafter's distribution for that draw:
      accept x with probability min(1, p(x) / q(x))          # q >= p: accept; q < p: accept w.p. p/q
      else p <- normalise(max(p - q, 0)),  q <- q without x, renormalised
  If every child is rejected, sample from the final p. The result is distributed exactly as p,
  whatever q is, *provided q is the distribution the child was really drawn from*. A child given
  without q (``draft_probs is None``) is treated as a point mass: accepted with probability p(x),
  else x is removed from p. That is exact for any draft chosen without looking at the target's
  random draws (deterministic or not), only less efficient than using the real q.
"""

from __future__ import annotations

import torch

from .sampling import sample
from .tree import DraftTree


def accept_greedy(tree: DraftTree, target_argmax: list[int]) -> tuple[list[int], int]:
    """Greedy walk. ``target_argmax[i]`` is the target's top token after node i.

    Returns (accepted node indices, root excluded; the target's next token).
    """
    tokens = tree.tokens.tolist()
    path, node = [], 0
    while True:
        want = target_argmax[node]
        nxt = next((c for c in tree.children[node] if tokens[c] == want), None)
        if nxt is None:
            return path, want
        path.append(nxt)
        node = nxt


def _normalise(v: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    total = v.sum()
    return v / total if total > 0 else fallback


def reject_among_children(
    p: torch.Tensor, children: list[int], tokens: list[int], q: torch.Tensor | None, gen: torch.Generator | None
) -> tuple[int | None, torch.Tensor]:
    """Recursive rejection sampling at one node (``p``, ``q``: 1-D float tensors on the CPU).

    Returns (the accepted child, or None; the residual distribution to sample from if None).
    """
    q_left = None if q is None else q.clone()
    p = p.clone()
    for child in children:
        x = tokens[child]
        q_x = 1.0 if q_left is None else float(q_left[x])  # no q: a point mass on x
        if q_x > 0 and torch.rand((), generator=gen).item() * q_x < float(p[x]):
            return child, p
        if q_left is None:  # max(p - onehot(x), 0) is p without x
            p[x] = 0.0
            p = _normalise(p, p)
        else:
            p = _normalise(torch.clamp(p - q_left, min=0.0), p)
            q_left[x] = 0.0
            q_left = _normalise(q_left, q_left)
    return None, p


def accept_sampling(tree: DraftTree, target_probs: torch.Tensor, gen: torch.Generator | None = None
                    ) -> tuple[list[int], int]:
    """Lossless sampling walk. ``target_probs`` is (N, V): the target's distribution after each node.

    Only the rows on the walked path leave the device.
    """
    tokens = tree.tokens.tolist()
    path, node = [], 0
    while True:
        p = target_probs[node].float().cpu()
        q = None if tree.draft_probs is None else tree.draft_probs[node].float().cpu()
        child, residual = reject_among_children(p, tree.children[node], tokens, q, gen)
        if child is None:
            return path, sample(residual, gen)
        path.append(child)
        node = child
