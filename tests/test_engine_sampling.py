"""Speculative sampling keeps the target's distribution exactly.

On a tiny model with an 8-token vocabulary the exact distribution of the first two generated tokens
is computable, so a chi-square goodness-of-fit test (fixed seeds, significance 0.001) checks that
speculative sampling with chain and tree drafts draws from it, and that a lossy rule (rejection with
a draft probability other than the one the draft was really drawn from) is caught by the same test.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chi2

from conftest import tiny_model
from selfspec.drafters.base import DraftContext, DraftRequest, Drafter
from selfspec.drafters.draft_model import DraftModelDrafter
from selfspec.engine import DecodeConfig, SpeculativeEngine
from selfspec.sampling import SamplingConfig, logits_to_probs
from selfspec.tree import DraftTree

VOCAB = 8
PROMPT = [1, 5, 2, 7, 3]
SAMPLING = SamplingConfig(temperature=1.0, top_k=6)
ALPHA = 0.001
N = 1500


class SampledTreeDrafter(Drafter):
    """Samples ``width`` root children without replacement from a draft model's q, then one child each.

    ``honest=False`` reports a uniform q instead of the q it sampled from: the rejection rule then
    accepts with the wrong ratio p/q, which biases the output.
    """

    name = "sampled-tree"

    def __init__(self, model: torch.nn.Module, width: int = 3, honest: bool = True) -> None:
        self.model, self.width, self.honest = model, width, honest

    def _q(self, seq: list[int], req: DraftRequest) -> torch.Tensor:
        with torch.no_grad():
            return logits_to_probs(self.model(torch.tensor([seq])).logits[0, -1], req.sampling)

    def propose(self, state, ctx: DraftContext, req: DraftRequest):
        seq = ctx.tokens.tolist()
        q_root = self._q(seq, req)
        kids = torch.multinomial(q_root, self.width, replacement=False, generator=req.generator).tolist()
        tokens, parents, rows = [seq[-1]], [-1], [q_root]
        for k in kids:
            tokens.append(k), parents.append(0), rows.append(None)
        if req.max_depth >= 2:
            for i, k in enumerate(kids, start=1):
                q = self._q(seq + [k], req)
                rows[i] = q
                tokens.append(int(torch.multinomial(q, 1, generator=req.generator)))
                parents.append(i)
                rows.append(None)
        rows = [torch.zeros(VOCAB) if r is None else r for r in rows]
        probs = torch.stack(rows) if self.honest else torch.full((len(rows), VOCAB), 1.0 / VOCAB)
        return DraftTree(torch.tensor(tokens), parents, probs), state


def exact_joint(model: torch.nn.Module) -> torch.Tensor:
    """P(x1, x2 | PROMPT) under SAMPLING, shape (V, V)."""
    with torch.no_grad():
        p1 = logits_to_probs(model(torch.tensor([PROMPT])).logits[0, -1], SAMPLING)
        seqs = torch.tensor([PROMPT + [x] for x in range(VOCAB)])
        p2 = logits_to_probs(model(seqs).logits[:, -1], SAMPLING)
    return p1[:, None] * p2


def chi_square_pvalue(samples: list[tuple[int, int]], probs: torch.Tensor) -> float:
    """Goodness of fit of the sampled pairs to ``probs``; cells expected below 5 are pooled."""
    counts = torch.zeros_like(probs)
    for a, b in samples:
        counts[a, b] += 1
    expected = probs.flatten() * len(samples)
    observed = counts.flatten()
    big = expected >= 5
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    obs = torch.cat([observed[big], observed[~big].sum()[None]])
    if exp[-1] == 0:
        exp, obs = exp[:-1], obs[:-1]
    stat = float(((obs - exp) ** 2 / exp).sum())
    return float(chi2.sf(stat, df=len(exp) - 1))


def draw(engine: SpeculativeEngine, max_depth: int) -> list[tuple[int, int]]:
    out = []
    # well-spread seeds: mt19937 seeded with consecutive small integers gives correlated first draws
    seeds = torch.randint(0, 2**62, (N,), generator=torch.Generator().manual_seed(1234)).tolist()
    for seed in seeds:
        cfg = DecodeConfig(max_new_tokens=2, sampling=SAMPLING, max_depth=max_depth, adaptive=False, seed=seed)
        toks = engine.generate(PROMPT, cfg).tokens
        out.append((toks[0], toks[1]))
    return out


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    return tiny_model(11, vocab=VOCAB, hidden=16)


@pytest.fixture(scope="module")
def draft() -> torch.nn.Module:
    return tiny_model(12, vocab=VOCAB, hidden=16, layers=1)


def test_plain_sampling_fits_exact_distribution(target) -> None:
    assert chi_square_pvalue(draw(SpeculativeEngine(target), 0), exact_joint(target)) > ALPHA


def test_chain_speculative_sampling_is_lossless(target, draft) -> None:
    engine = SpeculativeEngine(target, DraftModelDrafter(draft))
    assert chi_square_pvalue(draw(engine, 1), exact_joint(target)) > ALPHA


def test_chain_sampling_with_reduced_draft_vocabulary_is_lossless(target, draft) -> None:
    engine = SpeculativeEngine(target, DraftModelDrafter(draft, draft_vocab=torch.arange(0, VOCAB, 2)))
    assert chi_square_pvalue(draw(engine, 1), exact_joint(target)) > ALPHA


@pytest.mark.parametrize("backend", ["eager", "static", "compiled"])
def test_tree_speculative_sampling_is_lossless(target, draft, backend: str) -> None:
    engine = SpeculativeEngine(target, SampledTreeDrafter(draft), backend=backend)
    assert chi_square_pvalue(draw(engine, 1), exact_joint(target)) > ALPHA


def test_lossy_rule_is_detected(target, draft) -> None:
    """A misreported draft distribution biases the output: the same test must reject it."""
    engine = SpeculativeEngine(target, SampledTreeDrafter(draft, honest=False))
    assert chi_square_pvalue(draw(engine, 1), exact_joint(target)) < ALPHA
