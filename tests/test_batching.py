"""Continuous batching: every request of a batch gets exactly the tokens it gets decoded alone.

Requests of different lengths join and leave mid-way (more requests than rows), one stops at an EOS inside an
accepted draft, others hit their token limit while the rest go on; rows are checked for alignment directly (a
row's logits in a batched pass equal its logits in a pass of its own, also after another row's release moved it);
sampling per row keeps the target's distribution; a cancelled request frees its row; the budget stops drafting
where the measured cost says it cannot pay.
"""

from __future__ import annotations

import time

import pytest
import torch

from conftest import (ALPHA, SAMPLING, SAMPLING_PROMPT, SAMPLING_VOCAB, chi_square_pvalue, exact_joint, perturb,
                      tiny_model)
from selfspec.target import row_attention
from selfspec.target import RowPass
from selfspec.batching import BatchEngine
from selfspec.budget import Budget
from selfspec.target.common import bucket_for
from selfspec.target.cost import PassCost
from selfspec.drafters.draft_model import DraftModelDrafter
from selfspec.drafters.lookup_first import LookupFirstDrafter
from selfspec.drafters.prompt_lookup import PromptLookupDrafter
from selfspec.engine import DecodeConfig, SpeculativeEngine
from selfspec.errors import SelfspecError
from selfspec.heads import init_heads, make_drafter
from selfspec.tree import DraftTree, chain

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 64
LENGTHS = (3, 40, 1, 300, 12, 90, 7)  # prompt lengths: 300 is cached in two chunks
NEW = (30, 10, 45, 20, 5, 25, 35)  # max new tokens: rows leave at different steps


def ids(seed: int, n: int) -> list[int]:
    """``n`` random token ids."""
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def make(drafter: str, model: torch.nn.Module, seed: int):
    if drafter == "none":
        return None
    if drafter == "lookup":
        return PromptLookupDrafter()
    if drafter == "eagle+lookup":
        return LookupFirstDrafter(make("eagle", model, seed))
    if drafter == "draft-model":  # chains
        return DraftModelDrafter(tiny_model(seed + 50, vocab=VOCAB))
    hyper = {"eagle": {"top_k": 4, "draft_vocab_size": VOCAB}, "eagle3": {"top_k": 4, "draft_vocab_size": 32},
             "medusa": {}}[drafter]  # trees, heads
    return make_drafter(perturb(init_heads(drafter, model, **hyper), seed, 0.3), model)


def requests(seed: int) -> list[tuple[list[int], DecodeConfig]]:
    out = []
    for i, (n, new) in enumerate(zip(LENGTHS, NEW)):
        prompt = ids(seed * 10 + i, n)
        if i % 2:  # repeated n-grams: prompt lookup finds drafts
            prompt = (prompt[:6] * (n // 6 + 1))[:n]
        out.append((prompt, DecodeConfig(max_new_tokens=new, max_depth=5, max_nodes=32, adaptive=i % 3 == 0)))
    return out


def solo(model, drafter, prompt, cfg, exact=True) -> list[int]:
    return SpeculativeEngine(model, drafter, backend=RowPass(model, 1, 512, exact=exact)).generate(prompt, cfg).tokens


@pytest.mark.parametrize("drafter", ["none", "lookup", "draft-model", "eagle", "medusa"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_every_row_equals_its_request_decoded_alone(arch: str, drafter: str) -> None:
    model = tiny_model(3, vocab=VOCAB, arch=arch)
    d = make(drafter, model, 3)
    reqs = requests(3)
    alone = [solo(model, d, p, c) for p, c in reqs]
    static = [SpeculativeEngine(model, d, backend="static").generate(p, c).tokens for p, c in reqs]
    assert alone == static  # the batch pass on one row is today's static pass
    batch = BatchEngine(model, d, max_batch=3, context=512)
    results = batch.generate_batch([p for p, _ in reqs], reqs[0][1])  # one config for all: below, each its own
    assert [r.tokens for r in results] == [solo(model, d, p, reqs[0][1]) for p, _ in reqs]
    batch = BatchEngine(model, d, max_batch=3, context=512)
    handles = [batch.add(p, c) for p, c in reqs]
    got = {id(h): [] for h in handles}
    sizes = set()
    while batch.busy:
        for req, new in batch.step():
            got[id(req)] += new
        sizes.add(batch.last_step.rows)
    assert [got[id(h)] for h in handles] == alone
    assert sizes >= {1, 2, 3}  # rows joined and left mid-way
    assert batch.target.free == 3 and not batch.target.claimed


@pytest.mark.parametrize("arch,drafter", [("llama", "eagle"), ("qwen2", "eagle"), ("llama", "eagle3"),
                                          ("qwen2", "eagle+lookup")])
def test_heads_draft_every_rows_chain_at_once_and_rows_still_equal_their_request_alone(arch: str, drafter: str,
                                                                                      monkeypatch) -> None:
    """In a batch, heads draft a chain for every row together (``propose_chains``, one head pass per depth),
    each row as deep as it may go (rows near their token limit less deep), behind prompt lookup where the context
    repeats; outputs equal each request alone."""
    model = tiny_model(4, vocab=VOCAB, arch=arch)
    d = make(drafter, model, 4)
    cfgs = [DecodeConfig(max_new_tokens=n, max_depth=5, max_nodes=32) for n in (30, 3, 45, 20, 12)]
    prompts = [ids(40 + i, n) for i, n in enumerate((3, 40, 1, 70, 12))]
    prompts[3] = (prompts[3][:7] * 10)[:70]  # repeats itself: lookup finds chains
    batch = BatchEngine(model, d, max_batch=3, context=512)
    monkeypatch.setattr(batch.budget, "depth", lambda rows, shape, chains=False: 3)  # drafting always pays
    drafts = []

    def recorded(self, states, ctxs, depths):
        trees, catch_up_s = chains(self, states, ctxs, depths)
        drafts.append([(depth, tree.max_depth, tree.source) for depth, tree in zip(depths, trees)])
        return trees, catch_up_s
    chains = type(d).propose_chains
    monkeypatch.setattr(type(d), "propose_chains", recorded)
    handles = [batch.add(p, c) for p, c in zip(prompts, cfgs)]
    got = {id(h): [] for h in handles}
    while batch.busy:
        for req, new in batch.step():
            got[id(req)] += new
    assert [got[id(h)] for h in handles] == [solo(model, d, p, c) for p, c in zip(prompts, cfgs)]
    rows = [row for step in drafts for row in step]
    assert len(drafts) > 5 and all(len(step) >= 2 for step in drafts)
    assert {depth for depth, _, _ in rows} >= {1, 2, 3} and all(got <= asked for asked, got, _ in rows)
    assert sum(got < asked for asked, got, _ in rows) <= 1  # the one-token prompt's first step: no pair fed yet
    sources = {source for _, _, source in rows}
    assert sources == ({"eagle3"} if drafter == "eagle3" else {"eagle", "prompt-lookup"} if "lookup" in drafter
                       else {"eagle"})


def test_a_batch_prices_drafting_without_its_catch_up(monkeypatch) -> None:
    """Feeding what was queued before a batch drafts (a prompt, the pairs committed while it did not draft) is a
    one-off: the drafting cost per depth that rows record, and the budget then prices, leaves it out. (With it, a
    slow first draft kept a 4-row SmolLM2 batch at depth 0 for 92 of 95 steps.)"""
    model = tiny_model(4, vocab=VOCAB)
    d = make("eagle", model, 4)
    batch = BatchEngine(model, d, max_batch=4, context=512)
    monkeypatch.setattr(batch.budget, "depth", lambda rows, shape, chains=False: 2)
    feed, chains, fed = type(d)._feed_rows, type(d).propose_chains, []

    def slow_feed(self, *args):
        time.sleep(0.3)
        return feed(self, *args)

    def recorded(self, *args):
        trees, catch_up_s = chains(self, *args)
        fed.append(catch_up_s)
        return trees, catch_up_s
    monkeypatch.setattr(type(d), "_feed_rows", slow_feed)
    monkeypatch.setattr(type(d), "propose_chains", recorded)
    handles = [batch.add(ids(50 + i, 20), DecodeConfig(max_new_tokens=12, max_depth=3)) for i in range(3)]
    while batch.busy:
        batch.step()
        for h in handles:
            if h.record.draft_per_depth is not None:
                assert h.record.draft_per_depth < 0.02  # every draft fed its queue slowly; none of it counted
    assert all(h.record.draft_per_depth is not None for h in handles) and max(fed) >= 0.3


@pytest.mark.parametrize("exact", [True, False])
def test_rows_are_aligned_in_a_batched_pass(exact: bool) -> None:
    """Each row's logits in one pass over rows of different lengths and trees equal its logits in a pass of its
    own (bit for bit on the exact pass), also for a row moved to another row of the cache by a release."""
    model = tiny_model(5, vocab=VOCAB)
    target = RowPass(model, 4, 256, exact=exact)
    prompts = [ids(i, n) for i, n in enumerate((9, 31, 2, 17))]
    slots = []
    for p in prompts:
        slot = target.new_cache(len(p) + 8)
        target.prefill(slot, torch.tensor(p[:-1]))
        slots.append(slot)
    trees = [chain(prompts[0][-1], [1, 2, 3]), DraftTree(torch.tensor([prompts[1][-1], 4, 5, 6]), [-1, 0, 0, 1]),
             chain(prompts[2][-1], []), chain(prompts[3][-1], [7])]

    def alone(i):
        own = RowPass(model, 1, 256, exact=exact)
        slot = own.new_cache(len(prompts[i]) + 8)
        own.prefill(slot, torch.tensor(prompts[i][:-1]))
        return own.verify(slot, trees[i], slot.length).logits

    def same(a, b):
        return torch.equal(a, b) if exact else torch.allclose(a, b, atol=1e-5, rtol=1e-4)

    refs = [alone(i) for i in range(4)]
    vers = target.verify_batch(list(zip(slots, trees)))
    assert all(same(v.logits, r) for v, r in zip(vers, refs))
    assert not same(vers[0].logits[:1], refs[1][:1])  # the check can fail: rows differ
    target.release(slots[0])  # the last row (prompt 3) moves into row 0, its entries copied
    assert slots[3].row == 0 and slots[0].row == -1
    vers = target.verify_batch([(slots[3], trees[3]), (slots[1], trees[1])])
    assert same(vers[0].logits, refs[3]) and same(vers[1].logits, refs[1])
    with pytest.raises(SelfspecError, match="released"):
        target.verify(slots[0], trees[0], 8)


def test_rows_of_one_key_width_are_made_adjacent_and_stay_aligned(monkeypatch) -> None:
    """The exact pass through torch's attention kernel (where the row attention kernel is not built) gives a pass's
    requests rows 0..n-1, longest first, when rows of one key width are not adjacent (their attention then reads the
    cache in place): every request's entries move with it, including a claimed row that is not in the pass (a
    request still joining), and each row's logits still equal its pass alone."""
    monkeypatch.setattr(row_attention, "kernel", lambda: None)
    model = tiny_model(5, vocab=VOCAB)
    target = RowPass(model, 5, 256, exact=True)
    lengths = (41, 6, 71, 11, 100)  # key widths 64, 32, 96, 32 (not adjacent), then one left out of the first pass
    prompts = [ids(20 + i, n) for i, n in enumerate(lengths)]
    slots = []
    for p in prompts:
        slot = target.new_cache(len(p) + 8)
        target.prefill(slot, torch.tensor(p[:-1]))
        slots.append(slot)
    trees = [chain(prompts[0][-1], [1, 2]), DraftTree(torch.tensor([prompts[1][-1], 4, 5]), [-1, 0, 0]),
             chain(prompts[2][-1], []), chain(prompts[3][-1], [7]), chain(prompts[4][-1], [3])]

    def alone(i):
        own = RowPass(model, 1, 256, exact=True)
        slot = own.new_cache(len(prompts[i]) + 8)
        own.prefill(slot, torch.tensor(prompts[i][:-1]))
        return own.verify(slot, trees[i], slot.length).logits

    refs = [alone(i) for i in range(5)]
    vers = target.verify_batch(list(zip(slots[:4], trees[:4])))
    assert [s.row for s in slots] == [1, 3, 0, 2, 4]  # longest first; the one left out after them
    assert [target.claimed[r] for r in range(5)] == [slots[2], slots[0], slots[3], slots[1], slots[4]]
    assert all(torch.equal(v.logits, r) for v, r in zip(vers, refs))
    vers = target.verify_batch([(slots[4], trees[4]), (slots[1], trees[1])])  # rows 4 and 3 -> 0 and 1
    assert [slots[4].row, slots[1].row] == [0, 1]
    assert torch.equal(vers[0].logits, refs[4]) and torch.equal(vers[1].logits, refs[1])
    target.release(slots[2])
    vers = target.verify_batch(list(zip(slots[:2], trees[:2])) + [(slots[3], trees[3])])
    assert all(torch.equal(v.logits, refs[i]) for v, i in zip(vers, (0, 1, 3)))


def test_eos_inside_an_accepted_draft_ends_that_row_only() -> None:
    model = tiny_model(7, vocab=VOCAB)
    d = DraftModelDrafter(model)  # the target drafting for itself: every draft is accepted
    prompts = [ids(i, 6 + i) for i in range(3)]
    plain = [solo(model, None, p, DecodeConfig(max_new_tokens=30)) for p in prompts]
    eos = plain[1][7]  # row 1 stops at its 8th token (or its first occurrence), inside a depth-6 chain
    cfgs = [DecodeConfig(max_new_tokens=30, max_depth=6, adaptive=False, eos_token_ids=(eos,) if i == 1 else ())
            for i in range(3)]
    batch = BatchEngine(model, d, max_batch=3, context=128)
    results = [batch.add(p, c) for p, c in zip(prompts, cfgs)]
    got = {id(r): [] for r in results}
    while batch.busy:
        for req, new in batch.step():
            got[id(req)] += new
    assert got[id(results[1])] == plain[1][:plain[1].index(eos) + 1]
    assert got[id(results[0])] == plain[0] and got[id(results[2])] == plain[2]
    assert max(results[1].stats.tokens_per_step) > 1  # it ended inside a multi-token step


def test_a_cancelled_request_frees_its_row_at_the_next_step() -> None:
    model = tiny_model(8, vocab=VOCAB)
    batch = BatchEngine(model, PromptLookupDrafter(), max_batch=2, context=128)
    a, b, c = (batch.add(ids(i, 5), DecodeConfig(max_new_tokens=40)) for i in range(3))
    for _ in range(3):
        batch.step()
    assert batch.running == [a, b] and batch.waiting == [c]
    batch.cancel(a)
    stepped = batch.step()
    assert a not in [r for r, _ in stepped] and batch.running == [b, c]
    assert a.stats.total_s > 0 and len(a.generated) < 40
    rest = {id(b): list(b.generated), id(c): list(c.generated)}
    while batch.busy:
        for req, new in batch.step():
            rest[id(req)] += new
    assert rest[id(c)] == solo(model, PromptLookupDrafter(), ids(2, 5), DecodeConfig(max_new_tokens=40))


def test_a_finished_request_keeps_its_tokens_and_stats_not_its_tensors() -> None:
    """A caller may keep finished requests (a data generator keeps thousands): each lets go of its last pass, whose
    logits are a view into the whole batch's, and of its drafting context and drafter state."""
    model = tiny_model(8, vocab=VOCAB)
    batch = BatchEngine(model, make("eagle", model, 1), max_batch=2, context=128)
    done = [batch.add(ids(i, 5 + i), DecodeConfig(max_new_tokens=12)) for i in range(3)]
    while batch.busy:
        batch.step()
    for req in done:
        assert req.finished and req.generated and req.stats.target_forwards > 0
        held = [v for v in vars(req).values() if isinstance(v, torch.Tensor) and v is not req.ids]
        assert held == [] and req._last is None and req.ctx is None and req.dstate is None


def test_rejection_sampling_per_row_keeps_the_distribution() -> None:
    model = tiny_model(11, vocab=SAMPLING_VOCAB, hidden=16)
    drafter = DraftModelDrafter(tiny_model(12, vocab=SAMPLING_VOCAB, hidden=16))
    batch = BatchEngine(model, drafter, max_batch=8, context=64)
    seeds = torch.randint(0, 2**62, (1200,), generator=torch.Generator().manual_seed(99)).tolist()
    cfgs = [DecodeConfig(max_new_tokens=2, sampling=SAMPLING, max_depth=2, adaptive=False, seed=s) for s in seeds]
    reqs = [batch.add(SAMPLING_PROMPT, c) for c in cfgs]
    while batch.busy:
        batch.step()
    pairs = [tuple(r.generated[:2]) for r in reqs]
    assert chi_square_pvalue(pairs, exact_joint(model)) > ALPHA


class Row:
    """A stand-in request for the budget: its drafter, depth limit and acceptance record."""

    def __init__(self, alpha: float) -> None:
        from selfspec.adaptive import AdaptiveDepth

        self.drafter, self.max_depth = PromptLookupDrafter(), 8
        self.record = AdaptiveDepth(8)
        for _ in range(40):  # accepted to depth 8 with probability alpha per depth
            accepted = next((d for d in range(8) if torch.rand(1).item() >= alpha), 8)  # the path stops at a miss
            self.record.record_speculative(8, 9, accepted, 0.0)


def buckets16(rows: int, nodes: int) -> tuple[int, int]:
    """A pass shape that pads trees to 1, 2, 4, 8 or 16 nodes."""
    return rows, bucket_for(nodes, (1, 2, 4, 8, 16))


def measured(times: dict[tuple[int, int], float]) -> PassCost:
    cost = PassCost(buckets16)
    for (rows, nodes), seconds in times.items():
        cost.record(rows, nodes, seconds)
    return cost


def test_the_budget_drafts_only_where_the_measured_cost_pays() -> None:
    torch.manual_seed(0)
    rows = [Row(0.7) for _ in range(8)]
    flat = Budget(measured({(8, n): 1.0 + 0.001 * n for n in (1, 2, 4, 8, 16)}))
    assert flat.depth(rows) >= 4  # extra nodes almost free: draft deep
    linear = Budget(measured({(8, n): float(n) for n in (1, 2, 4, 8, 16)}))
    assert linear.depth(rows) == 0  # every node costs a whole pass: plain batched decoding
    unmeasured = Budget(PassCost(buckets16))
    assert unmeasured.depth(rows) == 0  # nothing measured: a plain pass first
    unmeasured.cost.record(8, 1, 1.0)
    assert unmeasured.depth(rows) > 0  # then larger passes are guessed cheap, tried, and measured
    unmeasured.cost.record(8, 2, 2.0)
    unmeasured.cost.record(1, 32, 4.0)
    assert unmeasured.depth(rows) == 0  # measured: extra tokens cost as much as the pass itself
    compute_bound = Budget(PassCost(buckets16, curve={1: 1.0, 8: 1.1, 16: 2.2, 32: 4.4, 64: 8.8}))
    assert compute_bound.depth(rows[:1]) > 0  # alone: extra tokens nearly free (1 -> 8 tokens: +10%)
    compute_bound.cost.record(8, 1, 1.1)
    assert compute_bound.depth(rows) == 0  # 8 rows: the same curve says every extra token costs its share


def test_pass_cost_estimates_a_shape_from_its_plain_pass_and_the_token_curve() -> None:
    cost = PassCost(runs={(4, 1): [1.5]}, curve={4: 1.0, 8: 1.2, 16: 2.0})
    assert cost.seconds(4, 1) == 1.5
    assert cost.seconds(4, 2) == pytest.approx(1.5 + 0.2)  # 4 rows' own plain pass + 4 -> 8 tokens on the curve
    assert cost.seconds(4, 3) == pytest.approx(1.5 + 0.2 + 1.2 * 0.08 * 4 / 8)  # 12: 8 + the prior slope (< the line)
    cost.prior_slope = 1.0
    assert cost.seconds(4, 3) == pytest.approx(1.5 + 0.6)  # with a steep prior: the line between 8 and 16
    assert cost.along(32) == pytest.approx(2.0 + 16 * 0.1)  # past the largest: the slope of the last two
    assert cost.seconds(2, 1) == pytest.approx(0.5)  # no plain pass of 2 rows: the curve, below its smallest size
    assert PassCost().seconds(4, 1) is None


def test_pass_cost_is_asked_by_rows_and_nodes_and_kept_by_the_shape_run() -> None:
    """One bucket function: a 5-node tree is priced as the 8-node pass it runs as, and a request alone reads the
    same measurements a batch of one would (a pass of one row)."""
    cost = PassCost(buckets16)
    cost.record(1, 1, 1.0)
    cost.record(1, 8, 1.6)
    assert cost.seconds(1, 5) == cost.seconds(1, 8) == 1.6 and cost.passes(1, 6) == 1
    assert cost.ratio(1, 5) == pytest.approx(1.6)


def test_calibration_measures_every_pass_size_the_budget_needs() -> None:
    batch = BatchEngine(tiny_model(2, vocab=VOCAB), PromptLookupDrafter(), max_batch=4, context=512)
    times = batch.calibrate(reps=1)
    assert set(times) >= {2, 4, 8, 16, 32, 64} and all(t > 0 for t in times.values())
    assert batch.target.free == 4  # every row given back
    reqs = requests(1)[:2]
    assert [r.tokens for r in batch.generate_batch([p for p, _ in reqs], reqs[0][1])] == \
        [solo(batch.model, batch.drafter, p, reqs[0][1]) for p, _ in reqs]


def test_requests_that_cannot_fit_are_refused_in_one_line() -> None:
    model = tiny_model(1, vocab=VOCAB)
    batch = BatchEngine(model, None, max_batch=2, context=64)
    with pytest.raises(SelfspecError, match="positions per request"):
        batch.add(ids(0, 60), DecodeConfig(max_new_tokens=10))
    with pytest.raises(SelfspecError, match="lower --max-batch"):
        RowPass(model, 64, 4096, memory_bytes=2**20)
    with pytest.raises(SelfspecError, match="exceeds the 1,024 the model reads"):
        BatchEngine(model, None, context=2048)
