"""Early-exit drafting (LayerSkip-style): the target's first L layers, its final norm and LM head draft a chain.

The truncated model is the target's own base-model class built with ``num_hidden_layers = L`` on
the meta device, then given the target's own submodules by name (its first L layers, embeddings, norm):
everything is shared, nothing is copied, and no modeling code is repeated. The only trained weights are an optional exit
projection ``h + W h`` (W zero-initialised) between the final norm and the LM head.

KV cache. The target's cache layers 0 .. L-1 already hold exactly what the truncated model needs for
the committed prefix. The engine hands its cache to drafters (``ctx.target_cache``), so the drafter
drafts straight into a view of those L layer objects and crops them back to the committed length
afterwards: zero extra KV memory. Used outside the engine without a target cache, the drafter keeps
its own L-layer cache and re-feeds what was committed since its last draft.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import Cache

from ..drafters.base import DraftContext, DraftRequest, Drafter
from ..drafters.chain import draft_chain
from ..drafters.draft_model import DraftModelState
from ..errors import SelfspecError
from ..kv_cache import truncate
from ..sequence import common_prefix
from ..tree import DraftTree, chain
from ..verify import cache_kwarg
from .common import config_with_layers, lm_head, text_config, trained_parameter_count
from .config import EarlyExitConfig


class ExitAdapter(nn.Module):
    """The trained part: an optional residual projection ``h + W h`` (W = 0 at init) before the LM head."""

    def __init__(self, config: EarlyExitConfig, target_config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        hidden = text_config(target_config).hidden_size
        self.proj = nn.Linear(hidden, hidden, bias=False) if config.exit_projection else None
        if self.proj is not None:
            nn.init.zeros_(self.proj.weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., H) normed exit state -> (..., H) input of the LM head."""
        return hidden if self.proj is None else hidden + self.proj(hidden)


def truncated_decoder(target: nn.Module, num_layers: int) -> nn.Module:
    """The target's base model cut to its first ``num_layers`` layers (+ final norm), sharing every module.

    The cut holds the target's own submodules (its first layers, embeddings, norm, rotary embedding), not
    copies of their tensors, so whatever later happens to a shared module (``selfspec/packed_linear.py``
    packing its linears) happens to both."""
    decoder = target.get_decoder()
    config = config_with_layers(target.config, num_layers, attn_implementation=decoder.config._attn_implementation)
    with torch.device("meta"):
        cut = type(decoder)(config)
    for name, child in list(cut.named_children()):
        source = getattr(decoder, name, None)
        if isinstance(child, nn.ModuleList) and isinstance(source, nn.ModuleList) and len(source) >= len(child):
            setattr(cut, name, nn.ModuleList(source[:len(child)]))
        elif type(source) is type(child):
            setattr(cut, name, source)
        else:
            raise SelfspecError(f"early exit cannot share '{name}' with {type(target).__name__}: "
                                "its truncated copy does not have the same modules")
    persistent = set(cut.state_dict())
    for name, _ in list(cut.named_buffers(recurse=False)):
        cut.register_buffer(name, decoder.get_buffer(name), persistent=name in persistent)
    if any(t.is_meta for t in (*cut.parameters(), *cut.buffers())):
        raise SelfspecError(f"early exit could not share every tensor of {type(target).__name__}")
    return cut.eval()


def prefix_cache_view(cache: Cache, num_layers: int) -> Cache:
    """A cache whose layers ARE ``cache``'s first ``num_layers`` layer objects (no copy)."""
    return Cache(layers=list(cache.layers[:num_layers]))


class EarlyExitDrafter(Drafter):
    """Drafts a chain with the target's first layers: greedy, or sampled with its distributions."""

    name = "early-exit"

    def __init__(self, target: nn.Module, adapter: ExitAdapter) -> None:
        self.target = target
        self.adapter = adapter.eval()
        self.decoder = truncated_decoder(target, adapter.config.exit_layer)
        self.device = next(target.parameters()).device

    @torch.no_grad()
    def start(self, ctx: DraftContext) -> DraftModelState:
        """Prefill an own L-layer cache with the prompt but its last token (none when drafting in the target's)."""
        state = DraftModelState(DynamicCache(config=self.decoder.config), [])
        prefix = ctx.tokens[:-1].tolist()
        if prefix and getattr(ctx, "target_cache", None) is None:
            self._logits(torch.tensor([prefix], device=self.device), 0, state.cache)
            state.processed = prefix
        return state

    def _logits(self, ids: torch.Tensor, start: int, cache: Cache) -> torch.Tensor:
        """Feed ``ids`` (1, n) at positions ``start ..`` into ``cache``; the logits after the last one, (V,)."""
        pos = torch.arange(start, start + ids.shape[1], device=self.device)[None]
        out = self.decoder(input_ids=ids, position_ids=pos, use_cache=True, **{cache_kwarg(type(self.decoder)): cache})
        return lm_head(self.target)(self.adapter(out.last_hidden_state[0, -1]))

    @torch.no_grad()
    def propose(self, state: DraftModelState, ctx: DraftContext, req: DraftRequest
                ) -> tuple[DraftTree, DraftModelState]:
        """A chain of ``req.max_depth`` tokens (greedy, or sampled with q reported)."""
        tokens = ctx.tokens.tolist()
        depth = min(req.max_depth, req.max_nodes - 1)
        if depth <= 0:
            return chain(tokens[-1], []), state
        shared = getattr(ctx, "target_cache", None)
        if shared is not None:  # the target's first L layers already hold tokens[:-1]
            cache, keep = prefix_cache_view(shared, self.adapter.config.exit_layer), ctx.cache_len
        else:
            cache, keep = state.cache, min(common_prefix(state.processed, tokens), len(tokens) - 1)
            truncate(cache, keep)
        feed = torch.tensor([tokens[keep:]], device=self.device)
        out = draft_chain(lambda ids, pos: self._logits(ids, pos, cache), feed, keep, depth, req,
                          lm_head(self.target).out_features)
        if shared is not None:
            truncate(cache, ctx.cache_len)  # give the target its layers back as they were
        else:
            state.processed = tokens + (out.tokens if out.fed_last else out.tokens[:-1])
        return chain(tokens[-1], out.tokens, out.draft_probs), state

    def extra_parameters(self) -> int:
        """The exit adapter's trained parameters (the truncated model shares the target's)."""
        return trained_parameter_count(self.adapter)
