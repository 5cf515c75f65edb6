"""What a target pass costs on this machine, by its shape: one model for a request alone and for a batch.

A pass of ``rows`` rows of trees of ``nodes`` nodes runs at the shape the pass gives it (``pass_shape``: nodes to a
bucket, rows onto the exact pass's row grid), so the cost is kept by the shape a pass really ran (its ``last_shape``)
and asked for by what a step would run (rows, nodes), mapped through the same ``pass_shape``: a request alone is a
pass of one row, and the single-request policy (``adaptive.py``) and the batch budget (``budget.py``) read the same
measurements.

    measured      each shape keeps its last ``window`` times; its cost is their lower median: on a shared machine
                  noise only ever slows a pass, and one slow plain step taken as the norm would make every draft
                  look cheap (speculation would then run on and never step plain again to correct it)
    unmeasured    the rows' own plain pass plus what the extra tokens cost on the curve of time by tokens (every
                  pass, of any shape; ``along``), so the marginal cost of tokens learnt at one batch size serves the
                  others while each batch size keeps its own per-row overheads. Between two sizes on the curve the
                  line between them, but no more than ``prior_slope`` of the smaller size's time per token (past the
                  largest, with one size only, that slope too): optimistic, so that a size gets tried and measured
                  (on a CPU the cost is far from linear: Qwen2.5-1.5B, fp32, 2 cores, 2 nodes 1.09x a plain pass,
                  4 nodes 2.11x, so a line through 1 and 4 would never try 2)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import SelfspecError


def ema(old: float | None, new: float, w: float = 0.2) -> float:
    """A running average: ``new`` weighs ``w``."""
    return new if old is None else (1 - w) * old + w * new


def _as_run(rows: int, nodes: int) -> tuple[int, int]:
    return rows, nodes


@dataclass
class PassCost:
    """Seconds a target pass takes by its shape, as measured here; ``shape(rows, nodes)`` is the target pass's
    ``pass_shape`` (the shape such a pass runs at, padding included)."""

    shape: Callable[[int, int], tuple[int, int]] = _as_run
    window: int = 8
    prior_slope: float = 0.08
    runs: dict[tuple[int, int], list[float]] = field(default_factory=dict)  # shape run -> its last ``window`` times
    curve: dict[int, float] = field(default_factory=dict)  # tokens (rows x nodes, as run) -> seconds

    def record(self, rows: int, nodes: int, seconds: float) -> None:
        """A pass ran ``rows`` rows of ``nodes`` nodes each (padding included: the pass's ``last_shape``)."""
        self.runs[rows, nodes] = (self.runs.get((rows, nodes), []) + [seconds])[-self.window:]
        self.curve[rows * nodes] = ema(self.curve.get(rows * nodes), seconds, 0.3)

    def passes(self, rows: int, nodes: int) -> int:
        """How many passes of ``rows`` rows of ``nodes`` nodes (as they run) the cost holds, of its last window."""
        return len(self.runs.get(self.shape(rows, nodes), ()))

    def _median(self, run: tuple[int, int]) -> float | None:
        times = self.runs.get(run)
        return sorted(times)[(len(times) - 1) // 2] if times else None

    def seconds(self, rows: int, nodes: int) -> float | None:
        """Measured or estimated time of a pass of ``rows`` rows of trees of ``nodes`` nodes (the lower median of
        those measured at the shape it runs at); None before any pass; infinite for more nodes than a pass runs (a
        drafter sizing its tree asks past the largest bucket: such a tree is never the cheapest)."""
        try:
            run = self.shape(rows, nodes)
        except SelfspecError:
            return math.inf
        known = self._median(run)
        if known is not None:
            return known
        plain = self.shape(rows, 1)
        base = self._median(plain)
        if base is None:
            return self.along(run[0] * run[1])
        return base + max(self.along(run[0] * run[1]) - self.along(plain[0] * plain[1]), 0.0)

    def ratio(self, rows: int, nodes: float) -> float | None:
        """What a pass of trees of ``nodes`` nodes costs in plain passes of as many rows (a fractional size, an
        average, lies between its two neighbours); None before any pass was measured."""
        plain = self.seconds(rows, 1)
        if not plain:
            return None
        lo, hi = max(math.floor(nodes), 1), max(math.ceil(nodes), 1)
        r_lo, r_hi = self.seconds(rows, lo) / plain, self.seconds(rows, hi) / plain
        if math.isinf(r_hi):  # past the largest bucket
            return r_lo if nodes == lo else math.inf
        return r_lo + (nodes - lo) * (r_hi - r_lo)

    def along(self, tokens: int) -> float | None:
        """The curve at ``tokens``: between two measured sizes the line between them; past the largest the slope of
        the last two (never negative); below the smallest, proportionally."""
        if tokens in self.curve or not self.curve:
            return self.curve.get(tokens)
        sizes = sorted(self.curve)
        below = [n for n in sizes if n < tokens]
        above = [n for n in sizes if n > tokens]
        if below and above:  # no costlier than the prior slope above the smaller size: guessed cheap, tried, measured
            lo, hi = below[-1], above[0]
            line = self.curve[lo] + (self.curve[hi] - self.curve[lo]) * (tokens - lo) / (hi - lo)
            return min(line, self.curve[lo] * (1 + self.prior_slope * (tokens - lo) / lo))
        if above:
            return self.curve[above[0]] * tokens / above[0]
        top = below[-1]
        if len(below) > 1:
            slope = max(self.curve[top] - self.curve[below[-2]], 0.0) / (top - below[-2])
        else:
            slope = self.prior_slope * self.curve[top] / top
        return self.curve[top] + slope * (tokens - top)
