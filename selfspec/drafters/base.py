"""The drafter interface: everything that proposes tokens for the target to check.

A drafter is stateless across requests; what it remembers within one request lives in a state
object it creates in ``start`` and returns, updated, from ``propose`` and ``observe``. The engine
calls, per request:

    state = drafter.start(ctx)                       # after the target's prefill
    loop:
        tree, state = drafter.draft(state, ctx, req) # asks req.depth(source), then propose()
        ... target verifies, accepts, commits ...
        state = drafter.observe(state, ctx)          # learn what was committed
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..sampling import SamplingConfig
from ..tree import DraftTree, chain


@dataclass
class DraftContext:
    """What was committed so far. The target's KV cache holds ``tokens[:-1]``; ``tokens[-1]`` is the root.

    ``hidden_states`` (one (n, H) tensor per entry of the drafter's ``state_layers``; by default a 1-tuple, the
    target's final normed layer) cover the positions the target cached since the last call, ``cache_len - n .. cache_len - 1``; given only to drafters that ask.
    """

    tokens: torch.Tensor  # (T,) long, on CPU
    cache_len: int
    hidden_states: tuple[torch.Tensor, ...] | None = None
    target_cache: object | None = None  # the target's KV cache (read-only between steps; early exit drafts in it)
    scope: str | None = None  # whose earlier requests a drafter that learns across them may draw on (DecodeConfig)


@dataclass
class DraftRequest:
    """Limits for one draft."""

    max_depth: int
    max_nodes: int
    sampling: SamplingConfig
    generator: torch.Generator | None = None
    depth_for: Callable[[str], int] | None = None  # the engine's depth policy, asked per draft source
    rate_for: Callable[[str], float] | None = None  # ... and its expected tokens/s per draft source
    node_cost: Callable[[float], float] | None = None  # verify cost of an n-node pass / a plain step (None: fixed size)

    def depth(self, source: str) -> int:
        """How deep ``source`` may draft this step (0: not at all); ``max_depth`` when nobody decides."""
        return self.max_depth if self.depth_for is None else min(self.depth_for(source), self.max_depth)

    def rate(self, source: str) -> float:
        """Expected tokens/s if ``source`` drafts this step (0.0 when nobody keeps a record)."""
        return 0.0 if self.rate_for is None else self.rate_for(source)


class Drafter:
    """Base class. Subclasses implement ``propose``; ``start``/``observe`` default to no state."""

    name: str = "drafter"
    needs_hidden_states: bool = False  # the engine then asks the target for hidden states
    # which of them, as indices into transformers' ``hidden_states`` (0 the embeddings, k the output of layer k,
    # -1 the final normed layer); the engine keeps only these, in this order
    state_layers: tuple[int, ...] = (-1,)
    drafts_batches: bool = False  # ``propose_chains`` drafts many sequences' chains at once (a batch's step)

    def start(self, ctx: DraftContext) -> Any:
        """Fresh per-request state, after the target has prefilled ``ctx.tokens[:-1]``."""
        return None

    def propose(self, state: Any, ctx: DraftContext, req: DraftRequest) -> tuple[DraftTree, Any]:
        """A tree rooted at ``ctx.tokens[-1]`` within ``req``'s limits (a root-only tree means no draft)."""
        raise NotImplementedError

    def propose_chains(self, states: list, ctxs: list[DraftContext], depths: list[int]
                       ) -> tuple[list[DraftTree], float]:
        """Greedy chains of ``depths[i]`` tokens for several sequences at once (where ``drafts_batches``), and the
        seconds spent feeding what was queued before drafting (a prompt, the pairs committed while the batch did not
        draft): a one-off, not what drafting to a depth costs from step to step."""
        raise NotImplementedError

    def release(self, state: Any) -> None:
        """The request that ``state`` belongs to ended: free what the drafter keeps for it (a batch cache's row)."""

    def finished(self, state: Any, tokens: torch.Tensor, scope: str | None = None) -> None:
        """The request ended well with ``tokens`` committed (prompt included) and may be remembered: a drafter that
        learns across requests keeps what it wants of it, for requests of the same ``scope`` (called before
        ``release``)."""

    def draft(self, state: Any, ctx: DraftContext, req: DraftRequest) -> tuple[DraftTree, Any]:
        """What the engine calls: ask how deep this source may go (``req.depth``), then ``propose`` that deep.

        The tree comes back tagged with its source. Drafters made of several sources override this to
        ask for each source separately, so each one's acceptance and cost are judged on their own.
        """
        depth = req.depth(self.name)
        if depth == 0:
            return chain(int(ctx.tokens[-1]), []), state
        tree, state = self.propose(state, ctx, replace(req, max_depth=depth))
        tree.source = tree.source or self.name
        return tree, state

    def observe(self, state: Any, ctx: DraftContext) -> Any:
        """Called after each commit with the new context; returns the updated state."""
        return state

    def extra_parameters(self) -> int:
        """Parameters this drafter keeps resident beside the target: trained weights and any frozen copies."""
        return 0

    def kv_bytes_per_token(self) -> int:
        """Bytes of the drafter's own KV cache per context token (0: none, or it drafts in the target's)."""
        return 0
