"""Speculative sampling keeps the target's distribution exactly.

On a tiny model with an 8-token vocabulary the exact distribution of the first two generated tokens
is computable, so a chi-square goodness-of-fit test (fixed seeds, significance 0.001) checks that
speculative sampling with chain and tree drafts draws from it, and that a lossy rule (rejection with
a draft probability other than the one the draft was really drawn from) is caught by the same test.
"""

from __future__ import annotations

import pytest
import torch

from conftest import ALPHA, SAMPLING_VOCAB as VOCAB, chi_square_pvalue, draw, exact_joint, tiny_model
from selfspec.drafters.base import DraftContext, DraftRequest, Drafter
from selfspec.drafters.draft_model import DraftModelDrafter
from selfspec.engine import SpeculativeEngine
from selfspec.sampling import logits_to_probs
from selfspec.tree import DraftTree


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
