"""How deep a batch's rows draft each step, from what passes cost on this machine.

A pass reads the weights once for all its rows. At batch 1 a pass over 16 tokens costs little more than over 1
(decoding is memory-bound), so drafting pays; as the batch grows the pass turns compute-bound and every rejected
draft token costs real time. ``Budget`` keeps the measured time of a pass by its shape (``PassCost``: rows, nodes
per row) and picks, each step, the draft depth k with the most expected committed tokens per second over the
whole batch:

    goodput(k) = sum_r E_r(k) / (T(rows, nodes(k)) + sum_r draft_r * k)

E_r(k) (1 + the drafts row r is expected to get accepted, from its own acceptance record, ``AdaptiveDepth``),
T the time of such a pass on this machine (``PassCost``, ``selfspec/target/cost.py``: the one cost model, a request
alone prices its trees with it too; by the shape the pass runs at, from a calibration at start and every pass since),
draft_r the row's measured drafting time per depth. k = 0 is plain batched decoding, with no drafter on the path at
all; it wins once extra tokens cost more than they are expected to commit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .target.cost import PassCost


@dataclass
class Budget:
    """Chooses each step's draft depth for a batch (``depth``) and what a tree costs in it (``node_cost``), from the
    batch engine's ``cost`` (asked by rows and nodes; it maps them to the shape the pass runs at, the one bucket
    function)."""

    cost: PassCost = field(default_factory=PassCost)

    def depth(self, rows: list, chains: bool = False) -> int:
        """The draft depth with the best expected goodput for ``rows`` (``Request``s); 0: a plain batched step.
        ``chains``: every row drafts a chain (k + 1 nodes at depth k), not a tree of its own record's size."""
        n = len(rows)
        plain = self.cost.seconds(n, 1)
        deepest = max(row.max_depth for row in rows)
        if plain is None or deepest == 0 or rows[0].drafter is None:
            return 0  # measure a plain pass first
        ctrls = [row.record for row in rows]  # each request's acceptance, whichever of its sources drafted
        gains = [_cumulative(c.alphas(row.max_depth)) for c, row in zip(ctrls, rows)]  # [k]: tokens at depth k
        best_k, best = 0, n / plain
        for k in range(1, deepest + 1):
            depths = [min(k, row.max_depth) for row in rows]
            nodes = max(d + 1 if chains else c.expected_nodes(d) for c, d in zip(ctrls, depths))
            seconds = self.cost.seconds(n, math.ceil(nodes))
            drafting = sum((c.draft_per_depth or 0.0) * d for c, d in zip(ctrls, depths))
            rate = sum(g[d] for g, d in zip(gains, depths)) / (seconds + drafting)
            if rate > best:
                best_k, best = k, rate
        return best_k

    def node_cost(self, rows: int):
        """What a row's n-node tree costs in a pass of ``rows`` rows, in plain passes (for drafters that size trees)."""
        return lambda nodes: self.cost.ratio(rows, nodes) or 1.0


def _cumulative(alphas: list[float]) -> list[float]:
    """[k]: expected tokens a step drafting to depth k commits (1 + the chance each depth up to k is accepted)."""
    out, run = [1.0], 1.0
    for a in alphas:
        run *= a
        out.append(out[-1] + run)
    return out
