"""Continuous batching: many requests decoded together, one target pass per step for all of them.

    batch = BatchEngine(model, drafter, tokenizer, max_batch=8, context=2048)
    a = batch.add(prompt_ids, DecodeConfig(max_new_tokens=64))
    while batch.busy:
        for req, new in batch.step():     # the tokens each request committed this step
            ...
    batch.generate_batch([ids1, ids2, ...], cfg)   # the same, to completion

A step: requests waiting for a row take one (prompts are cached in chunks, at most ``PREFILL_BUDGET`` tokens a
step, so a long prompt holds the others up a chunk or two per step, not its whole prefill); every decoding request drafts
(``Request.draft``, each with its drafter's own state), all trees are verified in **one** pass over the batch
cache (``RowPass.verify_batch``), then each request accepts, commits and checks its stop conditions on its own
(``Request.advance``). Requests that finish or were cancelled give their row back before the next step.

How deep requests draft: a batch of one drafts as ``SpeculativeEngine`` does (its own adaptive policy; a batch of
one is exactly the single-request engine); from two requests on, the ``Budget`` picks one depth for the step
from the measured cost of passes of this many rows (``selfspec/budget.py``), down to 0 (plain batched decoding)
when drafting cannot pay; a request with ``adaptive=False`` (``--fixed-tree``) drafts its full depth regardless.
Heads (behind prompt lookup or not) then draft every row's chain together: one head pass per depth for the
whole batch (``propose_chains``), instead of a head pass per request per depth, which at 4 rows cost more than
the tokens it won.
Outputs do not depend on the depth: each request's tokens are those it gets alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from .budget import Budget
from .context import check_request, context_length
from .engine import GenerationResult, SpeculativeEngine
from .errors import SelfspecError
from .prefix_cache import PrefixCache
from .request import DecodeConfig, DecodeState, Request, sync_device
from .stats import GenerationStats
from .target import RowPass
from .target.common import PREFILL_CHUNK
from .target.cost import PassCost
from .tree import chain

DEFAULT_CONTEXT = 4096  # positions per request when the model allows as many (prompt + new tokens)
PREFILL_BUDGET = 2 * PREFILL_CHUNK  # prompt tokens cached per step at most (whole chunks): the others' stall
PREFIX_CACHE_BYTES = 256 * 2**20  # prompts' KV kept for reuse by default (least recently used dropped first)


def default_context(config) -> int:
    """Positions per request when none is asked for: the model's own, at most ``DEFAULT_CONTEXT``."""
    return min(context_length(config) or DEFAULT_CONTEXT, DEFAULT_CONTEXT)


@dataclass
class StepStats:
    """What one batched step did, once for all its rows (a request's own stats count the shared pass too)."""

    rows: int = 0  # requests in the pass
    drafted: int = 0  # draft tokens it verified, all rows together
    draft_s: float = 0.0  # drafting every row's tree
    pass_s: float = 0.0  # the one target pass


@dataclass
class Joining:
    """A request with a row, its prompt cached chunk by chunk."""

    req: Request
    slot: object
    done: int = 0  # prompt tokens cached so far
    hidden: list | None = None  # the drafter's layers' states, chunk by chunk


class BatchEngine:
    """Lossless speculative decoding of many requests at once (any drafter, or none: plain batched decoding).

    ``max_batch`` requests decode together, each of at most ``context`` positions (prompt + new tokens; default the
    model's own, at most ``DEFAULT_CONTEXT``); more wait for a row. ``exact``: every request's tokens are
    bit-identical to its plain decoding alone, whoever shares its batch, where this device's self-test allows.
    ``prefix_cache``: bytes of prompts' KV kept for later prompts that start the same way (``PrefixCache``; 0: none);
    kept only where prompts are cached exactly (``RowPass.exact_prefill``), so reuse never changes a token.
    """

    def __init__(self, model: torch.nn.Module, drafter=None, tokenizer=None, max_batch: int = 8,
                 context: int | None = None, exact: bool = True, memory_bytes: int | None = None,
                 prefix_cache: int = PREFIX_CACHE_BYTES) -> None:
        limit = context_length(model.config)
        if context and limit and context > limit:
            raise SelfspecError(f"a context of {context:,} positions per request (--max-context) exceeds the "
                                f"{limit:,} the model reads (max_position_embeddings)")
        context = context or default_context(model.config)
        self.target = RowPass(model, max_batch, context, exact=exact, memory_bytes=memory_bytes)
        self.engine = SpeculativeEngine(model, drafter, tokenizer, backend=self.target)
        self.model, self.drafter, self.tokenizer = model, drafter, tokenizer
        self.budget = Budget(PassCost(self.target.pass_shape))
        self.prefix = PrefixCache(prefix_cache) if prefix_cache and self.target.exact_prefill else None
        self.waiting: list[Request] = []
        self.joining: list[Joining] = []
        self.running: list[Request] = []
        self.last_step = StepStats()  # the last step that ran a pass

    @property
    def max_batch(self) -> int:
        return self.target.max_batch

    @property
    def context(self) -> int:
        """Positions per request (prompt + new tokens)."""
        return self.target.context

    @property
    def busy(self) -> bool:
        """Requests waiting, joining or decoding."""
        return bool(self.waiting or self.joining or self.running)

    def check_config(self, cfg: DecodeConfig) -> None:
        """Refuse, as one line, settings this engine cannot run."""
        self.engine.check_config(cfg)

    def check_request(self, prompt_tokens: int, max_new_tokens: int) -> None:
        """Refuse (``ContextError``, one line) a request longer than the model reads or a row holds."""
        check_request(self.model.config, prompt_tokens, max_new_tokens, self.context)

    def add(self, prompt: torch.Tensor | list[int], cfg: DecodeConfig | None = None,
            stats: GenerationStats | None = None) -> Request:
        """Queue a request (checked now: a bad prompt or settings raise ``SelfspecError`` here, not mid-batch)."""
        req = Request(self.engine, prompt, cfg or DecodeConfig(), stats, context=self.context)
        self.waiting.append(req)
        return req

    def swap_drafter(self, drafter) -> None:
        """Draft new requests with ``drafter`` (newer heads for the same target); requests in flight keep the drafter
        they started with (its state is theirs), so no output changes (every output is the target's either way).
        Refused, as one line, when it reads other target layers than the drafter it replaces (rows share a pass)."""
        old = self.drafter
        layers = lambda d: d.state_layers if d is not None and d.needs_hidden_states else ()  # noqa: E731
        if layers(drafter) != layers(old):
            raise SelfspecError(f"the new drafter reads the target's layers {list(layers(drafter))}, the serving one "
                                f"{list(layers(old))}: heads of another family or layout need a restart")
        self.drafter = self.engine.drafter = drafter

    def cancel(self, req: Request) -> None:
        """Stop ``req``: it gives its row back at the next step."""
        req.cancelled = True

    def step(self) -> list[tuple[Request, list[int]]]:
        """One step of the whole batch: (request, tokens it committed) for every request that decoded."""
        self._leave()
        self._join()
        if not self.running:
            return []
        rows = self.running
        t0 = time.perf_counter()
        trees = self._draft(rows)
        draft_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        vers = self.target.verify_batch([(row.state.cache, tree) for row, tree in zip(rows, trees)],
                                        rows[0].need_hidden)
        sync_device(self.target.device)
        seconds = time.perf_counter() - t0
        self.budget.cost.record(*self.target.last_shape, seconds)
        self.last_step = StepStats(len(rows), sum(tree.size - 1 for tree in trees), draft_s, seconds)
        out = []
        for row, tree, ver in zip(rows, trees, vers):
            out.append((row, row.advance(self.target, tree, ver, seconds)))
            if not row.finished:
                row.observe(self.target)
        self._leave()
        return out

    def calibrate(self, reps: int = 2) -> dict[int, float]:
        """Time passes of 1, 2, 4, ... tokens (rows of one token each up to ``max_batch``, then one row's chain up
        to the largest bucket) so that the budget starts from this machine's costs; seconds by tokens. Needs every
        row free (call it before serving)."""
        if self.busy:
            raise SelfspecError("calibrate the batch engine before any request is added")
        slots = [self.target.new_cache(2) for _ in range(self.max_batch)]
        try:
            shapes = [(n, 1) for n in (1, 2, 4, 8, 16, 32, 64) if n <= self.max_batch]
            shapes += [(1, b) for b in self.target.buckets if b > 1]
            for n, b in shapes:
                for rep in range(reps + 1):  # the first of each shape warms up
                    t0 = time.perf_counter()
                    self.target.verify_batch([(slot, chain(0, [0] * (b - 1))) for slot in slots[:n]], ())
                    sync_device(self.target.device)
                    if rep:
                        self.budget.cost.record(*self.target.last_shape, time.perf_counter() - t0)
        finally:
            for slot in reversed(slots):
                self.target.release(slot)
        return dict(sorted(self.budget.cost.curve.items()))

    def reset(self) -> None:
        """Drop every request (after a failed step: their state is not to be trusted) and free every row."""
        for req in [*self.waiting, *(j.req for j in self.joining), *self.running]:
            req.cancelled = True
        for slot in list(self.target.claimed):
            self.target.release(slot)
        for req in [*self.waiting, *(j.req for j in self.joining), *self.running]:
            req.close()
        self.waiting, self.joining, self.running = [], [], []

    def _draft(self, rows: list[Request]) -> list:
        """Every row's tree: alone, as its own policy says; in a batch, at the budget's depth (a request with
        ``adaptive=False`` always drafts its full depth). A drafter that drafts many sequences at once
        (``drafts_batches``: heads, behind prompt lookup or not) gives every row a chain, one head pass per depth
        for the whole batch."""
        if len(rows) == 1:
            return [rows[0].draft()]
        chains = (self.drafter is not None and self.drafter.drafts_batches and all(row.cfg.adaptive for row in rows)
                  and all(row.drafter is self.drafter for row in rows))  # during a swap: each row drafts on its own
        depth = self.budget.depth(rows, chains)
        if chains and depth:
            t0 = time.perf_counter()
            trees, catch_up_s = self.drafter.propose_chains([row.dstate for row in rows], [row.ctx for row in rows],
                                                            [min(depth, row.max_depth) for row in rows])
            # what drafting to this depth costs from step to step: the depth passes, and a feed of one step's
            # pairs like one of them; not this step's catch-up (a prompt, pairs queued while the batch did not
            # draft), which would make the budget's per-depth cost, and so its next choices, too high
            steady = (time.perf_counter() - t0 - catch_up_s) * (depth + 1) / depth
            share = steady / len(rows)
            return [row.drafted(tree, share) for row, tree in zip(rows, trees)]
        cost = self.budget.node_cost(len(rows))
        return [row.draft(depth if row.cfg.adaptive else row.max_depth, cost) for row in rows]

    def _leave(self) -> None:
        """Requests that finished or were cancelled give their rows back (joining ones too)."""
        for row in [r for r in self.running if r.finished or r.cancelled]:
            self.running.remove(row)
            self._release(row, row.state.cache)
        for job in [j for j in self.joining if j.req.cancelled]:
            self.joining.remove(job)
            self._release(job.req, job.slot)
        for req in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(req)
            req.close()

    def _release(self, req: Request, slot) -> None:
        self.target.release(slot)
        req.close()

    def _join(self) -> None:
        """Waiting requests take free rows; prompt chunks are cached, up to ``PREFILL_BUDGET`` tokens a step (whole
        chunks, each request's own forward: its cache bits do not depend on who joins with it); a request whose
        prompt is all cached starts decoding this step."""
        while self.waiting and self.target.free:
            req = self.waiting.pop(0)
            req.join()
            job = Joining(req, self.target.new_cache(req.max_len))
            self._reuse(job)
            self.joining.append(job)
        budget = PREFILL_BUDGET
        for job in list(self.joining):
            prompt = job.req.ids[:-1]  # the last prompt token is the first root
            while job.done < prompt.numel() and budget > 0:
                chunk = prompt[job.done:job.done + PREFILL_CHUNK]
                states = self.target.prefill_chunk(job.slot, chunk, job.done, job.req.need_hidden)
                job.done += chunk.numel()
                budget -= chunk.numel()
                if job.req.need_hidden:
                    job.hidden = [*(job.hidden or []), states]
            if job.done < prompt.numel():
                return
            self.joining.remove(job)
            hidden = tuple(torch.cat(parts) for parts in zip(*job.hidden)) if job.hidden else None
            self._keep(job, prompt, hidden)
            job.req.prefilled(DecodeState(job.req.ids.clone(), job.slot, job.req.ids.numel()), hidden, self.target)
            self.running.append(job.req)

    def _reuse(self, job: Joining) -> None:
        """Start ``job`` from the longest cached prefix of its prompt (its K/V and the drafter's states copied)."""
        if self.prefix is None:
            return
        n, entry = self.prefix.match(job.req.ids[:-1], job.req.need_hidden)
        if entry is not None:
            self.target.write_prefix(job.slot, entry.keys, entry.values, n)
            job.done = job.req.stats.cached_prompt_tokens = n
            job.hidden = [tuple(entry.hidden[i][:n] for i in job.req.need_hidden)] if job.req.need_hidden else None

    def _keep(self, job: Joining, prompt: torch.Tensor, hidden: tuple | None) -> None:
        """Keep a prompt just cached for later ones (its K/V and the drafter's states)."""
        if self.prefix is not None and prompt.numel():
            keys, values = self.target.read_prefix(job.slot, prompt.numel())
            self.prefix.add(prompt, keys, values, dict(zip(job.req.need_hidden, hidden)) if hidden else None)

    def generate_batch(self, prompts: list, cfg: DecodeConfig | None = None, progress: bool = False
                       ) -> list[GenerationResult]:
        """Decode every prompt (token ids) to completion, ``max_batch`` at a time; results in the prompts' order.
        ``progress``: a progress bar of finished requests (on stderr)."""
        reqs = [self.add(p, cfg) for p in prompts]
        tokens: dict[int, list[int]] = {id(r): [] for r in reqs}
        with tqdm(total=len(reqs), desc="generate", unit="prompt", disable=not progress) as bar:
            while self.busy:
                for req, new in self.step():
                    tokens[id(req)] += new
                    bar.update(req.finished)
        decode = self.tokenizer.decode if self.tokenizer is not None else None
        return [GenerationResult(tokens[id(r)], decode(tokens[id(r)], skip_special_tokens=True) if decode else None,
                                 r.stats) for r in reqs]
