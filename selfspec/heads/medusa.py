"""Medusa-style heads: K small residual heads on the target's last hidden state, one per future position.

Head k maps the state that predicted the root, h (H,), to a state whose logits under the target's
frozen LM head predict the token k places after the root. Each head is ``num_layers`` blocks
``h + SiLU(W h + b)`` with W, b zero-initialised, so an untrained head is the identity. The draft is
a static tree of top-k ranks (``MedusaConfig.tree``): children are chosen deterministically, so the
tree carries no draft probabilities and sampling-mode acceptance stays exact.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from ..drafters.base import DraftContext, DraftRequest, Drafter
from ..tree import DraftTree, chain
from ..frozen import lm_head, placement, text_config, trained_parameter_count
from .config import MedusaConfig


class ResidualBlock(nn.Module):
    """``h + SiLU(W h + b)``, starting as the identity (W = 0, b = 0)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """(..., H) -> (..., H)."""
        return h + nn.functional.silu(self.linear(h))


class MedusaHeads(nn.Module):
    """The trained part: ``num_heads`` independent stacks of residual blocks (no vocabulary matrices)."""

    def __init__(self, config: MedusaConfig, target_config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        hidden = text_config(target_config).hidden_size
        # one fresh block per (head, layer): never [Block()] * n, which would share one block n times
        self.heads = nn.ModuleList(
            nn.Sequential(*(ResidualBlock(hidden) for _ in range(config.num_layers))) for _ in range(config.num_heads)
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., H) -> (K, ..., H). Row i, from the state at position t, predicts token t + 2 + i.

        (The LM head on that state predicts token t + 1, the root; head i + 1 looks i + 1 tokens further.)
        """
        return torch.stack([head(hidden) for head in self.heads])


def rank_tree(paths: list[list[int]], max_depth: int, max_nodes: int) -> tuple[list[int], list[tuple[int, int]]]:
    """The trie of rank paths that fits the limits: (parent of each node, (depth, rank) of each node).

    Node 0 is the root. Paths are taken in order; a path deeper than ``max_depth`` is cut there, one
    needing more nodes than are left is skipped. A missing prefix is added with its path.
    """
    parents, labels, index = [-1], [(0, 0)], {(): 0}
    for path in paths:
        path = tuple(path[:max_depth])
        new = [path[:d] for d in range(1, len(path) + 1) if path[:d] not in index]
        if len(parents) + len(new) > max_nodes:
            continue
        for prefix in new:
            index[prefix] = len(parents)
            parents.append(index[prefix[:-1]])
            labels.append((len(prefix), prefix[-1]))
    return parents, labels


class MedusaDrafter(Drafter):
    """Drafts the static rank tree from the heads' top-k tokens."""

    name = "medusa"
    needs_hidden_states = True

    def __init__(self, target: nn.Module, heads: MedusaHeads) -> None:
        self.target = target
        self.heads = heads.eval()
        lm_head(target)  # a plain LM head, checked now

    def start(self, ctx: DraftContext) -> torch.Tensor | None:
        """State: the target's last hidden state (the one that predicted the root), or None before any."""
        return self.observe(None, ctx)

    def observe(self, state: torch.Tensor | None, ctx: DraftContext) -> torch.Tensor | None:
        """Keep the newest final-layer hidden state."""
        if ctx.hidden_states is None or ctx.hidden_states[-1].shape[0] == 0:
            return state
        return ctx.hidden_states[-1][-1]

    @torch.no_grad()
    def propose(self, state: torch.Tensor | None, ctx: DraftContext, req: DraftRequest
                ) -> tuple[DraftTree, torch.Tensor | None]:
        """The configured tree, pruned to the request, labelled with each head's ranked tokens."""
        root = int(ctx.tokens[-1])
        head = lm_head(self.target)
        vocab = head.out_features
        paths = [p for p in self.heads.config.tree if max(p) < vocab]  # a tiny vocabulary has fewer ranks
        parents, labels = rank_tree(paths, req.max_depth, req.max_nodes)
        if state is None or len(parents) == 1:
            return chain(root, []), state
        depth = max(d for d, _ in labels)
        k = max(r for _, r in labels) + 1
        states = self.heads(state[None].to(placement(self.heads)[1]))[:depth, 0]  # (depth, H)
        logits = head(states)  # (depth, V)
        top = logits.topk(k, dim=-1).indices.cpu()  # (depth, k)
        tokens = [root] + [int(top[d - 1, r]) for d, r in labels[1:]]
        return DraftTree(torch.tensor(tokens, dtype=torch.long), parents), state

    def extra_parameters(self) -> int:
        """The heads' trained parameters."""
        return trained_parameter_count(self.heads)
