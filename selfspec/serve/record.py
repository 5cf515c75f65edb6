"""Recorded traffic: every finished request appended to JSON Lines files that training reads as chat data.

Off unless ``selfspec serve --record DIR``; a request with ``"store": false`` (OpenAI's name) is never recorded,
nor one that ended in an error, a timeout or a client disconnect. What a line holds, and nothing else:

    {"id": "chatcmpl-...", "created": 1796591315, "endpoint": "chat", "model": "...",
     "messages": [...the request's messages..., {"role": "assistant", "content": "...the text the client got"}],
     "finish_reason": "stop", "usage": {"prompt_tokens": 32, "completion_tokens": 12},
     "sampling": {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": null, "max_tokens": 64}}

(``/v1/completions`` lines hold ``"prompt"`` and ``"completion"`` instead of ``"messages"``; training skips them.)
Files are ``traffic-<UTC time>-<pid>.jsonl`` in DIR, a new one once the current one reaches ``max_bytes``. Each line
is one ``os.write`` on a file opened for appending, under a lock: lines never interleave, and a server killed
mid-write leaves at most a torn last line, which the reader (``selfspec.data``'s folder source) drops.
"""

from __future__ import annotations

import datetime
import json
import os
import threading
from pathlib import Path

from ..errors import SelfspecError


class Recorder:
    """Appends finished requests to rotating JSON Lines files in ``folder``."""

    def __init__(self, folder: str | Path, max_bytes: int = 64 * 2**20) -> None:
        self.folder = Path(folder).expanduser()
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise SelfspecError(f"cannot record traffic in {self.folder}: {exc.strerror or exc}") from None
        self.max_bytes = max_bytes
        self.lock = threading.Lock()
        self.fd: int | None = None
        self.path: Path | None = None
        self.size = 0

    def _open(self) -> None:
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
        self.path = self.folder / f"traffic-{stamp}-{os.getpid()}.jsonl"
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)  # users' words: owner only
        self.size = 0

    def append(self, record: dict) -> None:
        """One finished request as one line (a new file first if the current one is full)."""
        data = (json.dumps(record, ensure_ascii=False) + "\n").encode()
        with self.lock:
            if self.fd is None or self.size >= self.max_bytes:
                self.close()
                self._open()
            self.size += os.write(self.fd, data)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
