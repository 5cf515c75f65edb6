"""Record forms and the one normalized example form every source is turned into::

    {"id": str, "category": str,
     "messages": [{"role": "system" | "user" | "assistant", "content": str}, ...],
     "turns": [str, ...]}

``turns`` are the user turns a benchmark sends, in order, each after the model's own reply to
the previous one: all turns of an MT-bench question; the single prompt of every other form
(later user turns of a recorded chat answered the recorded assistant, not the model under test).

Forms understood (detected from the first record): ShareGPT, messages, MT-bench, HumanEval and
plain prompt; see :func:`detect_form`.

Cleaning applied to every conversation: messages with empty content are dropped, a ``system``
message anywhere but first is dropped, consecutive messages of one role are merged (joined by a
blank line) so roles alternate, and a conversation whose first non-system message is not from the
user, or that has no user message left, is dropped.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from ..errors import SelfspecError

DEFAULT_CATEGORY = "chat"
HUMANEVAL_TEMPLATE = "Complete the following Python function:\n\n```python\n{prompt}```"

ROLE_ALIASES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
}

FORM_KEYS = {
    "sharegpt": "conversations",
    "messages": "messages",
    "mtbench": "turns",
    "humaneval": "prompt",
    "prompt": "prompt",
}

Example = dict[str, Any]
Message = dict[str, str]


def _text(value: Any) -> str:
    """Message content as a string; a list of OpenAI-style parts is joined by its text parts."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = [p.get("text", "") if isinstance(p, dict) else str(p) for p in value]
        return "".join(p for p in parts if isinstance(p, str))
    return str(value)


def normalize_role(role: Any) -> str:
    """Map a speaker name (human, gpt, user, assistant, chatgpt, bard, ...) to user/assistant/system."""
    name = str(role).strip().lower()
    if name not in ROLE_ALIASES:
        raise ValueError(f"unknown speaker role {role!r} (known: {', '.join(sorted(ROLE_ALIASES))})")
    return ROLE_ALIASES[name]


def clean_messages(messages: Iterable[Message], keep_system: bool = True) -> list[Message] | None:
    """Apply the cleaning rules of this module; None when the conversation is to be dropped.

    Drops empty messages and any ``system`` message that is not first (and a first one too when
    ``keep_system`` is false), merges consecutive messages of one role, and rejects conversations
    whose first non-system message is not the user's.
    """
    out: list[Message] = []
    for msg in messages:
        role, content = msg["role"], msg["content"]
        if not content.strip():
            continue
        if role == "system" and (out or not keep_system):
            continue
        if out and out[-1]["role"] == role:
            out[-1] = {"role": role, "content": out[-1]["content"] + "\n\n" + content}
            continue
        out.append({"role": role, "content": content})
    body = out[1:] if out and out[0]["role"] == "system" else out
    if not body or body[0]["role"] != "user":
        return None
    return out


def content_id(payload: Any) -> str:
    """A stable id for a record without one: a short SHA-1 of its canonical JSON."""
    blob = json.dumps(payload, sort_keys=True, ensure_ascii=False, default=str).encode("utf-8")
    return "sha1-" + hashlib.sha1(blob).hexdigest()[:16]


def _record_id(record: Mapping[str, Any]) -> str:
    """The record's ``id``, ``question_id`` or ``task_id``; else a hash of its content."""
    for key in ("id", "question_id", "task_id"):
        if record.get(key) not in (None, ""):
            return str(record[key])
    return content_id(dict(record))


def _first_user(messages: Iterable[Mapping[str, Any]]) -> Mapping[str, Any]:
    """The first ``user`` message (cleaned conversations always have one)."""
    return next(m for m in messages if m["role"] == "user")


def _system_head(record: Mapping[str, Any]) -> list[Message]:
    """``[system message]`` when the record has a non-blank ``system`` field, else ``[]``."""
    system = _text(record.get("system"))
    return [{"role": "system", "content": system}] if system.strip() else []


def _make_example(record: Mapping[str, Any], messages: list[Message] | None, turns: list[str] | None = None,
                  category: str | None = None) -> Example | None:
    """The normalized example of ``record`` with these ``messages`` (None when they were dropped)."""
    if messages is None:
        return None
    return {
        "id": _record_id(record),
        "category": str(category or record.get("category") or DEFAULT_CATEGORY),
        "messages": messages,
        "turns": list(turns) if turns else [_first_user(messages)["content"]],
    }


def _parse_message_list(raw: Any, role_key: str, content_key: str) -> list[Message]:
    """Role/content messages from a list of message objects, roles normalized, not yet cleaned."""
    if not isinstance(raw, list):
        raise ValueError(f"expected a list of messages, got {type(raw).__name__}")
    messages = []
    for item in raw:
        if not isinstance(item, dict):
            raise ValueError(f"expected a message object, got {type(item).__name__}")
        role = item.get(role_key, item.get("role", item.get("from")))
        content = item.get(content_key, item.get("content", item.get("value")))
        messages.append({"role": normalize_role(role), "content": _text(content)})
    return messages


def from_sharegpt(record: Mapping[str, Any], keep_system: bool = True) -> Example | None:
    """``{"id", "conversations": [{"from": "human"|"gpt"|..., "value"}]}`` -> normalized (or None)."""
    raw = _parse_message_list(record["conversations"], "from", "value")
    return _make_example(record, clean_messages(raw, keep_system=keep_system))


def from_messages(record: Mapping[str, Any]) -> Example | None:
    """``{"messages": [{"role", "content"}], optional "id", "category"}`` -> normalized (or None)."""
    raw = _parse_message_list(record["messages"], "role", "content")
    return _make_example(record, clean_messages(raw))


def from_mtbench(record: Mapping[str, Any]) -> Example | None:
    """``{"question_id", "category", "turns": [user turn, ...]}`` -> normalized (or None).

    ``messages`` holds only the first turn (plus ``system`` if the record has one); ``turns``
    keeps every turn so a benchmark can go on from the model's own answers.
    """
    raw_turns = record["turns"]
    if isinstance(raw_turns, str) or not isinstance(raw_turns, list):
        raise ValueError("'turns' must be a list of strings")
    turns = [t for t in (_text(t) for t in raw_turns) if t.strip()]
    if not turns:
        return None
    messages = _system_head(record) + [{"role": "user", "content": turns[0]}]
    return _make_example(record, messages, turns=turns)


def from_prompt(record: Mapping[str, Any]) -> Example | None:
    """``{"prompt", optional "id", "category", "system"}`` -> normalized (or None)."""
    prompt = _text(record["prompt"])
    messages = _system_head(record) + [{"role": "user", "content": prompt}]
    return _make_example(record, clean_messages(messages))


def from_humaneval(record: Mapping[str, Any]) -> Example | None:
    """A HumanEval problem (``task_id``, ``prompt``, ...) -> a ``code`` example asking to complete it."""
    prompt = HUMANEVAL_TEMPLATE.format(prompt=_text(record["prompt"]))
    return _make_example(record, [{"role": "user", "content": prompt}], category="code")


CONVERTERS: dict[str, Callable[[Mapping[str, Any]], Example | None]] = {
    "sharegpt": from_sharegpt,
    "messages": from_messages,
    "mtbench": from_mtbench,
    "humaneval": from_humaneval,
    "prompt": from_prompt,
}


def detect_form(record: Mapping[str, Any]) -> str | None:
    """Which form a record is in: sharegpt, messages, mtbench, humaneval, prompt; None if none fits."""
    if "conversations" in record:
        return "sharegpt"
    if "messages" in record:
        return "messages"
    if "turns" in record:
        return "mtbench"
    if "prompt" in record and "task_id" in record and "entry_point" in record:
        return "humaneval"
    if "prompt" in record:
        return "prompt"
    return None


def _form_error(origin: str, record: Any) -> SelfspecError:
    """The error for a first record whose form cannot be told."""
    keys = sorted(record) if isinstance(record, Mapping) else f"a {type(record).__name__}, not an object"
    return SelfspecError(
        f"{origin}: cannot tell the record format; the first record has keys {keys}, expected one of "
        "'conversations' (ShareGPT), 'messages' (role/content), 'turns' (MT-bench) or 'prompt'"
    )


def normalize_records(records: Iterable[Any], origin: str, form: str | None = None) -> Iterator[Example]:
    """Convert ``records`` (all in one form, detected from the first when ``form`` is None).

    Conversations the cleaning rules reject are skipped; a malformed record raises a one-line
    :class:`SelfspecError` naming ``origin`` and the record's index.
    """
    convert = CONVERTERS[form] if form else None
    for index, record in enumerate(records):
        if convert is None:
            detected = detect_form(record) if isinstance(record, Mapping) else None
            if detected is None:
                raise _form_error(origin, record)
            form, convert = detected, CONVERTERS[detected]
        if not isinstance(record, Mapping) or FORM_KEYS[form] not in record:
            found = sorted(record) if isinstance(record, Mapping) else f"a {type(record).__name__}"
            raise SelfspecError(f"{origin}: record {index} has no '{FORM_KEYS[form]}' key like the first "
                                f"record ({form} form); found {found}")
        try:
            example = convert(record)
        except (ValueError, TypeError, KeyError) as exc:
            raise SelfspecError(f"{origin}: record {index} is malformed: {exc}") from None
        if example is not None:
            yield example


def prompt_of(example: Mapping[str, Any]) -> Example:
    """A benchmark prompt from an example: its system message (if any) and first user message only."""
    messages = list(example["messages"])
    head = [messages[0]] if messages and messages[0]["role"] == "system" else []
    first_user = _first_user(messages)
    return {
        "id": example["id"],
        "category": example["category"],
        "messages": [dict(m) for m in head] + [dict(first_user)],
        "turns": list(example["turns"]) or [first_user["content"]],
    }
