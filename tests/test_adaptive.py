"""The adaptive depth controller on synthetic timings: it drafts deep when drafts are accepted and
switches speculation off (with occasional probes) when they are not."""

from __future__ import annotations

import math

from selfspec.adaptive import AdaptiveDepth, DepthPolicy, tree_size_by_cost
from selfspec.target.common import bucket_for
from selfspec.target.cost import PassCost


def step(ctrl, k: int, nodes: int, accepted: int, draft_s: float, seconds: float) -> None:
    """A speculative step: the controller records the acceptance, the engine what the pass cost."""
    ctrl.record_speculative(k, nodes, accepted, draft_s)
    ctrl.cost.record(1, nodes, seconds)


def _run(accept_prob: float, steps: int = 200, slope: float = 0.1, draft_cost: float = 0.05) -> list[int]:
    ctrl = AdaptiveDepth(max_depth=6)
    chosen = []
    for i in range(steps):
        k = ctrl.choose()
        chosen.append(k)
        if k == 0:
            ctrl.cost.record(1, 1, 1.0)
            continue
        # deterministic acceptance: accept_prob of the way down, rounded
        accepted = min(k, int(accept_prob * 10)) if accept_prob > 0 else 0
        step(ctrl, k, k + 1, accepted, draft_cost * k, 1.0 + slope * k)
    return chosen


def test_first_steps_are_plain_to_measure_cost() -> None:
    assert _run(0.9, steps=3)[:2] == [0, 0]


def test_one_slow_plain_step_does_not_make_drafts_look_cheap() -> None:
    """A hiccup on the first plain step (5x the true 1.0 s) must not set the yardstick: a tree that
    costs 3x a plain pass and gains 1.4 tokens loses, and the controller must find that out."""
    cost = PassCost()
    for seconds in (5.0, 1.0, 1.1):
        cost.record(1, 1, seconds)
    assert cost.seconds(1, 1) == 1.1  # lower median, not the mean (2.37) nor the first sample
    ctrl = AdaptiveDepth(max_depth=3)
    ctrl.cost.record(1, 1, 5.0)
    chosen = []
    for i in range(100):
        k = ctrl.choose()
        chosen.append(k)
        if k == 0:
            ctrl.cost.record(1, 1, 1.0)
        else:
            step(ctrl, k, 16, 1 if i % 5 < 2 else 0, 0.0, 3.0)
    assert chosen[-30:].count(0) >= 25


def test_useless_drafts_switch_speculation_off() -> None:
    chosen = _run(0.0)
    spec = sum(k > 0 for k in chosen)
    assert spec < 20  # probes only, with a growing back-off
    assert chosen[-30:].count(0) >= 25


def test_good_drafts_draft_deep() -> None:
    chosen = _run(0.9)
    assert all(k >= 4 for k in chosen[20:])


def test_disabled_controller_always_drafts_max_depth() -> None:
    ctrl = AdaptiveDepth(max_depth=5, enabled=False)
    assert [ctrl.choose() for _ in range(3)] == [5, 5, 5]


def test_expected_rate_matches_formula() -> None:
    cost = PassCost(runs={(1, 1): [2.0], (1, 3): [4.0]})
    ctrl = AdaptiveDepth(max_depth=3, prior_weight=0.0, cost=cost, draft_per_depth=0.1, nodes_at={2: 3.0})
    ctrl.hits, ctrl.tries = [1.0, 1.0], [2.0, 2.0]  # alpha = 0.5 at depths 1 and 2
    # E(2) = 1 + 0.5 + 0.25; C(2) = t1 * ratio(3 nodes) + 0.1 * 2
    assert abs(ctrl.expected_rate(2) - 1.75 / 4.2) < 1e-12
    assert ctrl.expected_rate(0) == 0.5


def test_pass_cost_uses_measured_sizes_and_puts_the_others_on_the_curve() -> None:
    cost = PassCost(prior_slope=0.1)
    assert cost.ratio(1, 9) is None  # nothing measured: nothing to divide by (the controller steps plain first)
    cost.record(1, 1, 0.5)
    assert cost.seconds(1, 1) == 0.5
    assert abs(cost.ratio(1, 9) - 1.8) < 1e-12  # one size on the curve: 1 + 0.1 per extra node, to be tried
    cost.record(1, 4, 1.0)  # 2x a plain pass
    cost.record(1, 5, 1.5)  # 3x
    cost.record(1, 16, 2.0)  # 4x
    assert cost.ratio(1, 1) == 1.0 and cost.ratio(1, 4) == 2.0 and cost.ratio(1, 16) == 4.0
    assert abs(cost.ratio(1, 4.5) - 2.5) < 1e-12  # an average between two measured sizes
    assert abs(cost.ratio(1, 2) - 1.1) < 1e-12  # unmeasured: 1 node's cost + 0.1 per node, to be tried
    assert abs(cost.ratio(1, 8) - 1.5 * (1 + 0.1 * 3 / 5) / 0.5) < 1e-12  # 5 nodes + the prior (below the line)
    assert abs(cost.ratio(1, 20) - (2.0 + 4 * 0.5 / 11) / 0.5) < 1e-12  # past the largest: the last two's slope


def test_mid_size_trees_that_cost_more_than_a_slope_predicts_are_avoided() -> None:
    """Verify cost as measured on a CPU: 2 nodes cheap, 3 or more about twice a plain pass. Depth 1 is
    always accepted, depth 2 four times in five: a 2-node chain gives 2 / 1.05 tokens per plain-pass
    time, a 3-node one 2.8 / 2.0. One slope fitted to the larger trees (0.3-0.5 per node) would rate
    them 2.8 / 1.6-2.0 against 2 / 1.3-1.5 and keep drafting to depth 2."""
    costs = {2: 1.05, 3: 2.0, 4: 2.1, 5: 2.2}
    ctrl = AdaptiveDepth(max_depth=4)
    for i in range(200):
        k = ctrl.choose()
        if k == 0:
            ctrl.cost.record(1, 1, 1.0)
            continue
        accepted = min(k, 2 if i % 5 < 4 else 1)
        step(ctrl, k, k + 1, accepted, 0.0, costs[k + 1])
    assert ctrl.cost.ratio(1, 2) == 1.05
    assert [ctrl.choose() for _ in range(20)] == [1] * 20


def test_policy_judges_each_source_on_its_own_record() -> None:
    """Drafts from a source that always misses switch that source off, not another that keeps hitting."""
    policy = DepthPolicy(max_depth=4)
    assert policy.choose("heads") == 0  # first steps plain, to measure t1
    policy.cost.record(1, 1, 1.0)
    policy.cost.record(1, 1, 1.0)
    for _ in range(60):
        for source, accepted in (("heads", 0), ("lookup", None)):
            k = policy.choose(source)
            if k:
                policy.record_speculative(source, k, k + 1, k if accepted is None else accepted, 0.0)
                policy.cost.record(1, k + 1, 1.0 + 0.1 * k)
            else:
                policy.cost.record(1, 1, 1.0)
    assert [policy.choose("heads") for _ in range(10)].count(0) >= 8
    assert policy.choose("lookup") == 4


def test_a_new_source_starts_from_the_measured_plain_steps() -> None:
    policy = DepthPolicy(max_depth=3)
    policy.cost.record(1, 1, 2.0)
    policy.cost.record(1, 1, 2.0)
    assert policy.controller("new").t1 == 2.0 and policy.choose("new") > 0  # no extra plain step to measure


def test_rate_ranks_sources_by_their_record_without_changing_it() -> None:
    policy = DepthPolicy(max_depth=4)
    policy.cost.record(1, 1, 1.0)
    policy.cost.record(1, 1, 1.0)
    for _ in range(10):
        for depth, seconds in ((4, 2.0), (1, 1.1)):  # every depth it could choose has a record
            policy.record_speculative("good", depth, depth + 1, depth, 0.0)
            policy.record_speculative("bad", depth, depth + 1, 0, 0.0)
            policy.cost.record(1, depth + 1, seconds)
    before = (policy.controller("bad").plain_left, policy.controller("bad").backoff)
    assert policy.rate("good") > 1.0 > policy.rate("bad")  # 1.0: plain decoding's tokens/s here
    assert (policy.controller("bad").plain_left, policy.controller("bad").backoff) == before


def test_tree_size_by_cost_keeps_nodes_while_they_pay() -> None:
    """Path probabilities 0.9, 0.6, 0.3, 0.05: flat verification keeps all, a steep cost only the first ones."""
    probs = [0.9, 0.6, 0.3, 0.05]
    assert tree_size_by_cost(probs, lambda n: 1.0) == 4  # free nodes: verify every one
    assert tree_size_by_cost(probs, lambda n: 1.0 + 0.3 * (n - 1)) == 2  # 2.5/1.6 beats 1.9/1.3 and 2.8/1.9
    assert tree_size_by_cost(probs, lambda n: 1.0 + 2.0 * (n - 1)) == 0  # nothing pays: a plain step
    assert tree_size_by_cost([], lambda n: 1.0) == 0


def test_the_cost_of_a_bucketed_pass_is_its_buckets() -> None:
    """A pass that pads 5..16 nodes to 16: one measurement prices the whole bucket; past the largest size measured
    the guess follows the measured (flat) line."""
    cost = PassCost(lambda rows, nodes: (rows, bucket_for(nodes, (1, 4, 16, 64))), prior_slope=0.1)
    cost.record(1, 1, 1.0)
    cost.record(1, 16, 1.2)  # what the pass ran: 9 nodes padded to 16
    assert cost.ratio(1, 5) == cost.ratio(1, 9) == cost.ratio(1, 16) == 1.2
    assert abs(cost.ratio(1, 64) - (1.2 + 48 * 0.2 / 15)) < 1e-12  # slope 0.2 / 15 per node, not 0.1
    assert cost.seconds(1, 65) == cost.ratio(1, 65) == cost.ratio(1, 64.5) == math.inf  # more than a pass runs
    assert tree_size_by_cost([0.99] * 80, lambda n: cost.ratio(1, n)) == 63  # a drafter asking past it: cut there


def test_depths_whose_trees_would_outgrow_the_largest_bucket_are_priced_out() -> None:
    """Trees that branched (3 nodes at depth 1) make deeper drafts look wider than any pass runs: the controller
    prices those depths out instead of failing (a bench of eagle+lookup at --max-nodes 64 once stopped there)."""
    cost = PassCost(lambda rows, nodes: (rows, bucket_for(nodes, (1, 2, 4))))
    for nodes, seconds in ((1, 1.0), (1, 1.0), (2, 1.05), (4, 1.1)):
        cost.record(1, nodes, seconds)
    ctrl = AdaptiveDepth(max_depth=3, cost=cost, nodes_at={1: 3.0, 2: 5.0, 3: 9.0})
    assert ctrl.expected_rate(2) == ctrl.expected_rate(3) == 0.0
    assert ctrl.choose() == 1
