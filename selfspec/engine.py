"""The decoding loop: prefill, then draft -> verify -> accept -> commit until a stop condition.

Invariant between steps: the target's KV cache holds ``tokens[:-1]``; ``tokens[-1]`` (the *root*)
is committed but not yet processed. A step feeds root + draft tree to the target in one pass, so a
step with an empty draft is exactly a plain decoding step, and plain decoding is this same loop
with no drafter: the honest baseline.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from .acceptance import accept_greedy, accept_sampling
from .adaptive import DepthPolicy, VerifyCost
from .context import check_fits
from .detokenize import IncrementalText
from .drafters.base import DraftContext, DraftRequest, Drafter
from .errors import SelfspecError
from .dtypes import dtype_name
from .memory import counted_bytes, model_dtype
from .sampling import SamplingConfig, greedy_tokens, logits_to_probs
from .stats import GenerationStats
from .stopping import StopTokens, truncate_at_stop
from .target_pass import EagerPass, make_target_pass
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


@dataclass
class GenerationResult:
    """New token ids, their text (when a tokenizer is known) and the measurements."""

    tokens: list[int]
    text: str | None
    stats: GenerationStats


def sync_device(device: torch.device) -> None:
    """Wait for queued GPU work (a no-op on the CPU), so wall-clock timings are true."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prefill(model: torch.nn.Module, prompt: torch.Tensor, hidden_states=False, target=None, max_len: int = 0
            ) -> tuple[DecodeState, tuple | None]:
    """Cache the prompt except its last token (the first root). Returns the state and, if asked, hidden states
    (``hidden_states``: True for the final layer, or indices into transformers' ``hidden_states``).

    ``target``: the target pass (default: eager); ``max_len``: the most positions the request will cache.
    """
    target = target or EagerPass(model)
    cache = target.new_cache(max(max_len, prompt.numel()))
    hs = None
    if prompt.numel() > 1:
        hs = target.prefill(cache, prompt[:-1], hidden_states)
    return DecodeState(prompt.clone(), cache, prompt.numel()), hs


def draft(drafter: Drafter | None, dstate, ctx: DraftContext, depth: int, policy: DepthPolicy, cfg: DecodeConfig,
          gen: torch.Generator) -> tuple[DraftTree, object]:
    """Ask the drafter for a tree of at most ``depth`` levels, each of its sources as deep as ``policy``
    says pays; depth 0 (or no drafter) gives the bare root."""
    root = int(ctx.tokens[-1])
    if drafter is None or depth == 0:
        return chain(root, []), dstate
    req = DraftRequest(depth, cfg.max_nodes, cfg.sampling, gen, depth_for=policy.choose, rate_for=policy.rate,
                       node_cost=policy.cost.ratio if policy.enabled else None)
    tree, dstate = drafter.draft(dstate, ctx, req)
    if tree.max_depth > depth or tree.size > cfg.max_nodes or int(tree.tokens[0]) != root:
        raise SelfspecError(f"drafter '{drafter.name}' broke its limits (depth {tree.max_depth} > {depth}, "
                            f"or {tree.size} nodes > {cfg.max_nodes}, or a wrong root)")
    return tree, dstate


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


class SpeculativeEngine:
    """Lossless speculative decoding of one causal LM with any drafter (or none: plain decoding).

    ``backend`` runs the target: "eager" (its own modules over a growing cache), "static" (a preallocated
    cache, tree sizes bucketed), "compiled" (the static pass through ``torch.compile``) or "auto"; see
    ``selfspec/target_pass.py``. A pass object made by ``make_target_pass`` may be given instead, to share
    its cache and compiled graphs between engines (one request at a time). Outputs are the same on every
    backend, up to the dtype's rounding; ``exact`` (the default) makes the static pass compute every row as a
    plain step does where the device's self-test allows, so that output is bit-identical to plain decoding in
    any dtype (``selfspec/exact.py``; the stats' ``exact`` says whether a run was).
    """

    def __init__(self, model: torch.nn.Module, drafter: Drafter | None = None, tokenizer=None,
                 backend="auto", exact: bool = True) -> None:
        self.model = model.eval()
        self.drafter = drafter
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.target = make_target_pass(self.model, backend, exact) if isinstance(backend, str) else backend

    def check_config(self, cfg: DecodeConfig) -> None:
        """Refuse, as one line, settings this engine's target pass cannot run (before any request needs them)."""
        buckets = getattr(self.target, "buckets", None)
        if buckets and cfg.max_nodes > buckets[-1]:
            raise SelfspecError(f"a draft tree of {cfg.max_nodes} nodes (--max-nodes) exceeds the largest the "
                                f"{self.target.name} target pass runs ({buckets[-1]}): lower --max-nodes")

    def _prompt_tensor(self, prompt: torch.Tensor | list[int]) -> torch.Tensor:
        ids = torch.as_tensor(prompt, dtype=torch.long).cpu()
        if ids.dim() == 2:
            if ids.shape[0] != 1:
                raise SelfspecError(f"selfspec decodes one sequence at a time; got a batch of {ids.shape[0]}")
            ids = ids[0]
        if ids.dim() != 1 or ids.numel() == 0:
            raise SelfspecError("the prompt must be a non-empty sequence of token ids")
        vocab = self.model.get_output_embeddings().out_features
        if int(ids.max()) >= vocab or int(ids.min()) < 0:
            raise SelfspecError(f"prompt token ids must lie in [0, {vocab}); got {int(ids.min())}..{int(ids.max())}")
        return ids

    def steps(self, prompt: torch.Tensor | list[int], cfg: DecodeConfig, stats: GenerationStats) -> Iterator[list[int]]:
        """Run the loop, yielding the tokens each step commits; fills ``stats`` as it goes."""
        start = time.perf_counter()
        stats.dtype, stats.target_pass = dtype_name(model_dtype(self.model)), self.target.name
        stats.exact = bool(getattr(self.target, "exact", False))
        ids = self._prompt_tensor(prompt)
        check_fits(self.model.config, ids.numel(), cfg.max_new_tokens)  # before anything runs
        self.check_config(cfg)
        gen = torch.Generator().manual_seed(cfg.seed if cfg.seed is not None else secrets.randbits(63))
        need_hidden = self.drafter.state_layers if self.drafter is not None and self.drafter.needs_hidden_states else ()
        state, hs = prefill(self.model, ids, need_hidden, self.target, ids.numel() + cfg.max_new_tokens)
        ctx = DraftContext(state.tokens, state.cache_len, hs, self.target.draft_view(state.cache))
        dstate = self.drafter.start(ctx) if self.drafter is not None else None  # the drafter's own prefill
        sync_device(self.device)
        stats.prefill_s = time.perf_counter() - start
        policy = DepthPolicy(min(cfg.max_depth, cfg.max_nodes - 1), enabled=cfg.adaptive,
                             cost=VerifyCost(buckets=getattr(self.target, "buckets", None)))
        eos = eos_ids(self.model, cfg)
        stops = StopTokens(self.tokenizer, cfg.stop_strings)
        generated: list[int] = []
        try:
            while True:
                room = cfg.max_new_tokens - len(generated)
                depth = min(cfg.max_depth, room - 1, cfg.max_nodes - 1)
                t0 = time.perf_counter()
                tree, dstate = draft(self.drafter, dstate, ctx, depth, policy, cfg, gen)
                sync_device(self.device)
                t1 = time.perf_counter()
                ver = self.target.verify(state.cache, tree, state.cache_len, need_hidden)
                sync_device(self.device)
                t2 = time.perf_counter()
                path, bonus = accept(tree, ver, cfg.sampling, gen)
                state, new = commit(self.target, state, tree, path, bonus)
                new, finished = truncate_at_stop(new, room, eos)
                cut = stops.add(new)  # tokens of the whole answer it takes for a stop string to appear
                if cut is not None:
                    new, finished = new[:cut - len(generated)], True
                stats.draft_s += t1 - t0
                stats.verify_s += t2 - t1
                stats.max_tree_nodes = max(stats.max_tree_nodes, tree.size)
                stats.draft_state_bytes = max(stats.draft_state_bytes, counted_bytes(dstate))
                stats.record_step(tree.max_depth, len(path), len(new), tree.source)
                if tree.max_depth == 0:
                    policy.record_plain(t2 - t1)
                else:
                    policy.record_speculative(tree.source, tree.max_depth, tree.size, len(path), t1 - t0, t2 - t1)
                generated += new
                yield new
                if finished:
                    return
                hidden = None
                if need_hidden:  # the drafter's layers' states at the positions just cached: root + path
                    rows = torch.tensor([0, *path], device=ver.logits.device)
                    hidden = tuple(h.index_select(0, rows) for h in ver.hidden_states)
                ctx = DraftContext(state.tokens, state.cache_len, hidden, self.target.draft_view(state.cache))
                if self.target.length(state.cache) != state.cache_len:  # compaction bug guard: cheap, never expected
                    raise RuntimeError(f"target cache holds {self.target.length(state.cache)} positions, "
                                       f"expected {state.cache_len}")
                dstate = self.drafter.observe(dstate, ctx) if self.drafter is not None else None
        finally:
            sync_device(self.device)
            stats.total_s = time.perf_counter() - start

    def generate(self, prompt: torch.Tensor | list[int], cfg: DecodeConfig | None = None, streamer=None
                 ) -> GenerationResult:
        """Decode ``prompt`` (token ids) to completion. ``streamer``: any ``transformers`` streamer."""
        cfg = cfg or DecodeConfig()
        stats = GenerationStats()
        out: list[int] = []
        if streamer is not None:
            streamer.put(torch.as_tensor(prompt, dtype=torch.long).reshape(1, -1))
        for new in self.steps(prompt, cfg, stats):
            out += new
            if streamer is not None:
                streamer.put(torch.tensor([new]))
        if streamer is not None:
            streamer.end()
        text = self.tokenizer.decode(out, skip_special_tokens=True) if self.tokenizer is not None else None
        return GenerationResult(out, text, stats)

    def stream(self, prompt: torch.Tensor | list[int], cfg: DecodeConfig | None = None,
               stats: GenerationStats | None = None) -> Iterator[str]:
        """Yield the new text piece by piece as steps commit (needs a tokenizer)."""
        if self.tokenizer is None:
            raise SelfspecError("streaming text needs a tokenizer: SpeculativeEngine(model, drafter, tokenizer)")
        text = IncrementalText(self.tokenizer)
        for new in self.steps(prompt, cfg or DecodeConfig(), stats or GenerationStats()):
            piece = text.add(new)
            if piece:
                yield piece
        rest = text.finish()  # whatever was held back waiting for the rest of a character
        if rest:
            yield rest
