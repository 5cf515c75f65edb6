"""Tiny in-process models and drafters shared by the tests (CPU, seconds)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from selfspec.drafters.base import DraftContext, DraftRequest, Drafter
from selfspec.tree import from_paths


def load_script(relative: str) -> ModuleType:
    """A script of the repository (``training/...``, not a package module) imported from its path."""
    path = Path(__file__).parents[1] / relative
    spec = importlib.util.spec_from_file_location(path.stem.replace("-", "_"), path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_model(seed: int = 0, vocab: int = 64, layers: int = 2, hidden: int = 32, arch: str = "llama",
               eos: int | None = None) -> torch.nn.Module:
    """A random causal LM with peaked logits (initializer_range 0.2), so greedy ties are rare."""
    torch.manual_seed(seed)
    kwargs = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  initializer_range=0.2, eos_token_id=eos, bos_token_id=None, pad_token_id=None,
                  tie_word_embeddings=False)
    cls, cfg_cls = (LlamaForCausalLM, LlamaConfig) if arch == "llama" else (Qwen2ForCausalLM, Qwen2Config)
    model = cls(cfg_cls(**kwargs)).eval()
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = 0
    return model


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new: int, eos: int | None = None) -> list[int]:
    """Reference: transformers' own greedy decoding (new tokens only, no padding)."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new,
                         eos_token_id=eos, pad_token_id=0, temperature=None, top_p=None, top_k=None)
    new = out[0, len(prompt):].tolist()
    if eos is not None and eos in new:
        new = new[: new.index(eos) + 1]
    return new


class OracleTreeDrafter(Drafter):
    """Drafts trees that mix the target's true continuation with random branches, in random order.

    Knows ``reference`` (the full greedy sequence), so deep paths get accepted and accepted paths are
    often not a prefix of the tree order: exercises tree masks and cache compaction.
    """

    name = "oracle-tree"

    def __init__(self, reference: list[int], vocab: int, seed: int, width: int = 3, corrupt: float = 0.2) -> None:
        self.reference, self.vocab, self.width, self.corrupt = reference, vocab, width, corrupt
        self.rng = torch.Generator().manual_seed(seed)

    def _rand(self, n: int) -> list[int]:
        return torch.randint(0, self.vocab, (n,), generator=self.rng).tolist()

    def propose(self, state, ctx: DraftContext, req: DraftRequest):
        pos = ctx.tokens.numel()
        truth = self.reference[pos:pos + req.max_depth]
        if truth and torch.rand((), generator=self.rng) < self.corrupt:
            k = int(torch.randint(0, len(truth), (), generator=self.rng))
            truth = truth[:k] + self._rand(len(truth) - k)
        branches = [truth] + [self._rand(req.max_depth) for _ in range(self.width - 1)]
        order = torch.randperm(len(branches), generator=self.rng).tolist()
        return from_paths(int(ctx.tokens[-1]), [branches[b] for b in order], req.max_nodes), state


@pytest.fixture
def tiny() -> torch.nn.Module:
    return tiny_model()


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run 2-3x faster on one thread than on two contended ones."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
