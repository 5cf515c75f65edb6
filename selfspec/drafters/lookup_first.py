"""Context lookup first, another drafter otherwise: copied text is drafted for free.

Code and chat answers often repeat their context (a function signature, a quoted line, a name).
Where the last few tokens occurred before, prompt lookup drafts what followed them at no cost;
only where the context does not repeat does the wrapped drafter (a draft model, heads) spend time
drafting. On 2 CPU cores with Qwen2.5-Coder-1.5B + 0.5B this took HumanEval answers from 2.8 to
~4 tokens/s (the 0.5B costs ~40% of a target step per drafted token there).

The engine's depth policy judges the two sources apart (``draft`` asks for each by name): weak heads
that switch themselves off do not stop a lookup match from being verified, and a lookup that keeps
missing does not stop the heads.

Lossless whichever drafter answers: each tree carries its own draft distributions (prompt lookup's
are point masses), and the wrapped drafter sees every commit through ``observe`` and re-syncs its
own state from the committed tokens when it drafts again.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..tree import DraftTree
from .base import DraftContext, DraftRequest, Drafter
from .prompt_lookup import PromptLookupDrafter


class LookupFirstDrafter(Drafter):
    """Draft with ``lookup`` when it matches an n-gram of ``min_ngram``+ tokens and reaches ``min_depth``;
    otherwise with ``inner``."""

    def __init__(self, inner: Drafter, min_ngram: int = 3, max_ngram: int = 4, min_depth: int = 2) -> None:
        self.inner = inner
        self.lookup = PromptLookupDrafter(max_ngram=max_ngram, min_ngram=min_ngram, candidates=1)
        self.min_depth = min_depth
        self.name = f"{inner.name}+lookup"
        self.needs_hidden_states = inner.needs_hidden_states

    def start(self, ctx: DraftContext) -> Any:
        """The wrapped drafter's state (lookup keeps none)."""
        return self.inner.start(ctx)

    def propose(self, state: Any, ctx: DraftContext, req: DraftRequest) -> tuple[DraftTree, Any]:
        """The lookup chain when the context repeats itself deeply enough, else the wrapped drafter's tree."""
        return self.draft(state, ctx, replace(req, depth_for=None))

    def draft(self, state: Any, ctx: DraftContext, req: DraftRequest) -> tuple[DraftTree, Any]:
        """A lookup match where the policy lets lookup draft, else whatever the wrapped drafter's own policy allows."""
        tree, _ = self.lookup.propose(None, ctx, req)
        if tree.max_depth >= min(self.min_depth, req.max_depth):
            depth = req.depth(self.lookup.name)  # asked only when there is a match to verify
            if depth > 0:
                if depth < tree.max_depth:
                    tree, _ = self.lookup.propose(None, ctx, replace(req, max_depth=depth))
                tree.source = self.lookup.name
                return tree, state
        return self.inner.draft(state, ctx, req)

    def observe(self, state: Any, ctx: DraftContext) -> Any:
        return self.inner.observe(state, ctx)

    def extra_parameters(self) -> int:
        return self.inner.extra_parameters()

    def kv_bytes_per_token(self) -> int:
        return self.inner.kv_bytes_per_token()
