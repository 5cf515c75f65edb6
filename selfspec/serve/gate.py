"""What every HTTP request passes on its way in and out: the API key, the body's size, the access log.

An ASGI middleware in front of the routes (so a request without the key is refused before its body is read or
parsed):

    key     with keys set, ``/v1/*`` (and ``/metrics`` unless public) need ``Authorization: Bearer KEY``, as
            OpenAI's clients send it; missing, malformed or wrong: 401 with OpenAI's error JSON. Keys are compared
            through their SHA-256 digests with ``hmac.compare_digest``, every key every time: the time taken
            tells nothing about how much of a guess was right, nor which key was near. ``/health`` stays open.
            The key that opened a request is named by its digest's first 12 hex digits (``AccessRecord.key``: the
            log's ``key=``, and the scope of ``--suffix-scope key``).
    body    a body over ``max_body`` bytes (declared, or counted as it arrives) is refused with 413 before the
            route sees any of it; the route then reads the buffered body.
    log     one line per request on the ``selfspec.access`` logger as it ends: id, method, path, status, outcome,
            prompt and completion tokens, time to first token, duration; the prompt only with ``log_prompts``.
            The routes fill the line's fields through ``request.state.access`` (an :class:`AccessRecord`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from .protocol import error_body, new_id

log = logging.getLogger("selfspec.access")


@dataclass
class AccessRecord:
    """One request's access-log line, filled as it is answered."""

    method: str
    path: str
    id: str = field(default_factory=lambda: new_id("req"))
    start: float = field(default_factory=time.monotonic)
    status: int | None = None
    outcome: str | None = None  # ok, cancelled, disconnected, timeout, error, ...
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    ttft_s: float | None = None
    prompt: str | None = None  # kept only when the server logs prompts
    key: str | None = None  # which API key opened it: the first 12 hex digits of its SHA-256, never the key itself

    def line(self, log_prompts: bool) -> str:
        ms = lambda s: f"{s * 1e3:.0f}" if s is not None else "-"  # noqa: E731
        outcome = self.outcome or ("ok" if self.status is not None and self.status < 400 else "-")
        parts = [f"id={self.id}", self.method, self.path, str(self.status or "-"), f"outcome={outcome}",
                 f"prompt_tokens={self.prompt_tokens if self.prompt_tokens is not None else '-'}",
                 f"completion_tokens={self.completion_tokens if self.completion_tokens is not None else '-'}",
                 f"ttft_ms={ms(self.ttft_s)}", f"duration_ms={ms(time.monotonic() - self.start)}"]
        if self.key is not None:
            parts.append(f"key={self.key}")
        if log_prompts and self.prompt is not None:
            parts.append(f"prompt={json.dumps(self.prompt, ensure_ascii=False)}")
        return " ".join(parts)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class KeyCheck:
    """The server's API keys, checked in constant time."""

    def __init__(self, keys: tuple[str, ...]) -> None:
        self.digests = tuple(_digest(k) for k in keys if k)

    def __bool__(self) -> bool:
        return bool(self.digests)

    def verdict(self, header: str | None) -> tuple[tuple[str, str] | None, str | None]:
        """(why, OpenAI's error code) a request with this ``Authorization`` header is refused, or None for a key of
        ours; and which key it is (the first 12 hex digits of its digest: a name for logs and per-key state)."""
        if header is None:
            return ("no API key: send it in an 'Authorization: Bearer KEY' header (the openai client's api_key "
                    "does so)", "missing_api_key"), None
        scheme, _, token = header.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return ("malformed Authorization header: expected 'Bearer KEY'", "invalid_api_key"), None
        candidate = _digest(token.strip())
        match = False
        for digest in self.digests:  # no early exit
            match |= hmac.compare_digest(candidate, digest)
        if not match:
            return ("incorrect API key provided", "invalid_api_key"), None
        return None, candidate.hex()[:12]


class Gate:
    """The ASGI middleware: key, body size, access log (module docstring)."""

    def __init__(self, app, keys: tuple[str, ...] = (), metrics_public: bool = False, max_body: int = 8 * 2**20,
                 log_prompts: bool = False, on_refusal: Callable[[str, str], None] | None = None) -> None:
        self.app, self.keys, self.metrics_public = app, KeyCheck(keys), metrics_public
        self.max_body, self.log_prompts = max_body, log_prompts
        self.on_refusal = on_refusal  # (path, outcome) of a request the gate answered itself: counted in /metrics

    def protected(self, path: str) -> bool:
        return path.startswith("/v1/") or (path == "/metrics" and not self.metrics_public)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        record = AccessRecord(scope["method"], scope["path"])
        scope.setdefault("state", {})["access"] = record

        async def send_seen(message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
            await send(message)

        try:
            await self._pass(scope, receive, send_seen, record)
            if record.outcome in ("unauthorized", "too_large") and self.on_refusal is not None:
                self.on_refusal(record.path, record.outcome)
        finally:
            if record.path != "/health":  # load balancers poll it; one line per poll would drown the rest
                log.info(record.line(self.log_prompts))

    async def _pass(self, scope, receive, send, record: AccessRecord) -> None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        if self.keys and self.protected(scope["path"]):
            refused, record.key = self.keys.verdict(headers.get("authorization"))
            if refused is not None:
                record.outcome = "unauthorized"
                return await _answer(send, 401, error_body(*refused[:1], "invalid_request_error", code=refused[1]),
                                     {"www-authenticate": 'Bearer realm="selfspec"'})
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body:
            return await self._too_large(send, record)
        body, more = [], True
        size = 0
        while more:  # read the whole body now (it is small: max_body at most), then hand it on
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                record.outcome = "disconnected"
                return
            body.append(message.get("body", b""))
            size += len(body[-1])
            more = message.get("more_body", False)
            if size > self.max_body:
                return await self._too_large(send, record)
        whole = b"".join(body)
        replayed = False

        async def receive_body():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": whole, "more_body": False}
            return await receive()  # afterwards: the disconnect, when it comes

        await self.app(scope, receive_body, send)

    async def _too_large(self, send, record: AccessRecord) -> None:
        record.outcome = "too_large"
        message = f"the request body exceeds this server's limit of {self.max_body:,} bytes (--max-body-mib)"
        await _answer(send, 413, error_body(message, "invalid_request_error", code="request_too_large"))


async def _answer(send, status: int, body: dict, headers: dict[str, str] | None = None) -> None:
    raw = json.dumps(body).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    head += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": raw, "more_body": False})
