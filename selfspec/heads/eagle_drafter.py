"""Drafting with an EAGLE head: its own one-layer KV cache in step with the target, and an EAGLE-2 dynamic tree.

Cache: the target caches positions 0 .. R-1 (R = root position) and reports their final hidden
states, so pairs (f_t, x_{t+1}) exist for t = 0 .. R-1. The head's cache holds the pairs fed so far;
``start`` queues the prompt's pairs, ``observe`` the newly committed ones, and ``propose`` feeds
whatever is queued in one causal pass (the first one is the drafter's prefill; a request that never
drafts, in a batch too loaded for drafting to pay, never pays for it). The last output is f^_R, the
predicted feature at the root, from which drafting starts. ``propose_chains`` does the same for many
sequences at once, then drafts each a greedy chain, one head pass per depth for all of them, over a head cache
with a row per sequence kept from step to step (``head_rows.py``).

Tree (EAGLE-2, ``selfspec/drafters/dynamic_tree.py``): a drafted node at depth d is pair R + d - 1, its
input its parent's output feature and its own token; the best ``max_nodes - 1`` nodes form the draft, and
the head's cache is then cropped back to the committed pairs.

Vocabulary: a head trained with a reduced draft vocabulary (EAGLE-3's ``d2t``) cannot propose a token
outside it, and replies reuse their context's rare words (names, identifiers, a prompt's ``>>>``
doctest lines). So each sequence drafts over ``d2t`` plus every context token outside it: the prompt's
and each committed token's LM-head rows are gathered as they arrive (a few hundred rows at most).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch import nn

from ..target.attention import static_attention
from ..drafters.base import DraftContext, DraftRequest, Drafter
from ..drafters.dynamic_tree import Candidates, grow_tree, select_tree
from ..errors import SelfspecError
from ..target.kv_cache import RowCache, truncate
from ..memory import kv_bytes_per_token, model_dtype
from ..memory import weight_numel
from ..target.packed_linear import linear, on_grid, pack_linears, pack_weight, packable
from ..tree import DraftTree, additive_mask, chain
from ..frozen import lm_head, lm_head_rows
from .eagle import EagleHead
from .head_rows import HeadRows


CATCH_UP_TOGETHER = 16  # a batch feeds queues up to this long in one head pass (each row padded to the longest);
# a longer one (a prompt, on a request's first draft) is fed alone: padding 16 rows to a 150-token prompt cost a
# 16-row batch of SmolLM2 ~10 ms a step, more than its drafts won
CONTEXT_ROWS_CACHED = 4096  # LM-head rows of context tokens kept for reuse (Qwen2.5-1.5B: 12 MB in bf16)


@dataclass
class EagleState:
    """The head's cache over pairs 0 .. cached-1, the features of pairs not fed yet, f^ at the root. The committed
    pairs live in ``cache`` (the first ``dense``) and, once the sequence drafts in a batch, in its row of the
    drafter's ``HeadRows`` (the first ``row_len``): one of the two holds them all (``head_rows.py``)."""

    cache: object
    cached: int = 0
    dense: int = 0  # pairs in ``cache``
    row: int = -1  # its row in the drafter's batch cache (-1: none)
    row_len: int = 0  # pairs in that row
    pending: torch.Tensor | None = None  # (m, H): features of pairs cached .. cached + m - 1
    root_feature: torch.Tensor | None = None  # (H,): the head's output for pair cached - 1
    context_ids: list[int] = field(default_factory=list)  # context tokens outside d2t, drafted too
    context_weight: torch.Tensor | None = None  # (len(context_ids), H): their LM-head rows
    context_bias: torch.Tensor | None = None
    draft_ids: torch.Tensor | None = None  # d2t + context_ids: target id of each drafted logit


def _append(rows: torch.Tensor | None, more: torch.Tensor) -> torch.Tensor:
    return more if rows is None else torch.cat([rows, more])


def _queued(state: EagleState) -> int:
    """Pairs queued for the head to feed."""
    return 0 if state.pending is None else state.pending.shape[0]


class EagleDrafter(Drafter):
    """Drafts EAGLE-2 dynamic trees with an :class:`EagleHead` on a frozen target."""

    name = "eagle"
    needs_hidden_states = True
    drafts_batches = True

    def __init__(self, target: nn.Module, head: EagleHead, top_k: int | None = None) -> None:
        self.target = target
        self.head = head.eval()
        self.top_k = top_k or head.config.top_k
        self.embed = target.get_input_embeddings()
        full = head.d2t.numel() == lm_head(target).out_features and bool(
            (head.d2t == torch.arange(head.d2t.numel(), device=head.d2t.device)).all())
        # a reduced draft vocabulary: the LM head's rows for it, gathered once (a copy of draft_vocab x H);
        # a full one: the target's own LM head, looked up at each use (the static pass may pack it later)
        self.lm_weight, self.lm_bias = lm_head_rows(target, head.d2t) if not full else (None, None)
        self.d2t = head.d2t.cpu()
        self.reduced = not full
        in_draft = torch.zeros(max(int(self.d2t.max()) + 1, lm_head(target).out_features), dtype=torch.bool)
        in_draft[self.d2t] = True  # target id -> in the draft vocabulary: a lookup, not an isin per token and row
        self.head.register_buffer("in_draft", in_draft, persistent=False)  # an index map beside d2t, not saved
        self.in_draft = self.head.in_draft
        self.row_cache: OrderedDict[int, tuple] = OrderedDict()  # token id -> its LM-head row (and bias), LRU
        self.head_rows = HeadRows(self._layer_config(), model_dtype(self.head), self.embed.weight.device)
        # on a CPU the head's matmuls run on oneDNN-packed weights, as the static target pass runs the target's
        # (memory-neutral: the packed tensors replace the dense ones; the head's state dict stays dense)
        self.dtype = model_dtype(self.head)  # before packing turns its linears' parameters into buffers
        pack_linears(self.head)
        if self.reduced and packable(self.head):
            self.lm_weight = pack_weight(self.lm_weight)

    @torch.no_grad()
    def start(self, ctx: DraftContext) -> EagleState:
        """Queue the prompt's pairs: the head feeds them (and gathers the LM-head rows of the prompt's tokens outside
        its draft vocabulary) at its first draft, so a request in a batch too loaded to draft never pays for it."""
        return self.observe(EagleState(self.head.new_cache()), ctx)

    def observe(self, state: EagleState, ctx: DraftContext) -> EagleState:
        """Queue the features of the positions the target just cached."""
        if ctx.hidden_states is None:
            return state
        feats = self._pair_features(ctx.hidden_states)
        state.pending = feats if state.pending is None else torch.cat([state.pending, feats])
        if state.cached + state.pending.shape[0] != ctx.cache_len:
            raise RuntimeError(f"eagle drafter out of step: {state.cached} pairs + {state.pending.shape[0]} "
                               f"queued != {ctx.cache_len} cached by the target")
        return state

    def _pair_features(self, hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The target's states the engine reported (``state_layers``) -> (n, F) features to queue."""
        return hidden_states[-1]

    def _fuse(self, feats: torch.Tensor) -> torch.Tensor:
        """Queued target features -> the head's feature input (the same here; EAGLE-3 fuses three layers)."""
        return feats

    def _add_context(self, state: EagleState, tokens: list[int]) -> None:
        """Let this sequence draft the given context tokens that the reduced vocabulary lacks."""
        if not self.reduced:
            return
        ids = torch.tensor(tokens, dtype=torch.long)
        new = sorted(set(ids[~self.in_draft[ids]].tolist()) - set(state.context_ids))
        if not new:
            return
        weight, bias = self._context_rows(new)
        state.context_ids += new
        state.context_weight = _append(state.context_weight, weight)
        state.context_bias = None if bias is None else _append(state.context_bias, bias)
        state.draft_ids = torch.cat([self.d2t, torch.tensor(state.context_ids, dtype=self.d2t.dtype)])

    def _context_rows(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The LM head's rows (and bias) for ``ids``, from the drafter's cache of recently used rows: a packed head
        unpacks a whole block of rows to read one (~10 ms for Qwen2.5's 16384 x 1536 blocks), and requests share
        their rare tokens (names, identifiers)."""
        missing = [i for i in ids if i not in self.row_cache]
        if missing:
            weight, bias = lm_head_rows(self.target, torch.tensor(missing))
            for j, i in enumerate(missing):  # copies: a view would keep all of ``weight`` alive while one row is cached
                self.row_cache[i] = (weight[j].clone(), None if bias is None else bias[j].clone())
        rows = [self.row_cache[i] for i in ids]
        for i in ids:
            self.row_cache.move_to_end(i)
        while len(self.row_cache) > CONTEXT_ROWS_CACHED:
            self.row_cache.popitem(last=False)
        bias = None if rows[0][1] is None else torch.stack([b for _, b in rows])
        return torch.stack([w for w, _ in rows]), bias

    def _logits(self, feats: torch.Tensor) -> torch.Tensor:
        """(n, H) features -> (n, draft_vocab) logits (the LM head's rows for the draft vocabulary)."""
        return linear(feats, self.lm_weight, self.lm_bias) if self.reduced else on_grid(lm_head(self.target), feats)

    def _with_context(self, state: EagleState, feats: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` with the sequence's context tokens outside the draft vocabulary appended."""
        if not state.context_ids:
            return logits
        return torch.cat([logits, linear(feats, state.context_weight, state.context_bias)], -1)

    def _log_probs(self, state: EagleState, feats: torch.Tensor) -> torch.Tensor:
        """(n, H) features -> (n, draft_vocab + context tokens) log-probabilities."""
        return self._with_context(state, feats, self._logits(feats)).float().log_softmax(-1)

    def _run(self, feats: torch.Tensor, tokens: list[int], positions: list[int], cache: object,
             mask: torch.Tensor | None = None) -> torch.Tensor:
        """One head pass over n pairs: (n, H) features + n tokens -> (n, H) predicted features."""
        device = feats.device
        ids = torch.tensor(tokens, device=self.embed.weight.device)
        embeds = self.embed(ids).to(device=device, dtype=feats.dtype)
        pos = torch.tensor(positions, device=device)[None]
        return self.head(feats[None], embeds[None], pos, cache, mask)[0]

    def _catch_up(self, state: EagleState, ctx: DraftContext) -> None:
        """Feed the queued pairs in one causal pass; the last output becomes the root's feature."""
        if state.pending is None or state.pending.shape[0] == 0:
            return
        self.head_rows.copy_out(state)  # pairs fed in a batch first: the cache appends after them
        m, start = state.pending.shape[0], state.cached
        tokens = ctx.tokens[start + 1:start + m + 1].tolist()  # x_{t+1} for each queued pair t; the last is the root
        self._add_context(state, ctx.tokens[start:start + m + 1].tolist())  # x_0 too at the first feed
        out = self._run(self._fuse(state.pending.to(self.dtype)), tokens, list(range(start, start + m)), state.cache)
        state.cached, state.pending, state.root_feature = start + m, None, out[-1]
        state.dense = state.cached

    def _top(self, state: EagleState, feats: torch.Tensor, k: int) -> tuple[list[list[int]], list[list[float]]]:
        """Top-k target token ids and their log-probabilities for each of (n, H) features."""
        top = self._log_probs(state, feats).topk(k, dim=-1)
        ids = self.d2t if state.draft_ids is None else state.draft_ids
        return ids[top.indices.cpu()].tolist(), top.values.cpu().tolist()

    def _grow(self, state: EagleState, root_feat: torch.Tensor, depth: int, budget: int) -> Candidates:
        """EAGLE-2 expansion (``grow_tree``): a node's input is its parent's output feature and its own token."""
        def run(tokens: list[int], parents: torch.Tensor, positions: list[int], mask: torch.Tensor) -> torch.Tensor:
            return self._run(parents, tokens, positions, state.cache, additive_mask(mask, root_feat.dtype))

        k = min(self.top_k, self.d2t.numel())
        return grow_tree(root_feat, state.cached, depth, budget, k, lambda outs, n: self._top(state, outs, n), run)

    @torch.no_grad()
    def propose(self, state: EagleState, ctx: DraftContext, req: DraftRequest) -> tuple[DraftTree, EagleState]:
        """A dynamic tree of at most ``req.max_depth`` levels and ``req.max_nodes`` nodes."""
        root = int(ctx.tokens[-1])
        self._catch_up(state, ctx)
        self.head_rows.copy_out(state)  # nothing was queued, but pairs fed in a batch may be missing here
        budget = req.max_nodes - 1
        if state.root_feature is None or req.max_depth < 1 or budget < 1:  # nothing fed yet: 1-token prompt
            return chain(root, []), state
        cand = self._grow(state, state.root_feature, req.max_depth, budget)
        truncate(state.cache, state.cached)  # drop the drafted pairs: only committed ones stay
        return select_tree(cand, root, budget, req.node_cost), state

    @torch.no_grad()
    def propose_chains(self, states: list[EagleState], ctxs: list[DraftContext], depths: list[int]
                       ) -> tuple[list[DraftTree], float]:
        """Greedy chains of ``depths[i]`` tokens for several sequences at once (a batch's step), and the seconds spent
        feeding what was queued before drafting (a prompt, pairs committed while the batch did not draft: a one-off,
        not what drafting to a depth costs). A queue longer than ``CATCH_UP_TOGETHER`` pairs (a new request's prompt)
        is fed on its own, the others in one head pass; then each depth is one head pass over all of them, each
        sequence in its row of the drafter's ``HeadRows`` attending over its own pairs (the new committed pairs stay
        in the row, the drafted ones are overwritten later)."""
        live = [i for i, state in enumerate(states)
                if depths[i] > 0 and (state.root_feature is not None or state.pending is not None)]
        drafts: list[list[int]] = [[] for _ in states]
        catch_up_s = 0.0
        if live:
            t0 = time.perf_counter()
            rows, depth = [states[i] for i in live], max(depths[i] for i in live)
            for state, i in zip(rows, live):  # a long queue (a new request's prompt) is fed on its own, not with every
                if _queued(state) > CATCH_UP_TOGETHER:  # row padded to it
                    self._catch_up(state, ctxs[i])
            queued = [_queued(state) for state in rows]
            cache = self.head_rows.place(rows, max(queued) + depth)
            if max(queued):
                self._feed_rows(rows, [ctxs[i] for i in live], queued, cache)
            catch_up_s = time.perf_counter() - t0
            index = torch.tensor([state.row for state in rows])
            feats = self._root_features(rows, index)
            base = self._row_lengths()
            for d in range(depth):
                tokens = self._greedy(rows, feats[index])
                for i, token in zip(live, tokens):
                    drafts[i].append(token)
                if d < depth - 1:
                    ids = torch.zeros(feats.shape[0], 1, dtype=torch.long)
                    ids[index, 0] = torch.tensor(tokens)
                    feats = self._run_rows(feats[:, None], ids, (base + d)[:, None], cache)[:, 0]
        trees = [chain(int(ctx.tokens[-1]), draft[:n]) for ctx, draft, n in zip(ctxs, drafts, depths)]
        for tree in trees:
            tree.source = self.name
        return trees, catch_up_s

    def release(self, state: EagleState) -> None:
        """The request ended: its row of the batch cache is freed."""
        if state is not None:
            self.head_rows.release(state)

    def _row_lengths(self) -> torch.Tensor:
        """Each claimed row's committed pairs: where its next pair goes (a row not drafting this step writes there
        too, past its pairs, where nobody reads it before it is overwritten)."""
        return torch.tensor([s.row_len if s is not None else 0 for s in self.head_rows.states()],
                            device=self.embed.weight.device)

    def _root_features(self, rows: list[EagleState], index: torch.Tensor) -> torch.Tensor:
        """(claimed rows, H): each drafting row's root feature in its row, zeros elsewhere."""
        roots = torch.stack([state.root_feature for state in rows])
        feats = roots.new_zeros(self.head_rows.rows, roots.shape[-1])
        feats[index] = roots
        return feats

    def _feed_rows(self, rows: list[EagleState], ctxs: list[DraftContext], queued: list[int], cache: RowCache
                   ) -> None:
        """One head pass over every claimed row feeding the queues of ``rows``, each padded to the longest (a padding
        query writes past its row's pairs, where the chain overwrites it before anyone sees it)."""
        m = max(queued)
        some = rows[queued.index(m)].pending
        feats = some.new_zeros(self.head_rows.rows, m, *some.shape[1:])
        tokens = torch.zeros(self.head_rows.rows, m, dtype=torch.long)
        for state, ctx, n in zip(rows, ctxs, queued):
            if n:
                feats[state.row, :n] = state.pending
                tokens[state.row, :n] = ctx.tokens[state.cached + 1:state.cached + n + 1]
                self._add_context(state, ctx.tokens[state.cached:state.cached + n + 1].tolist())
        at = self._row_lengths()[:, None] + torch.arange(m, device=feats.device)[None]
        out = self._run_rows(self._fuse(feats.to(self.dtype)), tokens, at, cache)
        for state, n in zip(rows, queued):
            if n:
                state.cached += n
                state.row_len, state.pending, state.root_feature = state.cached, None, out[state.row, n - 1]
            state.pending = None  # an empty queue (nothing committed since) is none

    def _greedy(self, rows: list[EagleState], feats: torch.Tensor) -> list[int]:
        """Each row's likeliest next token (target ids) from its (H,) feature: the draft vocabulary in one call."""
        logits = self._logits(feats)
        out = []
        for j, state in enumerate(rows):
            ids = self.d2t if state.draft_ids is None else state.draft_ids
            out.append(int(ids[int(self._with_context(state, feats[j], logits[j]).argmax())]))
        return out

    def _run_rows(self, feats: torch.Tensor, tokens: torch.Tensor, at: torch.Tensor, cache: RowCache
                  ) -> torch.Tensor:
        """One head pass over ``cache``: row j's pairs (features (rows, m, F), tokens (rows, m)) at positions and
        slots ``at`` (rows, m), each seeing its row's slots up to its own -> (rows, m, H) predicted features. The mask
        is as wide as the furthest slot written: attention reads no slot beyond."""
        width = int(at.max()) + 1
        seen = torch.arange(width, device=at.device)[None, None] <= at[:, :, None]
        mask = torch.where(seen, 0.0, torch.finfo(feats.dtype).min).to(feats.dtype)[:, None]
        cache.write = at
        embeds = self.embed(tokens.to(self.embed.weight.device)).to(device=feats.device, dtype=feats.dtype)
        with static_attention(self._layer_config()) as cut:  # K/V read in place, never copied per query head
            if not cut:  # another attention the user chose: it reads every slot, so the mask covers them all
                mask = torch.nn.functional.pad(mask, (0, cache.layers[0].keys.shape[2] - width),
                                               value=torch.finfo(feats.dtype).min)
            return self.head(feats, embeds, at, cache, mask)

    def extra_parameters(self) -> int:
        """The head's trained parameters plus the gathered LM-head rows of a reduced draft vocabulary (a copy)."""
        return weight_numel(self.head) + (self.lm_weight.numel() if self.reduced else 0)

    def _layer_config(self):
        """The config of the head's one decoder layer (its KV cache's shape)."""
        return self.head.decoder.config

    def kv_bytes_per_token(self) -> int:
        """The head's one-layer KV cache."""
        return kv_bytes_per_token(self._layer_config(), self.dtype)


class Eagle3Drafter(EagleDrafter):
    """EAGLE-2 dynamic trees from an :class:`~selfspec.heads.eagle3.Eagle3Head`: it reads three of the target's
    layers (fused by its ``fc``) and drafts over its own LM head's draft vocabulary (no context rows: its LM head
    is trained, not the target's)."""

    name = "eagle3"

    def __init__(self, target: nn.Module, head: nn.Module, top_k: int | None = None) -> None:
        self.target = target
        self.head = head.eval()
        self.top_k = top_k or head.config.top_k
        self.embed = target.get_input_embeddings()
        self.state_layers = tuple(head.config.aux_layers)
        self.d2t = head.draft_ids().cpu()
        self.reduced = False  # nothing to add: tokens outside the draft vocabulary are never proposed
        self.dtype = model_dtype(self.head)
        self.head_rows = HeadRows(self._layer_config(), self.dtype, self.embed.weight.device)
        pack_linears(self.head)  # fc, attention, MLP and the LM head on oneDNN's layout on a CPU

    def _pair_features(self, hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        if len(hidden_states) != len(self.state_layers):
            raise SelfspecError(f"the eagle3 drafter reads the target's layers {list(self.state_layers)} but was given "
                                f"{len(hidden_states)} state tensor(s): a drafter wrapping it must pass on its "
                                "state_layers")
        return torch.cat(hidden_states, dim=-1)

    def _fuse(self, feats: torch.Tensor) -> torch.Tensor:
        return self.head.fuse(feats)

    def _logits(self, feats: torch.Tensor) -> torch.Tensor:
        return self.head.logits(feats)

    def extra_parameters(self) -> int:
        """The head's trained parameters (its LM head included)."""
        return weight_numel(self.head)

    def _layer_config(self):
        """The midlayer's config."""
        return self.head.layer_config
