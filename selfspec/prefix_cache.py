"""Prompts already seen: their KV (and the drafter's layers' states) kept, reused by a later prompt that starts the
same way (the same question again, a chat's shared system prompt, the earlier turns of a conversation).

    cache = PrefixCache(256 * 2**20)              # bytes it may hold; least recently used entries go first
    n, entry = cache.match(prompt, layers)        # tokens of ``prompt`` an entry holds (0: none)
    cache.add(prompt, keys, values, hidden)       # after a prompt is cached: (layers, kv_heads, n, head_dim) each

Exact by construction, not by luck: the batch engine keeps entries only where every prompt token is cached as its
plain step computes it (``RowPass.exact_prefill``: the row attention kernel, linears self-tested for the
prompt's row counts), so a token's K/V depend on the tokens before it and nothing else, and reused K/V are the bits
a fresh prefill would write. A request with a reused prefix decodes the tokens it decodes without one.
"""

from __future__ import annotations

import mmap
from collections import OrderedDict
from dataclasses import dataclass

import torch

MIN_REUSE = 8  # a shorter common prefix is recomputed (copying it costs about what computing it does)
OWN_PAGES_MIN = 64 * 2**10  # bytes: a CPU tensor this large or larger is kept in pages of its own (``own_pages``)


@dataclass
class Entry:
    tokens: torch.Tensor  # (n,) long, on the CPU
    keys: torch.Tensor  # (layers, kv_heads, n, head_dim)
    values: torch.Tensor
    hidden: dict[int, torch.Tensor]  # the drafter's layers' states (n, hidden) by layer index

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.tokens, self.keys, self.values, *self.hidden.values()))


def own_pages(t: torch.Tensor) -> torch.Tensor:
    """``t`` copied into memory mapped for it alone, unmapped the moment the copy is freed (CPU tensors of
    ``OWN_PAGES_MIN`` bytes or more; others as they are).

    Entries live for minutes and leave in another order than they came, 1-4 MiB each. Carved from the C heap, as
    glibc carves every block below the largest it has freed (up to 32 MiB), blocks like that leave holes that the
    step's short-lived buffers only partly fill: free memory the server keeps, ~1 MiB more a minute through an
    hour's soak (SmolLM2). In pages of their own they go back to the system whole, and the heap keeps what comes
    and goes within a step."""
    if t.device.type != "cpu" or t.nbytes < OWN_PAGES_MIN:
        return t
    private = {"flags": mmap.MAP_PRIVATE} if hasattr(mmap, "MAP_PRIVATE") else {}  # as malloc maps (not Windows)
    try:
        pages = mmap.mmap(-1, t.nbytes, **private)
    except OSError:  # out of mappings (vm.max_map_count) or memory: the heap, as before
        return t
    return torch.frombuffer(pages, dtype=t.dtype, count=t.numel()).view(t.shape).copy_(t)  # the tensor holds the map


def common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    m = min(a.numel(), b.numel())
    differ = (a[:m] != b[:m]).nonzero()
    return int(differ[0]) if differ.numel() else m


class PrefixCache:
    """Prompts' KV up to ``max_bytes`` in all (least recently used dropped first); ``hits`` and ``reused`` (tokens not
    recomputed) count what it saved."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.entries: OrderedDict[int, Entry] = OrderedDict()
        self.nbytes = 0
        self.hits = 0
        self.reused = 0
        self._ids = 0

    def match(self, prompt: torch.Tensor, layers: tuple[int, ...] = ()) -> tuple[int, Entry | None]:
        """The entry sharing the longest prefix with ``prompt`` (1-D) among those holding ``layers``' states, and how
        many tokens it shares: (0, None) under ``MIN_REUSE``."""
        best, found = 0, None
        for key, entry in self.entries.items():
            if all(i in entry.hidden for i in layers):
                n = common_prefix(entry.tokens, prompt)
                if n > best:
                    best, found = n, key
        if best < MIN_REUSE:
            return 0, None
        self.entries.move_to_end(found)
        self.hits += 1
        self.reused += best
        return best, self.entries[found]

    def add(self, prompt: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
            hidden: dict[int, torch.Tensor] | None = None) -> None:
        """Keep ``prompt``'s K/V (layers, kv_heads, n, head_dim) and its states; entries it extends are dropped."""
        entry = Entry(prompt.cpu().clone(), keys, values, dict(hidden or {}))
        if prompt.numel() < MIN_REUSE or entry.nbytes > self.max_bytes:
            return
        for key in [k for k, e in self.entries.items() if e.tokens.numel() <= prompt.numel()
                    and common_prefix(e.tokens, entry.tokens) == e.tokens.numel()
                    and e.hidden.keys() <= entry.hidden.keys()]:
            self._drop(key)
        if any(common_prefix(e.tokens, entry.tokens) == prompt.numel() and entry.hidden.keys() <= e.hidden.keys()
               for e in self.entries.values()):
            return  # an entry already holds all of it
        self._ids += 1
        self.entries[self._ids] = Entry(entry.tokens, own_pages(keys), own_pages(values),
                                        {i: own_pages(h) for i, h in entry.hidden.items()})
        self.nbytes += entry.nbytes
        while self.nbytes > self.max_bytes:
            self._drop(next(iter(self.entries)))

    def _drop(self, key: int) -> None:
        self.nbytes -= self.entries.pop(key).nbytes

    def __len__(self) -> int:
        return len(self.entries)
