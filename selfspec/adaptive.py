"""Adaptive draft depth: draft as deep as pays on this model and this hardware, or not at all.

The controller reads, from its request's ``PassCost`` (``selfspec/target/cost.py``, the one cost model for a
request alone and for a batch, by the shape passes run), t1, the time of a plain step, and what a one-row pass
over n nodes costs in plain passes, measured for each size verified (on a CPU far from linear: Qwen2.5-1.5B,
fp32, 2 cores: 2 nodes 1.09x, 4 nodes 2.11x, 16 nodes 3.48x, so one slope would overrate mid-size trees), and keeps
its own running estimates of
  * the drafting time per depth, and the nodes a depth-k draft holds (trees branch),
  * alpha_d: P(depth d accepted | depth d-1 accepted).
For depth k the expected gain is E(k) = 1 + sum_{d<=k} prod_{j<=d} alpha_j tokens per pass, at cost
C(k) = t1 * ratio(nodes(k)) + draft_per_depth * k. It picks the k with the best E/C, and
when even that is below plain decoding's 1 / t1 it turns speculation off, probing again after a
back-off that doubles while speculation keeps losing. The first steps are plain, to measure t1.

``DepthPolicy`` keeps one controller per draft *source*: a drafter made of several (prompt lookup
in front of heads) has each judged on its own record, so weak heads switching themselves off do not
also silence free lookup drafts that the target keeps accepting. The pass cost is the target's, the
same whoever drafted, so the sources share one ``PassCost``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .target.cost import PassCost, ema

MIN_PLAIN = 2  # plain steps timed before the first draft is judged against them


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
    cost: PassCost = field(default_factory=PassCost)  # the request's: what its one-row passes cost here
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
        return self.cost.seconds(1, 1)

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
        cost = t1 * (self.cost.ratio(1, self.expected_nodes(k)) or 1.0) + (self.draft_per_depth or 0.0) * k
        return self.expected_tokens(k) / cost

    def choose(self) -> int:
        """Depth to draft next step; 0 means a plain step."""
        if not self.enabled or self.max_depth == 0:
            return self.max_depth
        if self.cost.passes(1, 1) < MIN_PLAIN:
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

    def record_speculative(self, depth: int, nodes: int, accepted: int, draft_s: float) -> None:
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


@dataclass
class DepthPolicy:
    """One ``AdaptiveDepth`` per draft source, all reading one ``PassCost`` (a plain step and an n-node pass cost the
    same whoever drafted)."""

    max_depth: int
    enabled: bool = True
    cost: PassCost = field(default_factory=PassCost)
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

    def record_speculative(self, source: str, depth: int, nodes: int, accepted: int, draft_s: float) -> None:
        self.controller(source).record_speculative(depth, nodes, accepted, draft_s)

    def node_cost(self, nodes: float) -> float:
        """What a one-row pass over ``nodes`` nodes costs in plain passes (1 before anything was measured)."""
        return self.cost.ratio(1, nodes) or 1.0
