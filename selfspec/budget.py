"""How deep a batch's rows draft each step, from what passes cost on this machine.

A pass reads the weights once for all its rows. At batch 1 a pass over 16 tokens costs little more than over 1
(decoding is memory-bound), so drafting pays; as the batch grows the pass turns compute-bound and every rejected
draft token costs real time. ``Budget`` keeps the measured time of a pass by its shape (``PassCost``: rows, nodes
per row) and picks, each step, the draft depth k with the most expected committed tokens per second over the
whole batch:

    goodput(k) = sum_r E_r(k) / (T(rows, nodes(k)) + sum_r draft_r * k)

E_r(k) (1 + the drafts row r is expected to get accepted, from its own acceptance record, ``AdaptiveDepth``),
T from this machine's passes, draft_r the row's measured drafting time per depth. k = 0 is plain batched
decoding, with no drafter on the path at all; it wins once extra tokens cost more than they are expected to
commit. Shapes not measured yet are guessed optimistically (``prior_slope`` per extra node over the nearest
measured smaller one, never above a measured larger one), so they get tried once and measured.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def _ema(old: float | None, new: float, w: float = 0.3) -> float:
    return new if old is None else (1 - w) * old + w * new


@dataclass
class PassCost:
    """Seconds a batched pass takes by (rows, nodes per row), as measured here (running averages)."""

    prior_slope: float = 0.08  # a guess for an unmeasured shape: this fraction of a plain pass per extra node
    times: dict[tuple[int, int], float] = field(default_factory=dict)

    def record(self, rows: int, nodes: int, seconds: float) -> None:
        """A pass over ``rows`` rows padded to ``nodes`` nodes each took ``seconds``."""
        self.times[rows, nodes] = _ema(self.times.get((rows, nodes)), seconds)

    def seconds(self, rows: int, nodes: int) -> float | None:
        """Measured or guessed time of a (rows, nodes) pass; None until a plain pass of ``rows`` was measured."""
        if (rows, nodes) in self.times:
            return self.times[rows, nodes]
        plain = self.times.get((rows, 1))
        if plain is None:
            return None
        sizes = [n for r, n in self.times if r == rows]
        below = max(n for n in sizes if n <= nodes)
        guess = self.times[rows, below] + self.prior_slope * plain * (nodes - below)
        above = [self.times[rows, n] for n in sizes if n > nodes]
        return min([guess, *above])


@dataclass
class Budget:
    """Chooses each step's draft depth for a batch (``depth``) and what a tree costs in it (``node_cost``)."""

    buckets: tuple[int, ...]  # node counts a pass pads a row's tree to
    cost: PassCost = field(default_factory=PassCost)

    def bucket(self, nodes: float) -> int:
        """The node bucket a tree of ``nodes`` nodes runs at."""
        return next((b for b in (1, *self.buckets) if b >= nodes), self.buckets[-1])

    def depth(self, rows: list) -> int:
        """The draft depth with the best expected goodput for ``rows`` (``Request``s); 0: a plain batched step."""
        n = len(rows)
        plain = self.cost.seconds(n, 1)
        deepest = max(row.max_depth for row in rows)
        if plain is None or deepest == 0 or rows[0].drafter is None:
            return 0  # measure a plain pass of this many rows first
        ctrls = [_controller(row) for row in rows]
        gains = [_cumulative(c.alphas(row.max_depth)) for c, row in zip(ctrls, rows)]  # [k]: tokens at depth k
        best_k, best = 0, n / plain
        for k in range(1, deepest + 1):
            depths = [min(k, row.max_depth) for row in rows]
            nodes = max(c.expected_nodes(d) for c, d in zip(ctrls, depths))
            seconds = self.cost.seconds(n, self.bucket(nodes))
            drafting = sum((c.draft_per_depth or 0.0) * d for c, d in zip(ctrls, depths))
            tokens = sum(g[d] for g, d in zip(gains, depths))
            if tokens / (seconds + drafting) > best:
                best_k, best = k, tokens / (seconds + drafting)
        return best_k

    def node_cost(self, rows: int):
        """What a row's n-node tree costs in a pass of ``rows`` rows, in plain passes (for drafters that size trees)."""
        def ratio(nodes: float) -> float:
            plain = self.cost.seconds(rows, 1)
            seconds = self.cost.seconds(rows, self.bucket(nodes))
            return 1.0 if not plain or seconds is None else seconds / plain
        return ratio

    def record(self, rows: int, nodes: int, seconds: float) -> None:
        """A pass over ``rows`` rows whose largest tree held ``nodes`` nodes took ``seconds``."""
        self.cost.record(rows, self.bucket(nodes), seconds)


def _cumulative(alphas: list[float]) -> list[float]:
    """[k]: expected tokens a step drafting to depth k commits (1 + the chance each depth up to k is accepted)."""
    out, run = [1.0], 1.0
    for a in alphas:
        run *= a
        out.append(out[-1] + run)
    return out


def _controller(row):
    """The row's acceptance record: the controller of the source with the most expected tokens (a row whose
    drafter has not drafted yet starts from the prior)."""
    ctrls = list(row.policy.sources.values()) or [row.policy.controller(row.drafter.name)]
    return max(ctrls, key=lambda c: c.expected_tokens(max(c.max_depth, 1)))
