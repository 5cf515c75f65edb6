"""Benchmark prompts by category: ``chat`` (ShareGPT held-out), ``code`` (HumanEval), and users' jsonl files.

A prompt is a list of user turns (plus an optional system message); turn k is sent after the
model's *own* answer to turn k-1 (MT-bench's protocol), so a method that changed the output would
also change what it is asked next. Files hold ``{"prompt": ...}`` records or MT-bench questions
(``question_id``, ``category``, ``turns``); their category is the record's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from selfspec.data import apply_chat_template, load_prompts
from selfspec.errors import SelfspecError

BUILTIN = {"chat": ("sharegpt", "heldout"), "code": ("humaneval", "all")}


@dataclass
class BenchPrompt:
    """One benchmark question: id, category, system messages and the user turns in order."""

    id: str
    category: str
    system: list[dict]
    turns: list[str]

    def messages(self, answers: list[str]) -> list[dict]:
        """The conversation up to the next user turn, given the model's answers to the earlier ones."""
        msgs = list(self.system)
        for turn, answer in zip(self.turns, answers):
            msgs += [{"role": "user", "content": turn}, {"role": "assistant", "content": answer}]
        return msgs + [{"role": "user", "content": self.turns[len(answers)]}]


def _from_examples(examples: list[dict], category: str | None, tokenizer, max_prompt_tokens: int, n: int
                   ) -> list[BenchPrompt]:
    out = []
    for ex in examples:
        system = [m for m in ex["messages"] if m["role"] == "system"]
        p = BenchPrompt(str(ex["id"]), category or ex["category"], system, list(ex["turns"]))
        if len(apply_chat_template(tokenizer, p.messages([]))) <= max_prompt_tokens:
            out.append(p)
        if len(out) == n:
            break
    return out


def load_bench_prompts(sources: list[str], n: int, tokenizer, max_prompt_tokens: int = 400) -> list[BenchPrompt]:
    """The first ``n`` prompts (first turn no longer than ``max_prompt_tokens``) of each source, interleaved.

    ``sources``: ``chat``, ``code`` or paths of jsonl/json files. Interleaving (one of each source in
    turn) lets a partial run cover every category.
    """
    groups = []
    for src in sources:
        if src in BUILTIN:
            name, split = BUILTIN[src]
            pool = 200 if name == "sharegpt" else n  # some ShareGPT prompts are too long: read ahead
            groups.append(_from_examples(load_prompts(name, max(pool, n), split=split), src, tokenizer,
                                         max_prompt_tokens, n))
        elif Path(src).expanduser().is_file():
            groups.append(_from_examples(load_prompts(str(Path(src).expanduser()), 10**6, split="all"), None,
                                         tokenizer, max_prompt_tokens, n))
        else:
            raise SelfspecError(f"unknown prompt source '{src}': use chat, code or a .jsonl/.json file")
        if not groups[-1]:
            raise SelfspecError(f"no prompt of '{src}' fits --max-prompt-tokens {max_prompt_tokens}")
    out, i = [], 0
    while any(i < len(g) for g in groups):
        out += [g[i] for g in groups if i < len(g)]
        i += 1
    return out
