"""What one generation measured: tokens, target passes, acceptance per depth, where the time went."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class GenerationStats:
    """Operational metrics of one request. τ (``mean_accepted``) counts the target's own token, so plain decoding gives 1.0."""

    new_tokens: int = 0
    target_forwards: int = 0  # verification passes after prefill; each commits >= 1 token
    speculative_steps: int = 0  # passes that checked at least one drafted token
    drafted_at_depth: list[int] = field(default_factory=list)  # [d-1]: steps whose draft reached depth d
    reached_depth: list[int] = field(default_factory=list)  # [d-1]: ... and whose path was accepted to depth d-1
    accepted_at_depth: list[int] = field(default_factory=list)  # [d-1]: ... and accepted a token at depth d
    tokens_per_step: list[int] = field(default_factory=list)
    drafts_by_source: dict[str, int] = field(default_factory=dict)  # speculative steps per drafter that answered
    max_tree_nodes: int = 0  # largest draft tree verified, root included
    draft_state_bytes: int = 0  # peak bytes of the drafter's per-request state (its KV cache) after a draft
    dtype: str = ""  # the target's dtype ("bfloat16", ...): what --dtype auto chose
    target_pass: str = ""  # how the target ran: eager, static or compiled
    exact: bool = False  # every pass computed each row as a plain step does: output bit-identical to plain decoding
    cached_prompt_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache (not recomputed)
    queue_s: float = 0.0  # waiting for a row of a batch (0 for a request decoded alone)
    prefill_s: float = 0.0  # from taking a row (or starting) to the prompt cached
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0

    def record_step(self, tree_depth: int, accepted: int, committed: int, source: str = "") -> None:
        """Count one target pass: how deep the draft went (and who drafted it), how many drafts were kept,
        tokens committed."""
        self.target_forwards += 1
        self.tokens_per_step.append(committed)
        self.new_tokens += committed
        if tree_depth == 0:
            return
        self.speculative_steps += 1
        self.drafts_by_source[source] = self.drafts_by_source.get(source, 0) + 1
        for lst in (self.drafted_at_depth, self.reached_depth, self.accepted_at_depth):
            lst.extend([0] * (tree_depth - len(lst)))
        for d in range(tree_depth):
            self.drafted_at_depth[d] += 1
            if d <= accepted:
                self.reached_depth[d] += 1
            if d < accepted:
                self.accepted_at_depth[d] += 1

    @property
    def mean_accepted(self) -> float:
        """τ: tokens committed per target pass (accepted drafts + the target's own token)."""
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def acceptance_by_depth(self) -> list[float]:
        """P(draft at depth d accepted | the path reached depth d-1), for d = 1, 2, ..."""
        return [a / r if r else 0.0 for a, r in zip(self.accepted_at_depth, self.reached_depth)]

    @property
    def other_s(self) -> float:
        """Time outside the queue, prefill, drafting and verification (acceptance, cache moves, bookkeeping)."""
        return max(self.total_s - self.queue_s - self.prefill_s - self.draft_s - self.verify_s, 0.0)

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second of wall time, prefill included."""
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    def to_dict(self) -> dict:
        """Plain-JSON form with the derived metrics."""
        out = asdict(self)
        del out["tokens_per_step"]
        out.update(mean_accepted=self.mean_accepted, acceptance_by_depth=self.acceptance_by_depth,
                   other_s=self.other_s, tokens_per_s=self.tokens_per_s)
        return out
