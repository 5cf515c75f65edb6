"""The methods a benchmark compares. Each runs one prompt (token ids) greedily and returns a :class:`Run`.

    hf             transformers ``generate``
    hf-assisted    transformers assisted generation with a separate assistant model
    plain          selfspec without a drafter (the same loop, nothing drafted)
    draft-model    selfspec with the separate draft model
    prompt-lookup  selfspec with n-gram drafts from the context
    medusa / eagle / early-exit   selfspec with a heads checkpoint (one method per checkpoint)
    <head>+lookup  the same heads, with prompt lookup first where the context repeats itself
    suffix         selfspec drafting from the context and every answer it gave to earlier questions
    <head>+suffix  the same heads, with suffix drafts first where they match
    vllm           vLLM in its own environment and process (``vllm_client.py``)
    vllm-ngram     vLLM with its n-gram (prompt lookup) speculative decoding
    vllm+<heads>   vLLM drafting with a model's eagle3 heads exported to vLLM's EAGLE-3 layout, or eagle heads
                   in EAGLE-1's layout to vLLM's EAGLE-1 (chains of --vllm-spec-tokens; vLLM drafts no trees)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from selfspec.checkpoint import find_heads, load_heads, read_heads_json
from selfspec.drafters.base import Drafter
from selfspec.drafters.draft_model import DraftModelDrafter, frequent_token_ids
from selfspec.drafters.lookup_first import LookupFirstDrafter
from selfspec.drafters.prompt_lookup import PromptLookupDrafter
from selfspec.drafters.suffix import SuffixDrafter
from selfspec.engine import DecodeConfig, SpeculativeEngine, sync_device
from selfspec.errors import SelfspecError
from selfspec.target.packed_linear import dense_linears

from .runs import Run

if TYPE_CHECKING:
    from .vllm_client import VllmClient, WorkerConfig

BASE_METHODS = ("hf", "hf-assisted", "plain", "draft-model", "prompt-lookup", "suffix")
SOURCES = ("lookup", "suffix")  # free sources a head method may draft from first: <head>+lookup, <head>+suffix
# vLLM's speculative_config per method; ngram as in NOTES.md's measured setting
VLLM_METHODS = {"vllm": None, "vllm-ngram": {"method": "ngram", "num_speculative_tokens": 5,
                                             "prompt_lookup_max": 4, "prompt_lookup_min": 2},
                "vllm-suffix": {"method": "suffix"}}  # Arctic Inference's suffix trees at vLLM's defaults (make vllm-suffix)


@dataclass
class Method:
    """A named way to decode: a selfspec drafter (None = plain), transformers (optionally with an assistant)
    or a vLLM worker."""

    name: str
    kind: str  # "hf" | "selfspec" | "vllm"
    drafter: Drafter | None = None
    assistant: nn.Module | None = None
    heads_dir: str | None = None
    client: VllmClient | None = None
    target_pass: object = "eager"  # selfspec: a backend name, or a pass shared by every selfspec method of a bench
    dense: dict | None = None  # hf: the target's dense linear modules, kept when the shared pass packs them

    def run(self, target: nn.Module, ids: list[int], max_new: int, max_depth: int, max_nodes: int,
            adaptive: bool = True) -> Run:
        """Greedy decoding of ``ids``; new tokens up to and including EOS. ``adaptive=False``: every step
        drafts ``max_depth`` levels (``max_nodes`` nodes), whether or not it pays."""
        if self.kind == "hf":
            return run_hf(target, ids, max_new, self.assistant, self.dense)
        if self.kind == "vllm":
            return self.client.run(ids, max_new)
        cfg = DecodeConfig(max_new_tokens=max_new, max_depth=max_depth, max_nodes=max_nodes, adaptive=adaptive)
        res = SpeculativeEngine(target, self.drafter, backend=self.target_pass).generate(ids, cfg)
        s = res.stats
        return Run(res.tokens, s.total_s, s.mean_accepted, s.target_forwards, s.reached_depth, s.accepted_at_depth,
                   s.draft_state_bytes, s.max_tree_nodes)

    def close(self) -> None:
        """Stop what the method started (a vLLM worker process)."""
        if self.client is not None:
            self.client.close()


def run_hf(model: nn.Module, ids: list[int], max_new: int, assistant: nn.Module | None = None,
           dense: dict | None = None) -> Run:
    """transformers greedy ``generate`` (assisted when ``assistant`` is given) on the dense weights (``dense``:
    the modules kept from before the static pass packed them, see ``selfspec.target.packed_linear.dense_linears``)."""
    x = torch.tensor([ids], device=model.device)
    kwargs = {"assistant_model": assistant} if assistant is not None else {}
    with dense_linears(model, dense):  # stock transformers: the weights as loaded, not as selfspec's static pass packs them
        sync_device(model.device)
        start = time.perf_counter()
        out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new,
                             pad_token_id=model.generation_config.pad_token_id, temperature=None, top_p=None,
                             top_k=None, **kwargs)
        sync_device(model.device)
        seconds = time.perf_counter() - start
    new = out[0, len(ids):].tolist()
    eos = model.generation_config.eos_token_id
    eos = set(eos) if isinstance(eos, list) else {eos}
    cut = next((i + 1 for i, t in enumerate(new) if t in eos), len(new))
    return Run(new[:cut], seconds)


def heads_folders(model_name: str, extra: list[str], search_path: list[str]) -> dict[str, str]:
    """Method name -> heads folder: the model's ``<model>-<family>`` folders on ``search_path``, then ``extra``.

    A method is named by its family, or by its folder name when two folders share a family.
    """
    out: dict[str, str] = {}
    for folder in [*map(str, find_heads(model_name, search_path)), *extra]:
        fam = read_heads_json(folder)["family"]
        out[fam if fam not in out else Path(folder).name] = folder
    return out


def is_vllm(name: str) -> bool:
    """Whether method ``name`` runs in vLLM's environment."""
    return name in VLLM_METHODS or name.startswith("vllm+")


def build_methods(names: list[str], target: nn.Module, tokenizer, draft: nn.Module | None,
                  heads: dict[str, str], draft_vocab: int = 0, lookup: bool = True,
                  vllm: WorkerConfig | None = None, vllm_spec_tokens: int = 3) -> list[Method]:
    """The requested methods, in order; one-line errors for a method that lacks what it needs.

    ``draft_vocab`` > 0: selfspec's draft-model drafts over that many frequent token ids only.
    ``lookup``: selfspec's draft-model drafts by prompt lookup where the context repeats itself
    (a head method asks for it by name: ``eagle+lookup``).
    ``vllm``: the model and dtype vLLM's methods load (their workers start on the first request);
    ``vllm_spec_tokens``: the chain length of ``vllm+<heads>``.
    """
    out = []
    vocab = target.get_output_embeddings().out_features
    for name in names:
        if name in ("hf-assisted", "draft-model") and draft is None:
            raise SelfspecError(f"method {name} needs --draft-model")
        if name == "hf":
            out.append(Method(name, "hf"))
        elif name == "hf-assisted":
            out.append(Method(name, "hf", assistant=draft))
        elif name == "plain":
            out.append(Method(name, "selfspec"))
        elif name == "draft-model":
            rows = frequent_token_ids(tokenizer, draft_vocab) if draft_vocab else None
            drafter = DraftModelDrafter(draft, vocab, draft_vocab=rows)
            out.append(Method(name, "selfspec", LookupFirstDrafter(drafter) if lookup else drafter))
        elif name == "prompt-lookup":
            out.append(Method(name, "selfspec", PromptLookupDrafter()))
        elif name == "suffix":  # the index learns from every answer this method gave to earlier questions
            out.append(Method(name, "selfspec", SuffixDrafter()))
        elif name in VLLM_METHODS:
            out.append(Method(name, "vllm", client=vllm_client(name, vllm)))
        elif name.startswith("vllm+") and name[5:] in heads:
            out.append(Method(name, "vllm", heads_dir=heads[name[5:]],
                              client=vllm_heads_client(name, heads[name[5:]], vllm, vllm_spec_tokens)))
        elif name.removesuffix("+lookup").removesuffix("+suffix") in heads:
            folder = heads[name.removesuffix("+lookup").removesuffix("+suffix")]
            drafter = load_heads(target, folder, tokenizer=tokenizer)[1]
            if name.endswith("+lookup"):
                drafter = LookupFirstDrafter(drafter)
            elif name.endswith("+suffix"):
                drafter = LookupFirstDrafter(drafter, lookup=SuffixDrafter(min_match=3))  # as --heads --drafter suffix
            out.append(Method(name, "selfspec", drafter, heads_dir=folder))
        else:
            known = ", ".join([*BASE_METHODS, *VLLM_METHODS, *heads, *(f"{h}+{s}" for h in heads for s in SOURCES),
                               *(f"vllm+{h}" for h in heads)]) or "-"
            raise SelfspecError(f"unknown or unavailable method '{name}' (available: {known}); "
                                "head methods need the model's heads on --heads-path or --heads FOLDER")
    return out


def vllm_client(name: str, config: WorkerConfig | None) -> VllmClient:
    """The worker of vLLM method ``name`` (not started yet)."""
    from .vllm_client import VllmClient

    if config is None:
        raise SelfspecError(f"method {name} needs the model folder and dtype for vLLM")
    return VllmClient(replace(config, speculative=VLLM_METHODS[name]), name)


def vllm_heads_client(name: str, folder: str, config: WorkerConfig | None, tokens: int) -> VllmClient:
    """A worker drafting with the heads in ``folder``, exported for vLLM beside the bench's logs."""
    import tempfile

    from selfspec.export import export_for_serving, vllm_speculative_config, vllm_target_overrides

    from .vllm_client import VllmClient

    if config is None:
        raise SelfspecError(f"method {name} needs the model folder and dtype for vLLM")
    where = Path(config.log_dir or tempfile.mkdtemp(prefix="selfspec-vllm-")) / f"export-{name[5:]}"
    exported = export_for_serving(folder, where, "vllm", base=config.model)
    spec = vllm_speculative_config(exported, tokens)
    return VllmClient(replace(config, speculative=spec, hf_overrides=vllm_target_overrides(spec)), name)
