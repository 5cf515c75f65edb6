"""Helpers shared by the tests (CPU, seconds): tiny in-process models, tokenizer and drafters, head
settings, and the chi-square check of speculative sampling. Tests share code only through this file."""

from __future__ import annotations

import importlib.util
import json
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import ModuleType

import pytest
import torch
from scipy.stats import chi2
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from selfspec.drafters.base import DraftContext, DraftRequest, Drafter
from selfspec.sampling import SamplingConfig, logits_to_probs
from selfspec.tree import from_paths


def load_script(relative: str) -> ModuleType:
    """A script of the repository (``training/...``, not a package module) imported from its path."""
    path = Path(__file__).parents[1] / relative
    spec = importlib.util.spec_from_file_location(path.stem.replace("-", "_"), path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def selfspec_command() -> list[str]:
    """The ``selfspec`` command as a subprocess argv (this interpreter, so the test's environment)."""
    return [sys.executable, "-m", "selfspec_cli"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_model(seed: int = 0, vocab: int = 64, layers: int = 2, hidden: int = 32, arch: str = "llama",
               eos: int | None = None, tie: bool = False) -> torch.nn.Module:
    """A random causal LM with peaked logits (initializer_range 0.2), so greedy ties are rare; ``tie``: the
    output embeddings share the input embeddings' weight."""
    torch.manual_seed(seed)
    kwargs = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  initializer_range=0.2, eos_token_id=eos, bos_token_id=None, pad_token_id=None,
                  tie_word_embeddings=tie)
    cls, cfg_cls = (LlamaForCausalLM, LlamaConfig) if arch == "llama" else (Qwen2ForCausalLM, Qwen2Config)
    model = cls(cfg_cls(**kwargs)).eval()
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = 0
    return model


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new: int, eos: int | None = None) -> list[int]:
    """Reference: transformers' own greedy decoding (new tokens only, no padding)."""
    ids = torch.tensor([prompt], device=model.device)
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


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tokenizer(chat_template: str | None = CHATML):
    """A byte-level tokenizer (one token per byte, no merges) with ChatML control tokens; no network."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<s>",
                                   additional_special_tokens=["<|im_start|>"])
    if chat_template:
        fast.chat_template = chat_template
    return fast


# --- draft heads on tiny models ---------------------------------------------------------------------

HEADS_HYPER = {"medusa": {}, "eagle": {"draft_vocab_size": 48, "top_k": 3}, "early-exit": {"exit_layer": 1},
               "eagle3": {"draft_vocab_size": 48, "top_k": 3}}


def perturb(heads: torch.nn.Module, seed: int, scale: float = 0.3) -> torch.nn.Module:
    """Move every trained weight off its initial value, so drafts are neither identity nor all-zero."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return heads


def prompt_for(seed: int, n: int = 10, vocab: int = 64) -> list[int]:
    """A prompt whose second half repeats its first (so prompt lookup has something to find)."""
    g = torch.Generator().manual_seed(2000 + seed)
    base = torch.randint(0, vocab, (n // 2,), generator=g).tolist()
    return (base * 2)[:n]


# --- the exact distribution of two sampled tokens, and a chi-square test against it ------------------

SAMPLING_VOCAB = 8  # small enough that P(x1, x2 | prompt) is computable exactly
SAMPLING_PROMPT = [1, 5, 2, 7, 3]
SAMPLING = SamplingConfig(temperature=1.0, top_k=6)
ALPHA = 0.001  # significance of every chi-square test (fixed seeds)


def exact_joint(model: torch.nn.Module) -> torch.Tensor:
    """P(x1, x2 | SAMPLING_PROMPT) under SAMPLING, shape (V, V)."""
    with torch.no_grad():
        p1 = logits_to_probs(model(torch.tensor([SAMPLING_PROMPT])).logits[0, -1], SAMPLING)
        seqs = torch.tensor([SAMPLING_PROMPT + [x] for x in range(SAMPLING_VOCAB)])
        p2 = logits_to_probs(model(seqs).logits[:, -1], SAMPLING)
    return p1[:, None] * p2


def chi_square_pvalue(samples: list[tuple[int, int]], probs: torch.Tensor) -> float:
    """Goodness of fit of the sampled pairs to ``probs``; cells expected below 5 are pooled."""
    counts = torch.zeros_like(probs)
    for a, b in samples:
        counts[a, b] += 1
    expected = probs.flatten() * len(samples)
    observed = counts.flatten()
    big = expected >= 5
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    obs = torch.cat([observed[big], observed[~big].sum()[None]])
    if exp[-1] == 0:
        exp, obs = exp[:-1], obs[:-1]
    stat = float(((obs - exp) ** 2 / exp).sum())
    return float(chi2.sf(stat, df=len(exp) - 1))


def draw(engine, max_depth: int, n: int = 1500) -> list[tuple[int, int]]:
    """``n`` pairs of first two tokens sampled by ``engine`` (a SpeculativeEngine) from SAMPLING_PROMPT."""
    from selfspec.engine import DecodeConfig

    out = []
    # well-spread seeds: mt19937 seeded with consecutive small integers gives correlated first draws
    seeds = torch.randint(0, 2**62, (n,), generator=torch.Generator().manual_seed(1234)).tolist()
    for seed in seeds:
        cfg = DecodeConfig(max_new_tokens=2, sampling=SAMPLING, max_depth=max_depth, adaptive=False, seed=seed)
        toks = engine.generate(SAMPLING_PROMPT, cfg).tokens
        out.append((toks[0], toks[1]))
    return out


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


def tree_path(tree, node: int) -> list[int]:
    """The drafted tokens from the root's child down to ``node`` of a DraftTree (root excluded)."""
    out = []
    while node > 0:
        out.append(int(tree.tokens[node]))
        node = tree.parents[node]
    return out[::-1]


class Live:
    """``selfspec serve``'s app over a tiny model, served by uvicorn in a thread on a free port."""

    def __init__(self, model_name: str, batch: int = 4, drafter=None, **config) -> None:
        """``drafter(model, tokenizer)``: the engine's drafter (default: prompt lookup); ``config``: ServerConfig's."""
        import uvicorn

        from selfspec.batching import BatchEngine
        from selfspec.drafters.prompt_lookup import PromptLookupDrafter
        from selfspec.serve import ServerConfig, create_app

        self.model_name = model_name
        self.tokenizer = make_tokenizer()
        self.model = model = tiny_model(3, vocab=len(self.tokenizer), hidden=32)
        first = drafter(model, self.tokenizer) if drafter is not None else PromptLookupDrafter()
        self.engine = BatchEngine(model, first, self.tokenizer, max_batch=batch, context=256)
        self.app = create_app(self.engine, self.tokenizer, ServerConfig(model_name=model_name, **config))
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        for _ in range(200):
            if self.server.started:
                return
            time.sleep(0.05)
        raise AssertionError("the server did not start")

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def call(self, path: str, body: dict | bytes | None = None, headers: dict | None = None) -> tuple[int, str]:
        data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data,
                                     headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()

    def complete(self, prompt: str, stream: bool = False, headers: dict | None = None,
                 **extra) -> tuple[int, str, str | None]:
        """(status, text, finish_reason) of a greedy completion; a stream's pieces joined."""
        status, raw = self.call("/v1/completions", {"model": self.model_name, "prompt": prompt, "max_tokens": 40,
                                                    "temperature": 0, "stream": stream, **extra}, headers)
        if status != 200:
            return status, raw, None
        if not stream:
            choice = json.loads(raw)["choices"][0]
            return status, choice["text"], choice["finish_reason"]
        text, finish = "", None
        for line in raw.splitlines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"]
                if choice:
                    text += choice[0]["text"]
                    finish = choice[0]["finish_reason"] or finish
        return status, text, finish
