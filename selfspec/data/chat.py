"""Chat templating and training tokenization: token ids of a conversation and its assistant loss mask."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..errors import SelfspecError
from ..sequence import common_prefix
from .formats import Message

FALLBACK_ROLE_NAMES = {"system": "System", "user": "User", "assistant": "Assistant"}


def has_chat_template(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` carries a chat template."""
    return bool(getattr(tokenizer, "chat_template", None))


def _plain_messages(messages: Iterable[Mapping[str, Any]]) -> list[Message]:
    """``messages`` as plain ``{"role", "content"}`` dicts of strings."""
    return [{"role": str(m["role"]), "content": str(m["content"])} for m in messages]


@functools.lru_cache(maxsize=64)
def _template_kwargs(tokenizer_type: type) -> tuple[str, ...]:
    """Which optional ``apply_chat_template`` keywords this tokenizer class accepts."""
    try:
        params = inspect.signature(tokenizer_type.apply_chat_template).parameters
    except (TypeError, ValueError):
        return ()
    return tuple(p for p in ("return_dict", "sanitize_control_tokens") if p in params)


def _encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text``, no special tokens added, special-token strings in it kept as text."""
    return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])


def _leading_special_ids(tokenizer: Any) -> list[int]:
    """``[bos_token_id]`` when the tokenizer puts BOS before a text by itself, else ``[]``."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return []
    with_special = list(tokenizer("", add_special_tokens=True)["input_ids"])
    return [bos] if with_special[:1] == [bos] else []


def _fallback_ids(tokenizer: Any, messages: list[Message], add_generation_prompt: bool) -> list[int]:
    """The built-in format for tokenizers without a chat template (see :func:`apply_chat_template`)."""
    eos = getattr(tokenizer, "eos_token_id", None)
    ids = _leading_special_ids(tokenizer)
    for msg in messages:
        if msg["role"] == "assistant":
            ids += _encode(tokenizer, "Assistant:") + _encode(tokenizer, " " + msg["content"])
            ids += ([eos] if eos is not None else []) + _encode(tokenizer, "\n")
        else:
            name = FALLBACK_ROLE_NAMES.get(msg["role"], msg["role"].capitalize())
            ids += _encode(tokenizer, f"{name}: {msg['content']}\n")
    if add_generation_prompt:
        ids += _encode(tokenizer, "Assistant:")
    return ids


def apply_chat_template(tokenizer: Any, messages: Sequence[Mapping[str, Any]],
                        add_generation_prompt: bool = True) -> list[int]:
    """Token ids of ``messages`` in the tokenizer's chat format, as a plain ``list[int]``.

    Uses ``tokenizer.apply_chat_template`` (with ``sanitize_control_tokens`` where this
    transformers has it, so special-token strings inside messages stay text). Without a chat
    template, falls back to: BOS (if the tokenizer adds one), then ``"System: ...\\n"``,
    ``"User: ...\\n"`` and ``"Assistant: ..." + EOS + "\\n"`` per message, each piece tokenized on
    its own so every prefix of a conversation tokenizes to a prefix; the generation prompt is
    ``"Assistant:"``.
    """
    plain = _plain_messages(messages)
    if not has_chat_template(tokenizer):
        return _fallback_ids(tokenizer, plain, add_generation_prompt)
    kwargs: dict[str, Any] = {"add_generation_prompt": add_generation_prompt, "tokenize": True}
    kwargs.update(dict.fromkeys(_template_kwargs(type(tokenizer)), True))
    out = tokenizer.apply_chat_template(plain, **kwargs)
    ids = out["input_ids"] if isinstance(out, Mapping) else out
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if ids and isinstance(ids[0], list):
        ids = ids[0]
    return [int(i) for i in ids]


def _common_suffix_len(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """How many trailing tokens ``a`` and ``b`` share, counting at most ``limit``."""
    n = 0
    while n < limit and a[len(a) - 1 - n] == b[len(b) - 1 - n]:
        n += 1
    return n


def _is_prefix(prefix: Sequence[int], seq: Sequence[int]) -> bool:
    """Whether ``seq`` starts with ``prefix``."""
    return len(prefix) <= len(seq) and list(seq[: len(prefix)]) == list(prefix)


def _content_span(tokenizer: Any, messages: list[Message], index: int, full: list[int]) -> tuple[int, int]:
    """Tokens of ``messages[index]``'s content in ``full``: where it differs from a render with
    that content swapped for one other character (so the span never leaves the content), plus the
    special token right after it (the end-of-turn token), if there is one."""
    content = messages[index]["content"]
    stand_in = next(c for c in "@#%" if c not in (content[:1], content[-1:]))
    swapped = list(messages)
    swapped[index] = {"role": messages[index]["role"], "content": stand_in}
    alt = apply_chat_template(tokenizer, swapped, add_generation_prompt=False)
    start = common_prefix(full, alt)
    end = len(full) - _common_suffix_len(full, alt, min(len(full), len(alt)) - start)
    special = set(getattr(tokenizer, "all_special_ids", None) or [])
    if start < end < len(full) and full[end] in special:
        end += 1
    return start, max(start, end)


def _assistant_span(tokenizer: Any, messages: list[Message], index: int, full: list[int]) -> tuple[int, int]:
    """Token span in ``full`` that the reply ``messages[index]`` is trained on (see below)."""
    before = apply_chat_template(tokenizer, messages[:index], add_generation_prompt=True)
    last = index == len(messages) - 1
    through = full if last else apply_chat_template(tokenizer, messages[: index + 1], add_generation_prompt=False)
    if len(before) <= len(through) and _is_prefix(before, full) and _is_prefix(through, full):
        return len(before), len(through)
    return _content_span(tokenizer, messages, index, full)


def tokenize_for_training(tokenizer: Any, messages: Sequence[Mapping[str, Any]],
                          max_length: int) -> dict[str, list[int]]:
    """``{"input_ids", "loss_mask"}`` of a conversation, truncated to ``max_length`` tokens.

    ``loss_mask`` is 1 exactly on the assistant replies. Each reply's span is found by templating
    progressively longer prefixes: it runs from the end of the conversation before it plus the
    generation prompt to the end of the conversation through it, so the template's end-of-turn
    tokens after the reply are learnt too. This holds for any template that renders a prefix of
    the conversation as a prefix of the whole. For a template that does not (one that marks the
    last message, say), the span is instead found by swapping the reply's content and diffing the
    two renders; it then covers the content and the special token right after it, never a token
    outside the reply.
    """
    if max_length <= 0:
        raise SelfspecError(f"max_length must be positive, got {max_length}")
    plain = _plain_messages(messages)
    full = apply_chat_template(tokenizer, plain, add_generation_prompt=False)
    mask = [0] * len(full)
    for i, msg in enumerate(plain):
        if msg["role"] != "assistant":
            continue
        start, end = _assistant_span(tokenizer, plain, i, full)
        if start >= max_length:
            break
        mask[start:end] = [1] * (end - start)
    return {"input_ids": full[:max_length], "loss_mask": mask[:max_length]}
