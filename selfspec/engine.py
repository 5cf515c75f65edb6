"""The decoding loop: prefill, then draft -> verify -> accept -> commit until a stop condition.

Invariant between steps: the target's KV cache holds ``tokens[:-1]``; ``tokens[-1]`` (the *root*)
is committed but not yet processed. A step feeds root + draft tree to the target in one pass, so a
step with an empty draft is exactly a plain decoding step, and plain decoding is this same loop
with no drafter: the honest baseline.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .detokenize import IncrementalText
from .drafters.base import Drafter
from .errors import SelfspecError
from .request import (DecodeConfig, DecodeState, Request, accept, commit, draft, eos_ids, prefill,  # noqa: F401
                      sync_device)
from .stats import GenerationStats
from .target import make_target_pass


@dataclass
class GenerationResult:
    """New token ids, their text (when a tokenizer is known) and the measurements."""

    tokens: list[int]
    text: str | None
    stats: GenerationStats


class SpeculativeEngine:
    """Lossless speculative decoding of one causal LM with any drafter (or none: plain decoding).

    ``backend`` runs the target: "eager" (its own modules over a growing cache), "static" (a preallocated
    cache, tree sizes bucketed), "compiled" (the static pass through ``torch.compile``) or "auto"; see
    ``selfspec/target/``. A pass object made by ``make_target_pass`` may be given instead, to share
    its cache and compiled graphs between engines (one request at a time). Outputs are the same on every
    backend, up to the dtype's rounding; ``exact`` (the default) makes the static pass compute every row as a
    plain step does where the device's self-test allows, so that output is bit-identical to plain decoding in
    any dtype (``selfspec/target/exact.py``; the stats' ``exact`` says whether a run was).
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
        buckets = self.target.buckets
        if buckets and cfg.max_nodes > buckets[-1]:
            raise SelfspecError(f"a draft tree of {cfg.max_nodes} nodes (--max-nodes) exceeds the largest the "
                                f"{self.target.name} target pass runs ({buckets[-1]}): lower --max-nodes")

    def prompt_tensor(self, prompt: torch.Tensor | list[int]) -> torch.Tensor:
        if isinstance(prompt, str) or (isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], str)):
            raise SelfspecError("the prompt must be token ids, not text: tokenize it first (tokenizer.encode, or "
                                "tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))")
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
        req = Request(self, prompt, cfg, stats)
        try:
            req.prefilled(*prefill(self.model, req.ids, req.need_hidden, self.target, req.max_len), self.target)
            while True:
                tree = req.draft()
                t0 = time.perf_counter()
                ver = self.target.verify(req.state.cache, tree, req.state.cache_len, req.need_hidden)
                sync_device(self.device)
                new = req.advance(self.target, tree, ver, time.perf_counter() - t0)
                yield new
                if req.finished:
                    return
                req.observe(self.target)
        finally:
            if req.state is not None:
                self.target.release(req.state.cache)
            req.close()

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
