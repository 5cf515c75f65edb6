"""One request's decoding, step by step: the per-request halves of a step around the target's pass.

Invariant between steps: the target's KV cache holds ``tokens[:-1]``; ``tokens[-1]`` (the *root*)
is committed but not yet processed. A step feeds root + draft tree to the target in one pass, so a
step with an empty draft is exactly a plain decoding step.

    req = Request(engine, prompt, cfg)      # checks, seeds, the depth policy, EOS and stop strings
    req.prefilled(*prefill(...))            # the target cached the prompt: the drafter starts
    loop:
        tree = req.draft()                  # before the pass: this request's draft tree
        ver = <one target pass>             # over this request's tree alone, or every row of a batch
        new = req.advance(target, tree, ver, seconds)   # accept, commit, stop checks, stats
        req.observe()                       # the drafter learns what was committed (unless finished)

``SpeculativeEngine.steps`` runs one request this way; ``BatchEngine`` (``selfspec/batching.py``) runs many,
their trees verified together in one pass.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field

import torch

from .acceptance import accept_greedy, accept_sampling
from .adaptive import AdaptiveDepth, DepthPolicy
from .target.cost import PassCost
from .context import check_request
from .drafters.base import DraftContext, DraftRequest, Drafter
from .dtypes import dtype_name
from .errors import SelfspecError
from .memory import counted_bytes, model_dtype
from .sampling import SamplingConfig, greedy_tokens, logits_to_probs
from .stats import GenerationStats
from .stopping import StopTokens, truncate_at_stop
from .target import EagerPass
from .tree import DraftTree, chain
from .verify import Verification


@dataclass
class DecodeConfig:
    """Settings of one request."""

    max_new_tokens: int = 128
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    eos_token_ids: tuple[int, ...] | None = None  # None: the model's generation config
    stop_strings: tuple[str, ...] = ()
    max_depth: int = 16  # deepest draft (the adaptive controller picks up to this; chains are capped by max_nodes)
    max_nodes: int = 16  # largest tree, root included
    adaptive: bool = True  # False: always draft max_depth
    seed: int | None = None
    remember: bool = True  # a drafter that learns across requests (suffix) may keep this answer (not with "store": false)
    scope: str | None = None  # ... and keeps it for, and drafts from, requests of this scope only (an API key's)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise SelfspecError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.max_depth < 0 or self.max_nodes < 1:
            raise SelfspecError("max_depth must be >= 0 and max_nodes >= 1")
        if any(not s for s in self.stop_strings):
            raise SelfspecError("stop strings must be non-empty")


@dataclass
class DecodeState:
    """Tokens so far (prompt + generated, on CPU) and the target cache holding all but the last."""

    tokens: torch.Tensor
    cache: object
    prompt_len: int

    @property
    def cache_len(self) -> int:
        """Positions in the target cache."""
        return self.tokens.numel() - 1


def sync_device(device: torch.device) -> None:
    """Wait for queued GPU work (a no-op on the CPU), so wall-clock timings are true."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prefill(model: torch.nn.Module, prompt: torch.Tensor, layers: tuple[int, ...] = (), target=None, max_len: int = 0
            ) -> tuple[DecodeState, tuple | None]:
    """Cache the prompt except its last token (the first root). Returns the state and, if asked, the hidden states of
    ``layers`` (indices into transformers' ``hidden_states``: -1 is the final, normed one).

    ``target``: the target pass (default: eager); ``max_len``: the most positions the request will cache.
    """
    target = target or EagerPass(model)
    cache = target.new_cache(max(max_len, prompt.numel()))
    hs = None
    if prompt.numel() > 1:
        hs = target.prefill(cache, prompt[:-1], layers)
    return DecodeState(prompt.clone(), cache, prompt.numel()), hs


def draft(drafter: Drafter | None, dstate, ctx: DraftContext, depth: int, policy: DepthPolicy, cfg: DecodeConfig,
          gen: torch.Generator, node_cost=None) -> tuple[DraftTree, object]:
    """Ask the drafter for a tree of at most ``depth`` levels, each of its sources as deep as ``policy``
    says pays; depth 0 (or no drafter) gives the bare root. ``node_cost``: what an n-node pass costs in plain
    passes (default: the policy's measurements, when it adapts)."""
    root = int(ctx.tokens[-1])
    if drafter is None or depth == 0:
        return chain(root, []), dstate
    req = DraftRequest(depth, cfg.max_nodes, cfg.sampling, gen, depth_for=policy.choose, rate_for=policy.rate,
                       node_cost=node_cost or (policy.node_cost if policy.enabled else None))
    tree, dstate = drafter.draft(dstate, ctx, req)
    return within_limits(drafter, tree, depth, cfg.max_nodes, root), dstate


def within_limits(drafter: Drafter, tree: DraftTree, depth: int, max_nodes: int, root: int) -> DraftTree:
    """``tree``, if the drafter kept to the limits it was given (else a drafter bug, said in one line)."""
    if tree.max_depth > depth or tree.size > max_nodes or int(tree.tokens[0]) != root:
        raise SelfspecError(f"drafter '{drafter.name}' broke its limits (depth {tree.max_depth} > {depth}, "
                            f"or {tree.size} nodes > {max_nodes}, or a wrong root)")
    return tree


def accept(tree: DraftTree, ver: Verification, sampling: SamplingConfig, gen: torch.Generator) -> tuple[list[int], int]:
    """Accepted path (tree indices, root excluded) and the target's next token."""
    if sampling.greedy:
        return accept_greedy(tree, greedy_tokens(ver.logits).tolist())
    return accept_sampling(tree, logits_to_probs(ver.logits, sampling), gen)


def commit(target, state: DecodeState, tree: DraftTree, path: list[int], bonus: int
           ) -> tuple[DecodeState, list[int]]:
    """Keep root + accepted path in the cache (compacted), append accepted tokens + bonus to the sequence."""
    target.keep(state.cache, state.cache_len, [0, *path])
    new = [int(tree.tokens[i]) for i in path] + [bonus]
    tokens = torch.cat([state.tokens, torch.tensor(new, dtype=torch.long)])
    return DecodeState(tokens, state.cache, state.prompt_len), new


def eos_ids(model: torch.nn.Module, cfg: DecodeConfig) -> set[int]:
    """EOS ids from the request, else the model's generation config, else its config."""
    if cfg.eos_token_ids is not None:
        return set(cfg.eos_token_ids)
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            return set(eos) if isinstance(eos, (list, tuple)) else {eos}
    return set()


class Request:
    """Everything one request's decoding keeps between steps. ``engine``: a ``SpeculativeEngine`` (its model,
    drafter, tokenizer and target pass); the prompt and ``cfg`` are checked here, before anything runs."""

    def __init__(self, engine, prompt: torch.Tensor | list[int], cfg: DecodeConfig,
                 stats: GenerationStats | None = None, context: int | None = None) -> None:
        self.started = self.joined = time.perf_counter()
        self.cfg, self.stats = cfg, stats if stats is not None else GenerationStats()
        self.stats.dtype, self.stats.target_pass = dtype_name(model_dtype(engine.model)), engine.target.name
        self.stats.exact = engine.target.exact
        self.ids = engine.prompt_tensor(prompt)
        check_request(engine.model.config, self.ids.numel(), cfg.max_new_tokens, context)  # before anything runs
        engine.check_config(cfg)
        self.device, self.drafter = engine.device, engine.drafter
        self.gen = torch.Generator().manual_seed(cfg.seed if cfg.seed is not None else secrets.randbits(63))
        drafter = self.drafter
        self.need_hidden = drafter.state_layers if drafter is not None and drafter.needs_hidden_states else ()
        self.cost = PassCost(engine.target.pass_shape)  # its own passes, by the shape they ran (``PassCost``)
        self.policy = DepthPolicy(min(cfg.max_depth, cfg.max_nodes - 1), enabled=cfg.adaptive, cost=self.cost)
        self.record = AdaptiveDepth(self.policy.max_depth)  # acceptance and drafting time over every source
        self.eos = eos_ids(engine.model, cfg)
        self.stops = StopTokens(engine.tokenizer, cfg.stop_strings)
        self.generated: list[int] = []
        self.finished = False
        self.cancelled = False  # set by whoever runs it (a batch, a server): stop at the next step
        self.state: DecodeState | None = None
        self.ctx: DraftContext | None = None
        self.dstate = None
        self._last: tuple[list[int], Verification] | None = None  # the last step's accepted path and pass
        self._draft_s = 0.0

    @property
    def max_len(self) -> int:
        """The most positions this request will cache."""
        return self.ids.numel() + self.cfg.max_new_tokens

    @property
    def room(self) -> int:
        """New tokens this request may still commit."""
        return self.cfg.max_new_tokens - len(self.generated)

    @property
    def max_depth(self) -> int:
        """The deepest draft this request may take now (a step commits at most depth + 1 tokens)."""
        return max(min(self.cfg.max_depth, self.room - 1, self.cfg.max_nodes - 1), 0)

    def join(self) -> None:
        """A batch gave this request a row: the time before was queueing, not prefill."""
        self.joined = time.perf_counter()
        self.stats.queue_s = self.joined - self.started

    def prefilled(self, state: DecodeState, hidden: tuple | None, target) -> None:
        """The target cached the prompt (``state``, the drafter's layers' states ``hidden``): the drafter starts."""
        self.state = state
        self.ctx = DraftContext(state.tokens, state.cache_len, hidden, target.draft_view(state.cache), self.cfg.scope)
        self.dstate = self.drafter.start(self.ctx) if self.drafter is not None else None
        sync_device(self.device)
        self.stats.prefill_s = time.perf_counter() - self.joined

    def draft(self, depth: int | None = None, node_cost=None) -> DraftTree:
        """This step's tree: at most ``depth`` deep (default: as deep as this request's own policy finds pays;
        a batch's budget sets it, with ``node_cost``, the cost of an n-node tree in this batch's passes)."""
        t0 = time.perf_counter()
        limit = self.max_depth if depth is None else min(depth, self.max_depth)
        policy = self.policy if depth is None else DepthPolicy(limit, enabled=False)  # the budget's depth, as is
        tree, self.dstate = draft(self.drafter, self.dstate, self.ctx, limit, policy, self.cfg, self.gen, node_cost)
        sync_device(self.device)
        self._draft_s = time.perf_counter() - t0
        return tree

    def drafted(self, tree: DraftTree, seconds: float) -> DraftTree:
        """``tree`` was drafted for this request together with other requests' (``seconds``: its share of the
        time); checked against its limits as its own drafts are."""
        self._draft_s = seconds
        return within_limits(self.drafter, tree, self.max_depth, self.cfg.max_nodes, int(self.ctx.tokens[-1]))

    def advance(self, target, tree: DraftTree, ver: Verification, verify_s: float) -> list[int]:
        """Accept from the pass's verdict ``ver`` on ``tree``, commit, apply EOS / max tokens / stop strings and
        record the step (the pass took ``verify_s``). Returns the tokens committed; ``finished`` says if it ended."""
        path, bonus = accept(tree, ver, self.cfg.sampling, self.gen)
        self.state, new = commit(target, self.state, tree, path, bonus)
        room = self.room
        new, self.finished = truncate_at_stop(new, room, self.eos)
        cut = self.stops.add(new)  # tokens of the whole answer it takes for a stop string to appear
        if cut is not None:
            new, self.finished = new[:cut - len(self.generated)], True
        stats = self.stats
        stats.draft_s += self._draft_s
        stats.verify_s += verify_s
        stats.max_tree_nodes = max(stats.max_tree_nodes, tree.size)
        stats.draft_state_bytes = max(stats.draft_state_bytes, counted_bytes(self.dstate))
        stats.record_step(tree.max_depth, len(path), len(new), tree.source)
        self.cost.record(*target.last_shape, verify_s)  # at the shape the pass ran (a batch's: its rows)
        if tree.max_depth:
            self.policy.record_speculative(tree.source, tree.max_depth, tree.size, len(path), self._draft_s)
            self.record.record_speculative(tree.max_depth, tree.size, len(path), self._draft_s)
        self.generated += new
        self._last = (path, ver)
        return new

    def observe(self, target) -> None:
        """After a step that did not finish the request: the drafter sees what was committed."""
        path, ver = self._last
        hidden = None
        if self.need_hidden:  # the drafter's layers' states at the positions just cached: root + path
            rows = torch.tensor([0, *path], device=ver.logits.device)
            hidden = tuple(h.index_select(0, rows) for h in ver.hidden_states)
        state = self.state
        self.ctx = DraftContext(state.tokens, state.cache_len, hidden, target.draft_view(state.cache), self.cfg.scope)
        if target.length(state.cache) != state.cache_len:  # compaction bug guard: cheap, never expected
            raise RuntimeError(f"target cache holds {target.length(state.cache)} positions, expected {state.cache_len}")
        self.dstate = self.drafter.observe(self.dstate, self.ctx) if self.drafter is not None else None
        self._last = None

    def close(self) -> None:
        """The request ended (or was abandoned): its wall time; the drafter frees what it kept for it, and the request
        lets go of its last pass (a view into the whole batch's logits) and drafting context, so a caller that keeps
        finished requests keeps their tokens and stats, not megabytes of tensors each."""
        if self.drafter is not None and self.finished and not self.cancelled and self.cfg.remember:
            answered = torch.cat([self.ids, torch.tensor(self.generated, dtype=torch.long)])
            self.drafter.finished(self.dstate, answered, self.cfg.scope)
        if self.drafter is not None and self.dstate is not None:
            self.drafter.release(self.dstate)
            self.dstate = None
        self._last, self.ctx = None, None
        sync_device(self.device)
        self.stats.total_s = time.perf_counter() - self.started
