"""Was a greedy output that differs from the reference a rounding near-tie, or a bug?

In bf16 (and, far less often, in fp32) a k-token verification pass rounds differently from k
one-token passes, so where the target's top two logits nearly tie, two lossless methods can pick
different tokens: token-identical output alone no longer tells a bug from rounding. The diagnosis
looks at the *first* token where the two outputs differ (after it they continue different
prefixes), recomputes the target's next-token logits for ``prompt + reference[:i]`` in float32, and
calls the difference

* ``near-tie`` when both tokens, the reference's and the other's, lie within the rounding bound of
  the float32 top logit there (so both are among the top few, and when they are the top two their
  gap is within the bound): some rounding of the run's dtype may pick either;
* ``real`` otherwise (a token no rounding would pick, or an output that stops early): a bug.

The rounding bound, measured at the very prefix (not guessed from the dtype alone):

    err   = max |logit_dtype - logit_fp32| over the candidate tokens (the two tokens and the
            float32 top ``ERROR_TOKENS``), with the model in the run's dtype computed two ways: one
            pass over the whole prefix (the prefill / k-token regime) and the last token alone on a
            cache of the rest (the one-token decoding regime);
    bound = max(SAFETY * 2 * err,  eps(dtype) * |top logit|)

``2 * err``: a flip needs the errors on the two tokens to close their gap, and they may have opposite
signs. ``SAFETY``: the divergence happened in a pass we do not replay (a 16-node tree, another cache
length), whose error can exceed the two we measured. ``eps * |top|`` is one or two rounding steps
of the logit itself (the LM head writes logits in the run's dtype: two values closer than that may
round to one and tie), a floor for when the measured error happens to be tiny.

The numbers behind ``SAFETY`` and ``ERROR_TOKENS`` (SmolLM2-135M, bf16, CPU, 6 bench questions x 64
tokens = 390 positions; replayed paths: one pass over the whole sequence, and 1-, 2-, 4-, 8- and
16-token passes on a cache). Top logits there: median 29.5 (9.6 to 45), where a bf16 step is 0.125
and ``eps * |top|`` 0.23. ``err`` over the top 8: median 0.21, max 0.77 logits. Measured on the two
tokens alone ``err`` is a noisy scale: the gap between the top token and the 2nd to 4th moved, in some
replayed path, by up to 19x ``2 * err`` (99th percentile 7.3x); over the top 8 by at most 1.67x
(99th percentile 1.17x; top 16: 1.24x). ``SAFETY = 2`` covers every position seen with room; the bf16
bounds were then median 0.83 logits (10th percentile 0.50, max 3.1). The argmax flipped in 14
(position, path) pairs, all at float32 gaps of 0.017 to 0.14 logits: far inside the bound, while
a wrong token ranked second by several logits, or worse, lies far outside.

In a float32 run the same procedure applies with float32 as "the run's dtype" (the model is its own
float32 copy): the one-pass logits are the truth and ``err`` is what one-token decoding reorders,
6e-6 to 8e-6 on SmolLM2 logits near 20 to 25, so bounds of 2.3e-5 to 3.1e-5. A float32 near-tie is
rare but possible; anything beyond that is real.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, fields

import torch
from torch import nn

from .engine import DecodeConfig, eos_ids
from .target.kv_cache import new_cache
from .memory import model_dtype
from .target.packed_linear import dense_linears
from .verify import forward_with_cache

IDENTICAL, NEAR_TIE, REAL = "identical", "near-tie", "real"
VERDICTS = (IDENTICAL, NEAR_TIE, REAL)
SAFETY = 2.0  # headroom over the measured error for passes not replayed (module docstring)
ERROR_TOKENS = 8  # the float32 top tokens whose error sets the scale, besides the two that differ


@dataclass
class Divergence:
    """The verdict on one output against the reference, and the evidence at the first differing token."""

    verdict: str  # identical | near-tie | real
    index: int | None = None  # first differing position among the new tokens
    reference_token: int | None = None
    other_token: int | None = None  # None: the other output stopped there
    reference_logit: float | None = None  # float32 logits after prompt + reference[:index]
    other_logit: float | None = None
    top_logit: float | None = None  # the float32 maximum there
    other_rank: int | None = None  # 1 = the float32 top token
    gap: float | None = None  # |reference_logit - other_logit|
    bound: float | None = None  # the rounding bound there (module docstring)
    reason: str = ""

    def to_dict(self) -> dict:
        """JSON-ready fields."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Divergence":
        """Inverse of :meth:`to_dict`; unknown keys are ignored."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def first_difference(reference: Sequence[int], other: Sequence[int]) -> int | None:
    """The first index where both outputs have a token and the tokens differ; None if there is none."""
    return next((i for i, (a, b) in enumerate(zip(reference, other)) if a != b), None)


def compare_lengths(reference: Sequence[int], other: Sequence[int], eos_token_ids: Iterable[int] = (),
                    max_new_tokens: int | None = None) -> Divergence:
    """Verdict when one output is a prefix of the other.

    Equal lengths: identical. Otherwise the shorter must have had a reason to stop: its last token is an
    EOS (what follows an EOS is no output) or it holds ``max_new_tokens`` tokens (the longer overran the
    budget). A shorter output with neither stopped early: real, with ``other_token`` None when it is the
    other output that stopped. Without ``max_new_tokens`` a budget stop cannot be recognised.
    """
    if len(reference) == len(other):
        return Divergence(IDENTICAL)
    shorter = min(reference, other, key=len)
    if shorter and shorter[-1] in set(eos_token_ids):
        return Divergence(IDENTICAL, reason=f"agree up to the EOS at token {len(shorter) - 1}")
    if max_new_tokens is not None and len(shorter) >= max_new_tokens:
        return Divergence(IDENTICAL, reason=f"agree on all {max_new_tokens} tokens of the budget")
    i = len(shorter)
    who = "other" if shorter is other else "reference"
    return Divergence(REAL, i, reference[i] if i < len(reference) else None, other[i] if i < len(other) else None,
                      reason=f"the {who} output stopped after {i} tokens, without EOS or reaching the budget")


@torch.no_grad()
def one_pass_logits(model: nn.Module, ids: Sequence[int]) -> torch.Tensor:
    """Next-token logits (V,) in float32 after ``ids``, from one pass over all of them."""
    x = torch.tensor([list(ids)], device=next(model.parameters()).device)
    return model(input_ids=x, logits_to_keep=1).logits[0, -1].float()


@torch.no_grad()
def cached_step_logits(model: nn.Module, ids: Sequence[int]) -> torch.Tensor:
    """The same logits with the last token fed alone on a cache of the others (one-token decoding)."""
    device = next(model.parameters()).device
    x = torch.tensor([list(ids)], device=device)
    n = x.shape[1]
    cache = new_cache(model)
    forward_with_cache(model, x[:, :-1], cache, position_ids=torch.arange(n - 1, device=device)[None],
                       logits_to_keep=1)
    out = forward_with_cache(model, x[:, -1:], cache, position_ids=torch.tensor([[n - 1]], device=device))
    return out.logits[0, -1].float()


def rounding_bound(model: nn.Module, ids: Sequence[int], truth: torch.Tensor, tokens: Sequence[int],
                   safety: float = SAFETY) -> float:
    """How far rounding in ``model``'s dtype can move a logit gap after ``ids`` (module docstring).

    ``truth`` (V,): the float32 logits there; ``tokens``: the candidates whose error is measured.
    """
    idx = torch.tensor(sorted(set(tokens)), device=truth.device)
    paths = [one_pass_logits(model, ids)] + ([cached_step_logits(model, ids)] if len(ids) > 1 else [])
    err = max(float((p.to(truth.device)[idx] - truth[idx]).abs().max()) for p in paths)
    step = torch.finfo(model_dtype(model)).eps * float(truth.max().abs())
    return max(safety * 2 * err, step)


def float32_copy(model: nn.Module) -> nn.Module:
    """``model`` itself when it is float32, else a float32 copy on the same device (weights x 4 bytes)."""
    if model_dtype(model) == torch.float32:
        return model
    with dense_linears(model):  # packed weights are opaque to deepcopy and .to()
        return copy.deepcopy(model).to(torch.float32).eval()


def diagnose_divergence(model: nn.Module, fp32_model: nn.Module, prompt_ids: Sequence[int],
                        reference: Sequence[int], other: Sequence[int], *, eos_token_ids: Iterable[int] = (),
                        max_new_tokens: int | None = None, safety: float = SAFETY) -> Divergence:
    """Diagnose ``other`` (new tokens) against ``reference`` (new tokens) after ``prompt_ids``.

    ``model`` is the target in the run's dtype, ``fp32_model`` the same weights in float32 (``model``
    itself in a float32 run; :func:`float32_copy`). Identical outputs need no model pass.
    """
    i = first_difference(reference, other)
    if i is None:
        return compare_lengths(reference, other, eos_token_ids, max_new_tokens)
    ids = [*prompt_ids, *reference[:i]]
    truth = one_pass_logits(fp32_model, ids)  # (V,)
    a, b = int(reference[i]), int(other[i])
    top = int(truth.argmax())
    candidates = [a, b, *truth.topk(min(ERROR_TOKENS, truth.numel())).indices.tolist()]
    bound = rounding_bound(model, ids, truth, candidates, safety)
    la, lb, lt = float(truth[a]), float(truth[b]), float(truth[top])
    below = lt - min(la, lb)  # how far the weaker of the two lies below the float32 top
    verdict = NEAR_TIE if below <= bound else REAL
    weaker = "other" if lb <= la else "reference"
    reason = (f"both tokens within rounding of the float32 top ({below:.3g} <= bound {bound:.3g})"
              if verdict == NEAR_TIE else f"the {weaker}'s token is the float32 #{rank_of(truth, min(la, lb))}, "
              f"{below:.3g} below the top: beyond rounding (bound {bound:.3g})")
    return Divergence(verdict, i, a, b, la, lb, lt, rank_of(truth, lb), abs(la - lb), bound, reason)


def rank_of(logits: torch.Tensor, value: float) -> int:
    """1 + how many logits exceed ``value`` (1: the top)."""
    return 1 + int((logits > value).sum())


class DivergenceChecker:
    """Diagnoses many outputs of one target; the float32 copy is built once, for the first output that differs."""

    def __init__(self, model: nn.Module, eos_token_ids: Iterable[int] | None = None,
                 max_new_tokens: int | None = None, safety: float = SAFETY) -> None:
        self.model = model.eval()
        self.eos_token_ids = set(eos_ids(model, DecodeConfig()) if eos_token_ids is None else eos_token_ids)
        self.max_new_tokens = max_new_tokens
        self.safety = safety
        self._fp32: nn.Module | None = None

    @property
    def fp32_model(self) -> nn.Module:
        """The float32 target (built on first use)."""
        if self._fp32 is None:
            self._fp32 = float32_copy(self.model)
        return self._fp32

    def diagnose(self, prompt_ids: Sequence[int], reference: Sequence[int], other: Sequence[int]) -> Divergence:
        """:func:`diagnose_divergence` with this checker's model, EOS ids and budget."""
        if first_difference(reference, other) is None:  # no model pass: do not build the copy
            return compare_lengths(reference, other, self.eos_token_ids, self.max_new_tokens)
        return diagnose_divergence(self.model, self.fp32_model, prompt_ids, reference, other,
                                   eos_token_ids=self.eos_token_ids, max_new_tokens=self.max_new_tokens,
                                   safety=self.safety)


def count_verdicts(diagnoses: Iterable[Divergence | str]) -> dict[str, int]:
    """``{verdict: count}`` with every verdict present (others, such as a caller's ``unchecked``, appended)."""
    counts = Counter(d.verdict if isinstance(d, Divergence) else d for d in diagnoses)
    return {**{v: 0 for v in VERDICTS}, **counts}


def format_counts(counts: dict[str, int]) -> str:
    """``"5 identical, 1 near-tie, 0 real"`` (other verdicts appended when present)."""
    extra = [f"{n} {v}" for v, n in counts.items() if v not in VERDICTS and n]
    return ", ".join([f"{counts.get(v, 0)} {v}" for v in VERDICTS] + extra)
