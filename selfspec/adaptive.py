"""Adaptive draft depth: draft as deep as pays on this model and this hardware, or not at all.

The controller keeps running estimates of
  * t1: the time of one plain step (a one-token target pass),
  * the verify cost by tree size (``VerifyCost``): what a pass over n nodes costs, in plain passes,
    measured for each size that has been verified. On a CPU it is far from linear (Qwen2.5-1.5B, fp32,
    2 cores: 2 nodes 1.09x, 4 nodes 2.11x, 16 nodes 3.48x), so one slope would overrate mid-size trees;
  * the drafting time per depth, and the nodes a depth-k draft holds (trees branch),
  * alpha_d: P(depth d accepted | depth d-1 accepted).
For depth k the expected gain is E(k) = 1 + sum_{d<=k} prod_{j<=d} alpha_j tokens per pass, at cost
C(k) = t1 * ratio(nodes(k)) + draft_per_depth * k. It picks the k with the best E/C, and
when even that is below plain decoding's 1 / t1 it turns speculation off, probing again after a
back-off that doubles while speculation keeps losing. The first steps are plain, to measure t1.

``DepthPolicy`` keeps one controller per draft *source*: a drafter made of several (prompt lookup
in front of heads) has each judged on its own record, so weak heads switching themselves off do not
also silence free lookup drafts that the target keeps accepting. The verify cost is the target's, the
same whoever drafted, so the sources share one ``VerifyCost``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field


def ema(old: float | None, new: float, w: float = 0.2) -> float:
    return new if old is None else (1 - w) * old + w * new


@dataclass
class VerifyCost:
    """What a verification pass costs by tree size, in plain (one-token) passes, as measured here.

    ``t1``, the plain-step time, is the lower median of the last ``window`` plain steps. On a shared
    machine noise only ever slows a pass, and one slow step taken as the norm would make every draft
    look cheap: speculation would then run on and never step plain again to correct it. The controller
    waits for ``min_plain`` plain steps before its first draft.
    ``ratios[n]`` is a running average of (time of an n-node pass) / t1 for each size n verified so
    far (1 node costs 1.0). A size not measured yet is guessed optimistically, so that it gets tried
    and measured: the nearest measured smaller size plus ``prior_slope`` per extra node (a pass never
    costs less for more nodes), but no more than the nearest measured larger size.
    """

    prior_slope: float = 0.08
    window: int = 8
    min_plain: int = 2
    buckets: tuple[int, ...] | None = None  # a static target pass pads n nodes to its bucket: n costs the bucket
    plain: list[float] = field(default_factory=list)  # the last ``window`` plain-step times
    ratios: dict[int, float] = field(default_factory=dict)

    def _size(self, nodes: int) -> int:
        """The size a pass over ``nodes`` nodes really runs at (its bucket, on a static pass)."""
        if self.buckets is None or nodes > self.buckets[-1]:
            return nodes
        return next(b for b in self.buckets if b >= nodes)

    @property
    def t1(self) -> float | None:
        """The plain-step time (None before any plain step)."""
        return sorted(self.plain)[(len(self.plain) - 1) // 2] if self.plain else None

    @property
    def ready(self) -> bool:
        """Enough plain steps timed to judge drafts against."""
        return len(self.plain) >= self.min_plain

    def record_plain(self, seconds: float) -> None:
        """A one-token target pass took ``seconds``."""
        self.plain = (self.plain + [seconds])[-self.window:]

    def record(self, nodes: int, seconds: float) -> None:
        """A pass over ``nodes`` nodes (root included) took ``seconds``."""
        if self.t1 and nodes > 1:
            size = self._size(nodes)
            self.ratios[size] = ema(self.ratios.get(size), seconds / self.t1)

    def _measured(self, n: int) -> float | None:
        return 1.0 if n <= 1 else self.ratios.get(self._size(n))

    def slope(self, nodes: float) -> float:
        """Extra cost per node guessed for an unmeasured size: ``prior_slope``, or past the largest size
        measured the line from a plain step through it where that is flatter (where verification is flat,
        as in bf16 on a CPU with native bf16 or on a GPU, 32- and 64-node trees then look cheap enough to try)."""
        if not self.ratios or nodes < max(self.ratios):
            return self.prior_slope
        n = max(self.ratios)
        return min(self.prior_slope, max(self.ratios[n] - 1.0, 0.0) / (n - 1))

    def ratio(self, nodes: float) -> float:
        """Predicted cost of a ``nodes``-node pass relative to a plain pass (a fractional size, an
        average, lies between its two neighbours)."""
        lo, hi = math.floor(nodes), math.ceil(nodes)
        r_lo, r_hi = self._measured(lo), self._measured(hi)
        if r_lo is not None and r_hi is not None:
            return r_lo + (nodes - lo) * (r_hi - r_lo)
        below = max(n for n in (1, *self.ratios) if n <= nodes)
        guess = self._measured(below) + self.slope(nodes) * (nodes - below)
        above = [n for n in self.ratios if n >= nodes]
        return min(guess, self.ratios[min(above)]) if above else guess


def tree_size_by_cost(path_probs: list[float], node_cost: Callable[[float], float]) -> int:
    """How many ranked draft nodes to verify: the count m with the most expected tokens per unit of cost.

    ``path_probs[i]``: the drafter's probability that its i-th best node (each after its parent) is
    accepted, i.e. its whole path is; verifying the first m commits 1 + sum(path_probs[:m]) tokens in
    expectation (EAGLE-2), at ``node_cost(1 + m)`` plain passes. 0 means a plain step pays best.
    """
    best_m, best_rate, gain = 0, 1.0 / node_cost(1), 1.0
    for m, p in enumerate(path_probs, start=1):
        gain += p
        rate = gain / node_cost(1 + m)
        if rate > best_rate:
            best_m, best_rate = m, rate
    return best_m


@dataclass
class AdaptiveDepth:
    """Chooses the draft depth for the next step (0 = plain step) from measured acceptance and cost."""

    max_depth: int
    enabled: bool = True  # False: always draft max_depth (for tests and ablations)
    prior_alpha: float = 0.6
    prior_weight: float = 2.0
    decay: float = 0.95
    cost: VerifyCost = field(default_factory=VerifyCost)
    draft_per_depth: float | None = None
    nodes_per_depth: float = 1.0  # before depth k was drafted, a depth-k draft is guessed to hold 1 + k * this
    nodes_at: dict[int, float] = field(default_factory=dict)  # depth -> nodes its drafts held (running average)
    hits: list[float] = field(default_factory=list)
    tries: list[float] = field(default_factory=list)
    backoff: int = 4
    plain_left: int = 0

    def alphas(self, k: int) -> list[float]:
        """Smoothed acceptance rates at depths 1..k.

        The prior of depth d is depth d-1's estimate (acceptance changes slowly with depth), so depths
        not tried yet look as good as the deepest one measured and get explored.
        """
        out, prior = [], self.prior_alpha
        for d in range(k):
            h = self.hits[d] if d < len(self.hits) else 0.0
            n = self.tries[d] if d < len(self.tries) else 0.0
            prior = (h + prior * self.prior_weight) / (n + self.prior_weight)
            out.append(prior)
        return out

    @property
    def t1(self) -> float | None:
        """The plain-step time measured so far."""
        return self.cost.t1

    def expected_nodes(self, k: int) -> float:
        """Nodes (root included) a depth-k draft is expected to hold."""
        return self.nodes_at.get(k, 1 + self.nodes_per_depth * k)

    def expected_tokens(self, k: int) -> float:
        """Tokens a step drafting to depth k is expected to commit: 1 + sum over d <= k of P(depth d accepted)."""
        gain, run = 1.0, 1.0
        for a in self.alphas(k):
            run *= a
            gain += run
        return gain

    def expected_rate(self, k: int) -> float:
        """Predicted tokens per second when drafting to depth k (k = 0: plain decoding)."""
        t1 = self.t1 or 1.0
        if k == 0:
            return 1.0 / t1
        cost = t1 * self.cost.ratio(self.expected_nodes(k)) + (self.draft_per_depth or 0.0) * k
        return self.expected_tokens(k) / cost

    def choose(self) -> int:
        """Depth to draft next step; 0 means a plain step."""
        if not self.enabled or self.max_depth == 0:
            return self.max_depth
        if not self.cost.ready:
            return 0
        best = max(range(1, self.max_depth + 1), key=self.expected_rate)
        if self.expected_rate(best) > self.expected_rate(0):
            self.backoff = 4
            return best
        if self.plain_left > 0:
            self.plain_left -= 1
            return 0
        self.plain_left = self.backoff  # probe once now, then stay plain a while
        self.backoff = min(self.backoff * 2, 64)
        return best

    def record_plain(self, seconds: float) -> None:
        """A one-token target pass took ``seconds``."""
        self.cost.record_plain(seconds)

    def record_speculative(self, depth: int, nodes: int, accepted: int, draft_s: float, verify_s: float) -> None:
        """A pass verified ``nodes`` nodes (root included) of a depth-``depth`` draft and kept ``accepted``."""
        while len(self.hits) < depth:
            self.hits.append(0.0)
            self.tries.append(0.0)
        self.hits = [h * self.decay for h in self.hits]
        self.tries = [n * self.decay for n in self.tries]
        for d in range(min(accepted + 1, depth)):
            self.tries[d] += 1
            if d < accepted:
                self.hits[d] += 1
        self.draft_per_depth = ema(self.draft_per_depth, draft_s / depth)
        self.nodes_per_depth = ema(self.nodes_per_depth, (nodes - 1) / depth)
        self.nodes_at[depth] = ema(self.nodes_at.get(depth), nodes)
        self.cost.record(nodes, verify_s)


@dataclass
class DepthPolicy:
    """One ``AdaptiveDepth`` per draft source, all sharing one ``VerifyCost`` (a plain step and an
    n-node pass cost the same whoever drafted)."""

    max_depth: int
    enabled: bool = True
    cost: VerifyCost = field(default_factory=VerifyCost)
    sources: dict[str, AdaptiveDepth] = field(default_factory=dict)

    def controller(self, source: str) -> AdaptiveDepth:
        """The source's controller; a new one starts from the costs measured so far."""
        if source not in self.sources:
            self.sources[source] = AdaptiveDepth(self.max_depth, enabled=self.enabled, cost=self.cost)
        return self.sources[source]

    def choose(self, source: str) -> int:
        """Depth ``source`` may draft to this step (0: it should not draft)."""
        return self.controller(source).choose()

    def rate(self, source: str) -> float:
        """Expected tokens/s of ``source`` at its best depth, from its record (no side effects)."""
        ctrl = self.controller(source)
        return max((ctrl.expected_rate(k) for k in range(1, ctrl.max_depth + 1)), default=0.0)

    def record_plain(self, seconds: float) -> None:
        self.cost.record_plain(seconds)

    def record_speculative(self, source: str, depth: int, nodes: int, accepted: int, draft_s: float,
                           verify_s: float) -> None:
        self.controller(source).record_speculative(depth, nodes, accepted, draft_s, verify_s)
