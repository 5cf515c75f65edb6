"""Reading and writing JSON record files: lists that may be cut short, JSON Lines, gzip, atomic writes."""

from __future__ import annotations

import gzip
import io
import json
import os
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TextIO

from ..errors import SelfspecError
from ..paths import disk_full_error, is_disk_full

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
        """Drop the text already decoded and append the next chunk of ``stream``."""
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


def _open_text(path: Path) -> TextIO:
    """``path`` opened as UTF-8 text, gunzipped on the fly when it ends in ``.gz``."""
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    return path.open(encoding="utf-8")


def jsonl_lines(text: str) -> list[str]:
    """The lines of JSON Lines ``text``: split at ``\n`` only (``str.splitlines`` would also split inside
    strings at U+2028, U+0085 and other characters that JSON, written with ``ensure_ascii=False``, keeps raw)."""
    return [line.removesuffix("\r") for line in text.split("\n")]


def _parse_jsonl(text: str, path: Path) -> list[Any]:
    """The records of JSON Lines ``text`` (blank lines skipped); bad lines name ``path`` and line."""
    records = []
    for lineno, line in enumerate(jsonl_lines(text), 1):
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
    """Records of ``.json`` text that failed to parse: a cut-short list, or JSON Lines."""
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


def write_jsonl_atomic(path: Path, records: Iterable[Any]) -> int:
    """Write ``records`` to ``path`` through a temporary file; returns how many were written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    count = 0
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            for record in records:
                out.write(json.dumps(record, ensure_ascii=False) + "\n")
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
