"""How deep a batch's rows draft each step, from what passes cost on this machine.

A pass reads the weights once for all its rows. At batch 1 a pass over 16 tokens costs little more than over 1
(decoding is memory-bound), so drafting pays; as the batch grows the pass turns compute-bound and every rejected
draft token costs real time. ``Budget`` keeps the measured time of a pass by its shape (``PassCost``: rows, nodes
per row) and picks, each step, the draft depth k with the most expected committed tokens per second over the
whole batch:

    goodput(k) = sum_r E_r(k) / (T(rows x nodes(k)) + sum_r draft_r * k)

E_r(k) (1 + the drafts row r is expected to get accepted, from its own acceptance record, ``AdaptiveDepth``),
T the time of such a pass on this machine (``PassCost``: measured by shape, unmeasured shapes estimated from the
batch size's own plain pass and the cost of extra tokens on a curve of time by tokens, from a calibration at start
and every pass since), draft_r the row's measured drafting time per depth. k = 0 is
plain batched decoding, with no drafter on the path at all; it wins once extra tokens cost more than they are
expected to commit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .adaptive import ema


@dataclass
class PassCost:
    """Seconds a target pass takes by its shape (rows, nodes per row, padding included), as measured here (running
    averages). A shape not measured yet costs its rows' plain pass plus what its extra tokens cost on the curve of
    time by tokens (``curve``: every pass, of any shape, and the start-up calibration), so the marginal cost of
    tokens learnt at one batch size serves the others, while each batch size keeps its own per-row overheads."""

    prior_slope: float = 0.08  # with a single size on the curve: this much of it per extra token, over its tokens
    times: dict[tuple[int, int], float] = field(default_factory=dict)
    curve: dict[int, float] = field(default_factory=dict)

    def record(self, rows: int, nodes: int, seconds: float) -> None:
        """A pass over ``rows`` rows of ``nodes`` nodes each took ``seconds``."""
        self.times[rows, nodes] = ema(self.times.get((rows, nodes)), seconds, 0.3)
        self.curve[rows * nodes] = ema(self.curve.get(rows * nodes), seconds, 0.3)

    def seconds(self, rows: int, nodes: int) -> float | None:
        """Measured or estimated time of a (rows, nodes) pass; None before any pass was measured."""
        if (rows, nodes) in self.times:
            return self.times[rows, nodes]
        base = self.times.get((rows, 1))
        if base is None:
            return self.along(rows * nodes)
        extra = self.along(rows * nodes) - self.along(rows)
        return base + max(extra, 0.0)

    def along(self, tokens: int) -> float | None:
        """The curve at ``tokens``: between two measured sizes the line between them; past the largest the slope of
        the last two (never negative); below the smallest, proportionally."""
        if tokens in self.curve or not self.curve:
            return self.curve.get(tokens)
        sizes = sorted(self.curve)
        below = [n for n in sizes if n < tokens]
        above = [n for n in sizes if n > tokens]
        if below and above:
            lo, hi = below[-1], above[0]
            return self.curve[lo] + (self.curve[hi] - self.curve[lo]) * (tokens - lo) / (hi - lo)
        if above:
            return self.curve[above[0]] * tokens / above[0]
        top = below[-1]
        slope = self._slope(below[-2], top) if len(below) > 1 else self.prior_slope * self.curve[top] / top
        return self.curve[top] + slope * (tokens - top)

    def _slope(self, a: int, b: int) -> float:
        return max(self.curve[b] - self.curve[a], 0.0) / (b - a)


@dataclass
class Budget:
    """Chooses each step's draft depth for a batch (``depth``) and what a tree costs in it (``node_cost``)."""

    buckets: tuple[int, ...]  # node counts a pass pads a row's tree to
    cost: PassCost = field(default_factory=PassCost)

    def bucket(self, nodes: float) -> int:
        """The node bucket a tree of ``nodes`` nodes runs at."""
        return next((b for b in (1, *self.buckets) if b >= nodes), self.buckets[-1])

    def depth(self, rows: list, shape=lambda rows, nodes: (rows, nodes), chains: bool = False) -> int:
        """The draft depth with the best expected goodput for ``rows`` (``Request``s); 0: a plain batched step.
        ``shape(rows, nodes)``: the (rows, nodes) a pass over that many rows, trees of ``nodes``, really runs;
        ``chains``: every row drafts a chain (k + 1 nodes at depth k), not a tree of its own record's size."""
        n = len(rows)
        plain = self.cost.seconds(*shape(n, 1))
        deepest = max(row.max_depth for row in rows)
        if plain is None or deepest == 0 or rows[0].drafter is None:
            return 0  # measure a plain pass first
        ctrls = [row.record for row in rows]  # each request's acceptance, whichever of its sources drafted
        gains = [_cumulative(c.alphas(row.max_depth)) for c, row in zip(ctrls, rows)]  # [k]: tokens at depth k
        best_k, best = 0, n / plain
        for k in range(1, deepest + 1):
            depths = [min(k, row.max_depth) for row in rows]
            nodes = max(d + 1 if chains else c.expected_nodes(d) for c, d in zip(ctrls, depths))
            seconds = self.cost.seconds(*shape(n, self.bucket(nodes)))
            drafting = sum((c.draft_per_depth or 0.0) * d for c, d in zip(ctrls, depths))
            rate = sum(g[d] for g, d in zip(gains, depths)) / (seconds + drafting)
            if rate > best:
                best_k, best = k, rate
        return best_k

    def node_cost(self, rows: int, shape=lambda rows, nodes: (rows, nodes)):
        """What a row's n-node tree costs in a pass of ``rows`` rows, in plain passes (for drafters that size trees)."""
        def ratio(nodes: float) -> float:
            plain = self.cost.seconds(*shape(rows, 1))
            seconds = self.cost.seconds(*shape(rows, self.bucket(nodes)))
            return 1.0 if not plain or seconds is None else seconds / plain
        return ratio

    def record(self, rows: int, nodes: int, seconds: float) -> None:
        """A pass over ``rows`` rows of ``nodes`` nodes each (padding included) took ``seconds``."""
        self.cost.record(rows, nodes, seconds)


def _cumulative(alphas: list[float]) -> list[float]:
    """[k]: expected tokens a step drafting to depth k commits (1 + the chance each depth up to k is accepted)."""
    out, run = [1.0], 1.0
    for a in alphas:
        run *= a
        out.append(out[-1] + run)
    return out
