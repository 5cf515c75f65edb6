"""How deep a batch's rows draft each step, from what passes cost on this machine.

A pass reads the weights once for all its rows. At batch 1 a pass over 16 tokens costs little more than over 1
(decoding is memory-bound), so drafting pays; as the batch grows the pass turns compute-bound and every rejected
draft token costs real time. ``Budget`` keeps the measured time of a pass by its shape (``PassCost``: rows, nodes
per row) and picks, each step, the draft depth k with the most expected committed tokens per second over the
whole batch:

    goodput(k) = sum_r E_r(k) / (T(rows x nodes(k)) + sum_r draft_r * k)

E_r(k) (1 + the drafts row r is expected to get accepted, from its own acceptance record, ``AdaptiveDepth``),
T the time of a pass over that many tokens on this machine (``PassCost``: one curve for every batch size, from
a calibration at start and every pass since), draft_r the row's measured drafting time per depth. k = 0 is
plain batched decoding, with no drafter on the path at all; it wins once extra tokens cost more than they are
expected to commit.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def _ema(old: float | None, new: float, w: float = 0.3) -> float:
    return new if old is None else (1 - w) * old + w * new


@dataclass
class PassCost:
    """Seconds a target pass takes by the tokens it runs (rows x nodes per row, padding included), as measured here
    (running averages): the linears' work grows with the tokens whichever row they belong to, so one curve serves
    every batch size. Between two measured sizes a pass costs what the line between them says; past the largest,
    the slope of the last two (a pass never costs less for more tokens); with one size measured, ``prior_slope``
    of it per extra token relative to its own tokens (optimistic: an unmeasured size gets tried once, then known)."""

    prior_slope: float = 0.08
    times: dict[int, float] = field(default_factory=dict)

    def record(self, tokens: int, seconds: float) -> None:
        """A pass over ``tokens`` tokens took ``seconds``."""
        self.times[tokens] = _ema(self.times.get(tokens), seconds)

    def seconds(self, tokens: int) -> float | None:
        """Measured or estimated time of a pass over ``tokens`` tokens; None before any pass was measured."""
        if tokens in self.times or not self.times:
            return self.times.get(tokens)
        sizes = sorted(self.times)
        below = [n for n in sizes if n < tokens]
        above = [n for n in sizes if n > tokens]
        if below and above:
            lo, hi = below[-1], above[0]
            return self.times[lo] + (self.times[hi] - self.times[lo]) * (tokens - lo) / (hi - lo)
        if above:
            return self.times[above[0]] * tokens / above[0] if len(above) == 1 else \
                self.times[above[0]] - self._slope(above[0], above[1]) * (above[0] - tokens)
        top = below[-1]
        slope = self._slope(below[-2], top) if len(below) > 1 else self.prior_slope * self.times[top] / top
        return self.times[top] + slope * (tokens - top)

    def _slope(self, a: int, b: int) -> float:
        return max(self.times[b] - self.times[a], 0.0) / (b - a)


@dataclass
class Budget:
    """Chooses each step's draft depth for a batch (``depth``) and what a tree costs in it (``node_cost``)."""

    buckets: tuple[int, ...]  # node counts a pass pads a row's tree to
    cost: PassCost = field(default_factory=PassCost)

    def bucket(self, nodes: float) -> int:
        """The node bucket a tree of ``nodes`` nodes runs at."""
        return next((b for b in (1, *self.buckets) if b >= nodes), self.buckets[-1])

    def depth(self, rows: list, tokens=lambda rows, nodes: rows * nodes) -> int:
        """The draft depth with the best expected goodput for ``rows`` (``Request``s); 0: a plain batched step.
        ``tokens(rows, nodes)``: what a pass over that many rows, each padded to ``nodes``, really runs."""
        n = len(rows)
        plain = self.cost.seconds(tokens(n, 1))
        deepest = max(row.max_depth for row in rows)
        if plain is None or deepest == 0 or rows[0].drafter is None:
            return 0  # measure a plain pass first
        ctrls = [_controller(row) for row in rows]
        gains = [_cumulative(c.alphas(row.max_depth)) for c, row in zip(ctrls, rows)]  # [k]: tokens at depth k
        best_k, best = 0, n / plain
        for k in range(1, deepest + 1):
            depths = [min(k, row.max_depth) for row in rows]
            nodes = max(c.expected_nodes(d) for c, d in zip(ctrls, depths))
            seconds = self.cost.seconds(tokens(n, self.bucket(nodes)))
            drafting = sum((c.draft_per_depth or 0.0) * d for c, d in zip(ctrls, depths))
            rate = sum(g[d] for g, d in zip(gains, depths)) / (seconds + drafting)
            if rate > best:
                best_k, best = k, rate
        return best_k

    def node_cost(self, rows: int, tokens=lambda rows, nodes: rows * nodes):
        """What a row's n-node tree costs in a pass of ``rows`` rows, in plain passes (for drafters that size trees)."""
        def ratio(nodes: float) -> float:
            plain = self.cost.seconds(tokens(rows, 1))
            seconds = self.cost.seconds(tokens(rows, self.bucket(nodes)))
            return 1.0 if not plain or seconds is None else seconds / plain
        return ratio

    def record(self, tokens: int, seconds: float) -> None:
        """A pass over ``tokens`` tokens (padding included) took ``seconds``."""
        self.cost.record(tokens, seconds)


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
