"""Early-exit drafting (LayerSkip-style): the target's first L layers, an exit adapter and the LM head draft a
tree (EAGLE-2's dynamic tree, ``selfspec/drafters/dynamic_tree.py``: each depth one pass over the k best
frontier nodes, with a tree mask into the drafter's caches) or a chain (``top_k`` 1).

The truncated model is the target's own base-model class built with ``num_hidden_layers = L`` on
the meta device, then given the target's own submodules by name (its first L layers, embeddings, norm):
everything is shared, nothing is copied, and no modeling code is repeated. Its output is the state after
layer L under the target's final norm (the *exit state*). The trained part, the exit adapter, sits between
the exit state and the target's LM head:

    projection   ``h + W h`` per position (W zero-initialised)
    layer        one decoder layer of the target's own class (Kangaroo's adapter), built like the EAGLE
                 head's (``AutoModel.from_config``, 1 layer, no embeddings, no final norm): it attends over the
                 exit states of the sequence so far, so it keeps its own one-layer KV cache; its attention and
                 MLP output projections start at zero (an untrained adapter is the plain exit)
    lora         nothing after the exit: LoRA pairs on the first L layers' projections instead, active only in
                 the drafter's shallow copy of those layers (``exit_lora.py``)

KV cache. The target's cache layers 0 .. L-1 already hold exactly what the truncated model needs for
the committed prefix (unless LoRA changes those layers). With the projection adapter, the engine's eager pass hands its cache to drafters
(``ctx.target_cache``), so the drafter drafts straight into a view of those L layer objects and crops
them back to the committed length afterwards: zero extra KV memory. Otherwise (the static pass, a layer
adapter whose cache must see every exit state, LoRA, or no target cache) the drafter keeps its own L-layer
cache (+ the adapter's) and re-feeds what was committed since its last draft: L/N of the target's KV.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import AutoModel, DynamicCache, PretrainedConfig
from transformers.cache_utils import Cache

from ..drafters.base import DraftContext, DraftRequest, Drafter
from ..drafters.chain import draft_chain
from ..drafters.dynamic_tree import grow_tree, select_tree
from ..drafters.draft_model import DraftModelState
from ..errors import SelfspecError
from ..target.kv_cache import truncate
from ..memory import kv_bytes_per_token, model_dtype
from ..memory import weight_numel
from ..target.packed_linear import linear, pack_linears, pack_weight, packable
from ..sequence import common_prefix
from ..tree import DraftTree, additive_mask, chain
from ..verify import cache_kwarg
from ..frozen import config_with_layers, lm_head, lm_head_rows, text_config, truncated_decoder
from .config import EarlyExitConfig
from .exit_lora import build_pairs, lora_decoder, write_peft_folder

# the output projections of transformers' attention and MLP blocks, zeroed so the adapter layer starts as identity
OUTPUT_PROJECTIONS = ("o_proj", "down_proj", "out_proj")


class ExitAdapter(nn.Module):
    """The trained part of early-exit drafting (``config.adapter``): a residual projection or one decoder layer
    over the sequence of exit states (between the exit and the LM head), or LoRA pairs on the first L layers."""

    def __init__(self, config: EarlyExitConfig, target_config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        hidden = text_config(target_config).hidden_size
        self.proj = nn.Linear(hidden, hidden, bias=False) if config.adapter == "projection" and config.exit_projection \
            else None
        if self.proj is not None:
            nn.init.zeros_(self.proj.weight)
        self.decoder = None
        if config.adapter == "layer":
            layer_config = config_with_layers(target_config, 1, intermediate_size=config.adapter_intermediate_size,
                                              vocab_size=1, pad_token_id=None, bos_token_id=None,
                                              eos_token_id=None, tie_word_embeddings=False)
            self.decoder = AutoModel.from_config(layer_config)
            self.decoder.set_input_embeddings(None)  # exit states come in as inputs_embeds
            if hasattr(self.decoder, "norm"):
                self.decoder.norm = nn.Identity()  # the exit state is normed already: the LM head reads x + delta
            for name, module in self.decoder.named_modules():
                if name.rsplit(".", 1)[-1] in OUTPUT_PROJECTIONS and isinstance(module, nn.Linear):
                    nn.init.zeros_(module.weight)
        self.lora = build_pairs(target_config, config.exit_layer, config.lora_rank) if config.adapter == "lora" \
            else None
        self.scaling = config.lora_alpha / config.lora_rank if self.lora is not None else None
        if config.draft_vocab_size is not None:  # target ids drafted over, sorted (set from data counts)
            self.register_buffer("draft_ids", torch.arange(config.draft_vocab_size))
        else:
            self.draft_ids = None

    @torch.no_grad()
    def set_draft_vocab(self, token_counts: torch.Tensor) -> None:
        """Draft over the ``draft_vocab_size`` most frequent tokens (counts per target id, e.g. from training data)."""
        top = token_counts.float().topk(self.draft_ids.numel()).indices.sort().values
        self.draft_ids.copy_(top.to(self.draft_ids.device))

    @property
    def sequential(self) -> bool:
        """Whether the adapter attends over earlier positions (then it has a KV cache of its own)."""
        return self.decoder is not None

    def new_cache(self) -> DynamicCache | None:
        """An empty KV cache for the adapter layer (None for a per-position adapter)."""
        return DynamicCache(config=self.decoder.config) if self.decoder is not None else None

    def exit_model(self, target: nn.Module) -> nn.Module:
        """What computes the exit states from tokens: the target's first L layers (+ final norm), with LoRA."""
        cut = truncated_decoder(target, self.config.exit_layer)
        return lora_decoder(cut, self) if self.lora is not None else cut

    def write_companions(self, folder, target: nn.Module, base_name: str | None) -> None:
        """Beside the checkpoint's tensors: a LoRA adapter's peft folder."""
        if self.lora is not None:
            write_peft_folder(self, target, folder, base_name)

    def forward(self, hidden: torch.Tensor | None, position_ids: torch.Tensor | None = None, cache: Cache | None = None,
                target: nn.Module | None = None, input_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, n, H) exit states at ``position_ids`` (B, n) -> (B, n, H) input of the LM head. A layer adapter
        attends causally over ``cache`` (earlier exit states, appended to) and the n states; None: from 0.
        LoRA (training, through any DDP wrapper): ``target`` and ``input_ids`` in, the adapted exit states out."""
        if self.lora is not None and target is not None:
            return self.exit_model(target)(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        if self.decoder is not None:
            if position_ids is None:
                position_ids = torch.arange(hidden.shape[1], device=hidden.device)[None].expand(hidden.shape[0], -1)
            out = self.decoder(inputs_embeds=hidden, position_ids=position_ids, attention_mask=attention_mask,
                               use_cache=cache is not None, **{cache_kwarg(type(self.decoder)): cache})
            return out.last_hidden_state
        return hidden if self.proj is None else hidden + self.proj(hidden)


def prefix_cache_view(cache: Cache, num_layers: int) -> Cache:
    """A cache whose layers ARE ``cache``'s first ``num_layers`` layer objects (no copy)."""
    return Cache(layers=list(cache.layers[:num_layers]))


@dataclass
class ExitState(DraftModelState):
    """The drafter's own L-layer cache and the tokens it holds; a layer adapter's cache over the same positions."""

    adapter_cache: Cache | None = None


class EarlyExitDrafter(Drafter):
    """Drafts with the target's first layers and the exit adapter: an EAGLE-2 dynamic tree (``top_k`` > 1, the
    default), or a chain, greedy or sampled with its distributions (``top_k`` 1)."""

    name = "early-exit"

    def __init__(self, target: nn.Module, adapter: ExitAdapter, top_k: int | None = None) -> None:
        self.target = target
        self.adapter = adapter.eval()
        self.top_k = top_k or adapter.config.top_k  # 1: chains
        # LoRA's copy of the layers holds the target's linears as they are when built: built in start(), after
        # the static pass has packed them (built now it would keep the dense weights alive beside the packed ones)
        self.decoder = None if adapter.lora is not None else adapter.exit_model(target)
        self.device = next(target.parameters()).device
        self.rows = None  # (draft ids, their LM head rows, bias) with a draft vocabulary, gathered in start()
        if adapter.decoder is not None:  # on a CPU the adapter layer runs on oneDNN-packed weights, as the target
            pack_linears(adapter.decoder.layers)

    def _shared(self, ctx: DraftContext) -> Cache | None:
        """The target's cache, where the drafter may draft inside it (a per-position adapter on unchanged layers,
        an eager pass)."""
        own = self.adapter.sequential or self.adapter.lora is not None
        return None if own else getattr(ctx, "target_cache", None)

    @torch.no_grad()
    def start(self, ctx: DraftContext) -> ExitState:
        """Prefill own caches with the prompt but its last token (none when drafting in the target's). LoRA's copy
        of the layers is rebuilt: it holds the target's linears as they are now (the static pass may have packed
        them); the plain truncated model shares the target's layer modules, so it follows them by itself."""
        if self.adapter.lora is not None:  # the copy holds the target's linears: take them as they are now
            self.decoder = self.adapter.exit_model(self.target)
        ids = self.adapter.draft_ids
        if ids is not None:  # the draft vocabulary and the prompt's tokens outside it (names, identifiers a reply
            # repeats): their LM-head rows, packed like the target's linears on a CPU
            prompt = ctx.tokens.to(ids.device).unique()
            ids = torch.cat([ids, prompt[~torch.isin(prompt, ids)]])
            weight, bias = lm_head_rows(self.target, ids)
            weight = weight.to(model_dtype(self.target))
            self.rows = (ids, pack_weight(weight) if packable(self.target) else weight, bias)
        state = ExitState(DynamicCache(config=self.decoder.config), [], self.adapter.new_cache())
        prefix = ctx.tokens[:-1].tolist()
        if prefix and self._shared(ctx) is None:
            self._logits(torch.tensor([prefix], device=self.device), 0, state.cache, state.adapter_cache)
            state.processed = prefix
        return state

    def _exit_outputs(self, ids: torch.Tensor, pos: torch.Tensor, cache: Cache, adapter_cache: Cache | None,
                      mask: torch.Tensor | None = None, last_only: bool = False) -> torch.Tensor:
        """Feed ``ids`` (1, n) at ``pos`` (1, n) into the caches (a 4-D ``mask`` for tree nodes, else causal);
        the adapter's outputs, the LM head's inputs: (n, H), or (1, H) for the last position only."""
        out = self.decoder(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=True,
                           **{cache_kwarg(type(self.decoder)): cache})
        exits = out.last_hidden_state
        if last_only and not self.adapter.sequential:
            exits, pos = exits[:, -1:], pos[:, -1:]  # a per-position adapter needs the last state only
        h = self.adapter(exits, pos, adapter_cache, attention_mask=mask)[0]
        return h[-1:] if last_only else h

    def _draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        """(n, H) LM-head inputs -> (n, V) logits over the whole vocabulary, or (n, draft_vocab) over a draft one."""
        if self.rows is None:
            return lm_head(self.target)(h)
        _, weight, bias = self.rows
        return linear(h, weight, bias)

    def _logits(self, ids: torch.Tensor, start: int, cache: Cache, adapter_cache: Cache | None) -> torch.Tensor:
        """Feed ``ids`` (1, n) at positions ``start ..`` into the caches; the logits after the last one, (V,)."""
        pos = torch.arange(start, start + ids.shape[1], device=self.device)[None]
        logits = self._draft_logits(self._exit_outputs(ids, pos, cache, adapter_cache, last_only=True))[0]
        if self.rows is None:
            return logits
        full = logits.new_full((lm_head(self.target).out_features,), float("-inf"))  # probability 0 in q
        return full.index_copy_(0, self.rows[0].to(logits.device), logits)

    def _top(self, h: torch.Tensor, k: int) -> tuple[list[list[int]], list[list[float]]]:
        """Top-k target token ids and their log-probabilities for each of (n, H) LM-head inputs."""
        top = self._draft_logits(h).float().log_softmax(-1).topk(min(k, self._vocab()), dim=-1)
        idx = top.indices.cpu()
        return (idx if self.rows is None else self.rows[0].cpu()[idx]).tolist(), top.values.cpu().tolist()

    def _vocab(self) -> int:
        """How many tokens a draft chooses among (the whole vocabulary, or the gathered rows)."""
        return lm_head(self.target).out_features if self.rows is None else self.rows[0].numel()

    def _tree(self, feed: torch.Tensor, keep: int, cache: Cache, adapter_cache: Cache | None, root: int,
              req: DraftRequest) -> DraftTree:
        """An EAGLE-2 dynamic tree (``grow_tree``): feed the committed tokens not cached yet and the root, then
        expand the best frontier nodes depth by depth, each level one pass of the first L layers and the adapter.
        The caches are cropped back to the committed tokens (root included) afterwards."""
        pos = torch.arange(keep, keep + feed.shape[1], device=self.device)[None]
        root_out = self._exit_outputs(feed, pos, cache, adapter_cache, last_only=True)[0]
        committed = keep + feed.shape[1]

        def run(tokens: list[int], _parents: torch.Tensor, positions: list[int], mask: torch.Tensor) -> torch.Tensor:
            ids, p = (torch.tensor([v], device=self.device) for v in (tokens, positions))
            return self._exit_outputs(ids, p, cache, adapter_cache, additive_mask(mask, root_out.dtype))

        budget = req.max_nodes - 1
        cand = grow_tree(root_out, committed, req.max_depth, budget, self.top_k, self._top, run)
        for c in (cache, adapter_cache):
            if c is not None:
                truncate(c, committed)
        return select_tree(cand, root, budget, req.node_cost)

    @torch.no_grad()
    def propose(self, state: ExitState, ctx: DraftContext, req: DraftRequest) -> tuple[DraftTree, ExitState]:
        """A dynamic tree of at most ``req.max_depth`` levels and ``req.max_nodes`` nodes (``top_k`` > 1), or a
        chain of ``req.max_depth`` tokens (greedy, or sampled with q reported)."""
        tokens = ctx.tokens.tolist()
        depth = min(req.max_depth, req.max_nodes - 1)
        if depth <= 0:
            return chain(tokens[-1], []), state
        shared = self._shared(ctx)
        if shared is not None:  # the target's first L layers already hold tokens[:-1]
            cache, keep = prefix_cache_view(shared, self.adapter.config.exit_layer), ctx.cache_len
        else:
            cache, keep = state.cache, min(common_prefix(state.processed, tokens), len(tokens) - 1)
            truncate(cache, keep)
            if state.adapter_cache is not None:
                truncate(state.adapter_cache, keep)
        feed = torch.tensor([tokens[keep:]], device=self.device)
        if self.top_k > 1:
            tree, fed = self._tree(feed, keep, cache, state.adapter_cache, tokens[-1], req), tokens
        else:
            out = draft_chain(lambda ids, pos: self._logits(ids, pos, cache, state.adapter_cache), feed, keep, depth,
                              req, lm_head(self.target).out_features)
            tree = chain(tokens[-1], out.tokens, out.draft_probs)
            fed = tokens + (out.tokens if out.fed_last else out.tokens[:-1])
        if shared is not None:
            truncate(cache, ctx.cache_len)  # give the target its layers back as they were
        else:
            state.processed = fed
        return tree, state

    def extra_parameters(self) -> int:
        """The exit adapter's trained parameters (the truncated model shares the target's), plus the LM-head rows
        a draft vocabulary gathers (a copy)."""
        rows = self.adapter.config.copied_parameters(lm_head(self.target).out_features,
                                                     text_config(self.target.config).hidden_size)
        return weight_numel(self.adapter) + rows

    def kv_bytes_per_token(self) -> int:
        """The drafter's own cache, where it keeps one (the static pass, a layer adapter): the first L layers'
        keys and values, plus the adapter layer's."""
        dtype = model_dtype(self.target)
        own = kv_bytes_per_token(self.target.config, dtype, self.adapter.config.exit_layer)
        return own + (kv_bytes_per_token(self.adapter.decoder.config, dtype) if self.adapter.sequential else 0)
