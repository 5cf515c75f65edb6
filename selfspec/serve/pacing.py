"""Stream smoothing: release tokens committed in bursts at the rate they are produced.

Speculative decoding commits 1..k tokens per step, so a raw stream stutters: a burst, then a whole step of
silence. The pacer measures (exponential moving averages) the time between commits ``T`` and the tokens per
commit ``m``; when a commit leaves ``b`` tokens waiting to be sent, it spaces them by

    T / max(m, b)

until the next commit: in steady state one token leaves every ``T / m`` seconds, and a backlog larger than
usual is cleared within one step, so no token, the final one included, is held back by more than one
step's time. The first token and everything before the first measured step go out at once (time to first
token is never paced).
"""

from __future__ import annotations

from dataclasses import dataclass


def _ema(old: float | None, new: float, alpha: float) -> float:
    return new if old is None else (1 - alpha) * old + alpha * new


@dataclass
class Pacer:
    """When to send the next waiting token."""

    enabled: bool = True
    alpha: float = 0.3  # weight of the newest measurement
    step_s: float | None = None  # seconds between commits (moving average)
    per_step: float | None = None  # tokens per commit (moving average)
    last_commit: float | None = None
    spacing: float = 0.0  # seconds between tokens sent until the next commit

    def commit(self, n_tokens: int, now: float, waiting: int) -> None:
        """A step committed ``n_tokens`` at time ``now`` (seconds, monotonic), leaving ``waiting`` tokens unsent."""
        if n_tokens <= 0:
            return
        if self.last_commit is not None:
            self.step_s = _ema(self.step_s, now - self.last_commit, self.alpha)
        self.per_step = _ema(self.per_step, float(n_tokens), self.alpha)
        self.last_commit = now
        self.spacing = 0.0 if self.step_s is None else self.step_s / max(self.per_step, float(waiting), 1.0)

    def interval(self) -> float:
        """Seconds to wait between two waiting tokens until the next commit (0: send now)."""
        return self.spacing if self.enabled else 0.0
