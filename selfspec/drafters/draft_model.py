"""Classic speculative decoding: a smaller model with the same tokenizer drafts a chain.

The draft model keeps its own KV cache, kept in step with the target's: before drafting it rolls
back to the longest prefix it processed that is still committed, then feeds the missing tokens.
This is the baseline selfspec's heads must beat on memory: the whole second model stays resident.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import SelfspecError
from ..kv_cache import new_cache, truncate
from ..sampling import logits_to_probs
from ..tree import DraftTree, chain
from ..verify import forward_with_cache
from .base import DraftContext, DraftRequest, Drafter


@dataclass
class DraftModelState:
    """The draft model's cache and the tokens it holds (its positions 0 .. len(processed) - 1)."""

    cache: object
    processed: list[int]


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class DraftModelDrafter(Drafter):
    """Draft with a separate causal LM sharing the target's tokenizer."""

    name = "draft-model"

    def __init__(self, draft_model: torch.nn.Module, target_vocab_size: int | None = None,
                 confidence_stop: float = 0.4) -> None:
        """``confidence_stop``: end the chain at a token the draft model itself gives less than this
        probability (it depends on the draft alone, so acceptance stays exact); 0 drafts the full depth."""
        self.model = draft_model.eval()
        self.model.requires_grad_(False)
        self.draft_vocab = draft_model.get_output_embeddings().out_features
        self.target_vocab = target_vocab_size or self.draft_vocab
        if abs(self.draft_vocab - self.target_vocab) > 1024:  # small differences are padding rows
            raise SelfspecError(
                f"draft model vocabulary ({self.draft_vocab}) does not match the target's ({self.target_vocab}): "
                "a separate draft model must share the target's tokenizer")
        self.device = next(draft_model.parameters()).device
        self.confidence_stop = confidence_stop

    @torch.no_grad()
    def start(self, ctx: DraftContext) -> DraftModelState:
        """Prefill the draft model's cache with the prompt but its last token, as the target did."""
        state = DraftModelState(new_cache(self.model), [])
        prefix = ctx.tokens[:-1].tolist()
        if prefix:
            ids = torch.tensor([prefix], device=self.device)
            forward_with_cache(self.model, ids, state.cache, position_ids=torch.arange(len(prefix), device=self.device)[None],
                               logits_to_keep=1)
            state.processed = prefix
        return state

    def _next_probs(self, logits: torch.Tensor, req: DraftRequest) -> torch.Tensor:
        probs = logits_to_probs(logits[: self.target_vocab], req.sampling)
        if probs.numel() < self.target_vocab:
            probs = torch.nn.functional.pad(probs, (0, self.target_vocab - probs.numel()))
        return probs

    @torch.no_grad()
    def propose(self, state: DraftModelState, ctx: DraftContext, req: DraftRequest) -> tuple[DraftTree, DraftModelState]:
        """A chain of ``req.max_depth`` tokens, greedy or sampled (then with its distributions)."""
        tokens = ctx.tokens.tolist()
        depth = min(req.max_depth, req.max_nodes - 1)
        if depth <= 0:
            return chain(tokens[-1], []), state
        keep = min(common_prefix(state.processed, tokens), len(tokens) - 1)  # always re-feed the root
        truncate(state.cache, keep)
        ids = torch.tensor([tokens[keep:]], device=self.device)
        drafted: list[torch.Tensor] = []  # (1,) tensors on the device: no host sync per greedy token
        q_rows: list[torch.Tensor] = []
        pos = keep
        fed_all = False  # True when the loop stopped early, after feeding its last drafted token
        for _ in range(depth):
            positions = torch.arange(pos, pos + ids.shape[1], device=self.device)[None]
            logits = forward_with_cache(self.model, ids, state.cache, position_ids=positions, logits_to_keep=1).logits[0, -1]
            pos += ids.shape[1]
            if drafted and self.confidence_stop > 0:  # a likely rejection: stop drafting here
                if float(logits[: self.target_vocab].float().softmax(-1).max()) < self.confidence_stop:
                    fed_all = True
                    break
            if req.sampling.greedy:
                tok = logits[: self.target_vocab].argmax()[None]
            else:
                probs = self._next_probs(logits, req).cpu()
                tok = torch.multinomial(probs, 1, generator=req.generator).to(self.device)
                q_rows.append(probs)
            drafted.append(tok)
            ids = tok[None]
        out = torch.cat(drafted).tolist()
        state.processed = tokens + (out if fed_all else out[:-1])
        draft_probs = None
        if q_rows:  # row i: the distribution node i's child was sampled from
            draft_probs = torch.stack(q_rows + [torch.zeros_like(q_rows[0])])
        return chain(tokens[-1], out, draft_probs), state

    def extra_parameters(self) -> int:
        """The whole draft model stays resident."""
        return sum(p.numel() for p in self.model.parameters())
