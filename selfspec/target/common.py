"""What every preallocated target pass shares: tree-size buckets, masks, the model's parts and the decoder call."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..errors import SelfspecError
from ..verify import cache_kwarg
from . import decoder as loop
from .packed_linear import is_packed, pack_linears

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # nodes (root included) a row's tree is padded to: one compiled graph each
CACHE_STEP = 512  # a growable cache grows in multiples of this (compiled: each size is another set of graphs)
PREFILL_CHUNK = 256  # prompts are cached this many tokens per forward (a batch's other rows wait one chunk at most)


def bucket_for(n: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket holding ``n`` nodes."""
    for b in buckets:
        if b >= n:
            return b
    raise SelfspecError(f"a draft tree of {n} nodes exceeds the largest bucket a target pass runs ({buckets[-1]}); "
                        "lower --max-nodes")


def ancestor_block(parents: list[int], bucket: int) -> torch.Tensor:
    """(bucket, bucket) bool: node i may see node j (j is i or an ancestor of i); padding rows see themselves."""
    own = torch.eye(bucket, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            own[i] |= own[p]  # parents come first, so own[p] already holds p's ancestors
    return own


def static_mask(block: torch.Tensor, cache_len: int, width: int, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
    """Additive mask (1, 1, b, width): every row sees slots < cache_len and, at cache_len.., its ``block`` row;
    slots from ``width`` on are not attended at all (``selfspec/target/attention.py`` cuts K/V to the mask)."""
    b = block.shape[0]
    mask = torch.full((b, width), torch.finfo(dtype).min, dtype=dtype, device=device)
    mask[:, :cache_len] = 0
    mask[:, cache_len:cache_len + b].masked_fill_(block.to(device), 0)
    return mask[None, None]


def grown(need: int, limit: int | None, pad: int) -> int:
    """Slots for a cache that must hold ``need``: rounded up to ``CACHE_STEP``, no more than the model's positions
    (``limit``) plus ``pad`` (what a pass may write past a request's last position) unless ``need`` is more."""
    slots = -(-need // CACHE_STEP) * CACHE_STEP
    return max(min(slots, limit + pad), need) if limit else slots


@dataclass
class Target:
    """The model's parts a pass calls: its decoder, its LM head and the name of the decoder's cache argument. On a
    CPU the linears are packed into oneDNN's layout first (``pack``; memory-neutral, reversible)."""

    model: torch.nn.Module
    pack: bool = True

    def __post_init__(self) -> None:
        if self.pack:
            pack_linears(self.model)
        self.packed = is_packed(self.model)
        self.device = next(self.model.parameters()).device
        self.dtype = next(p.dtype for p in self.model.parameters() if p.is_floating_point())
        self.decoder = self.model.get_decoder()
        self.kwarg = cache_kwarg(type(self.decoder))
        self.loop = loop.DecoderLoop(self.decoder) if loop.wanted() and loop.fits(self.decoder) is None else None

    def parts(self) -> tuple[torch.nn.Module, torch.device, torch.dtype, bool]:
        """(model, device, dtype, packed): what a pass keeps of its target."""
        return self.model, self.device, self.dtype, self.packed

    @property
    def head(self) -> torch.nn.Module:
        """The LM head (read each time: the exact pass may bound a dense one, which makes it another module)."""
        return self.model.get_output_embeddings()

    def forward(self, cache, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                layers: tuple[int, ...] = (), plan=None, logits: bool = True
                ) -> tuple[torch.Tensor | None, tuple[torch.Tensor, ...]]:
        """(rows, b) tokens at (rows, b) positions under ``mask`` -> logits (rows, b, V) (None if not ``logits``) and
        the states (rows, b, H) of ``layers`` (indices into ``hidden_states``; only the final one needs no extra
        outputs). ``plan``: every row attends as the exact pass's plan says (``selfspec/target/exact.py``), through
        the decoder loop (``selfspec/target/decoder.py``) once its first pass matched the model's own forward."""
        states = any(i != -1 for i in layers)
        looped = plan is not None and self.loop is not None and self.loop.trusted is not False
        if looped and self.loop.trusted is None:  # the first pass: compared with the model's own forward once
            looped = self.loop.trusted = self._loop_agrees(ids, positions, mask, cache, plan, states)
        if looped:
            h, hidden = self.loop(ids, positions, cache, plan, states)
        else:
            h, hidden = self._decoder(ids, positions, mask, cache, plan, states)
        return (self.head(h) if logits else None), tuple(h if i == -1 else hidden[i] for i in layers)

    def _decoder(self, ids, positions, mask, cache, plan, states: bool) -> tuple[torch.Tensor, tuple]:
        """The model's own decoder forward: (final normed states, ``hidden_states`` if ``states``)."""
        extra = {} if plan is None else {"selfspec_exact": plan}
        out = self.decoder(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=True,
                           output_hidden_states=states, **{self.kwarg: cache}, **extra)
        return out.last_hidden_state, out.hidden_states or ()

    def _loop_agrees(self, ids, positions, mask, cache, plan, states: bool) -> bool:
        """Whether the decoder loop agrees with the model's own forward on this pass (both run; the pass that
        counts runs after, so the cache holds its K/V)."""
        ref, ref_hidden = self._decoder(ids, positions, mask, cache, plan, states)
        h, hidden = self.loop(ids, positions, cache, plan, states)
        same = self.loop.agrees(h, ref) and all(self.loop.agrees(a, b) for a, b in zip(hidden, ref_hidden))
        if not same:
            log.warning("the decoder loop (selfspec/target/decoder.py) computed other states than %s's own forward: "
                        "the model's forward runs every pass", type(self.decoder).__name__)
        return same
