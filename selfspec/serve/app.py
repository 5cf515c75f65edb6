"""The ASGI application: OpenAI's chat and completion endpoints over one speculative engine.

FastAPI (on Starlette, served by uvicorn): request models checked as they parse, server-sent events for
streams, disconnects seen by the stream's task, a lifespan that starts and stops the engine thread.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from ..context import context_length
from ..data import apply_chat_template
from ..detokenize import IncrementalText
from ..batching import BatchEngine
from ..engine import DecodeConfig, eos_ids
from ..errors import ContextError, SelfspecError
from ..stopping import StopText
from .gate import AccessRecord, Gate
from .pacing import Pacer
from .record import Recorder
from .protocol import (APIError, ChatRequest, CompletionRequest, chat_chunk, chat_response, completion_chunk,
                       completion_response, error_body, new_id, usage, usage_chunk)
from .telemetry import Telemetry
from .worker import Burst, EngineWorker, Finished, Job, Swap

ERROR_STATUS = {"invalid_request_error": 400, "timeout_error": 408, "unavailable": 503, "server_error": 500}


@dataclass
class ServerConfig:
    """What the server serves and how."""

    model_name: str
    max_waiting: int = 16  # requests queued beyond the batch; more get 429
    smooth: bool = True  # pace streams (per request: "smooth": false)
    default_max_tokens: int = 512  # when a request sets no max_tokens (capped by the context left)
    decode: DecodeConfig = field(default_factory=DecodeConfig)  # drafting settings for every request
    api_keys: tuple[str, ...] = ()  # any one of them opens /v1/* (and /metrics unless metrics_public); none: open
    metrics_public: bool = False
    max_body: int = 8 * 2**20  # bytes of a request body; more get 413
    request_timeout: float | None = None  # seconds from arrival; a request still decoding then ends with 408
    log_prompts: bool = False  # the access log's lines carry the prompt text
    recorder: Recorder | None = None  # --record: finished requests appended for training (none: nothing kept)
    heads: str | None = None  # the heads folder serving at start (a name for /metrics)
    load_heads: Callable[[str], object] | None = None  # a heads folder -> its drafter (POST /v1/heads/reload)
    suffix_scope: str = "global"  # key: a request's answer shapes the suffix drafts of its own API key's requests only


class Server:
    """The engine, its worker thread, the metrics, and the request handling the routes call."""

    def __init__(self, engine: BatchEngine, tokenizer, config: ServerConfig) -> None:
        self.engine, self.tokenizer, self.config = engine, tokenizer, config
        self.telemetry = Telemetry()
        self.worker = EngineWorker(engine, config.max_waiting, on_finish=self.telemetry.on_finish,
                                   on_step=self.telemetry.on_step)
        self.vocab = engine.model.get_output_embeddings().out_features
        self.created = int(time.time())
        if config.heads:
            self.worker.heads = config.heads
            self.telemetry.serving(config.heads)

    async def reload_heads(self, path: str) -> dict:
        """Newer heads for the same target, loaded beside the serving ones and swapped in between two engine steps;
        a folder that cannot serve (another base, a truncated file, another family) is refused and the old heads
        keep serving."""
        if self.config.load_heads is None:
            raise APIError(400, "this server was started without --heads: there are no heads to reload", param="path")
        try:
            drafter = await asyncio.to_thread(self.config.load_heads, path)
        except SelfspecError as exc:
            raise APIError(400, f"the heads in {path} cannot serve here: {exc}", param="path") from None
        swap = Swap(drafter, path)
        await asyncio.to_thread(self.worker.swap, swap)
        if swap.error is not None:
            raise APIError(400, f"the heads in {path} cannot serve here: {swap.error}", param="path")
        self.telemetry.serving(path)
        return {"object": "heads", "heads": path, "drafter": getattr(drafter, "name", "none")}

    # --- requests -> jobs ----------------------------------------------------------------------------

    def prompt_ids(self, req: ChatRequest | CompletionRequest) -> list[int]:
        if isinstance(req, ChatRequest):
            return apply_chat_template(self.tokenizer, [{"role": m.role, "content": m.text()} for m in req.messages])
        prompt = req.prompt[0] if isinstance(req.prompt, list) and isinstance(req.prompt[0], str) else req.prompt
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if min(prompt) < 0 or max(prompt) >= self.vocab:
            raise APIError(400, f"prompt token ids must lie in [0, {self.vocab})", param="prompt")
        return list(prompt)

    def submit(self, req: ChatRequest | CompletionRequest, key: str | None = None) -> Job:
        """Check, tokenize and queue ``req`` (opened by the API key named ``key``); APIError for anything that cannot
        be served."""
        req.check_supported()
        if req.model != self.config.model_name:
            raise APIError(404, f"the model '{req.model}' does not exist: this server serves "
                                f"'{self.config.model_name}'", param="model", code="model_not_found")
        ids = self.prompt_ids(req)
        if not ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        limit = min(context_length(self.engine.model.config) or self.engine.context, self.engine.context)
        wanted = req.wanted_tokens()
        max_new = wanted or max(1, min(self.config.default_max_tokens, limit - len(ids)))
        try:
            self.engine.check_request(len(ids), max_new)
        except ContextError as exc:
            raise APIError(400, str(exc), param="messages" if isinstance(req, ChatRequest) else "prompt",
                           code="context_length_exceeded") from None
        timeout = self.config.request_timeout
        cfg = req.decode_config(max_new, self.config.decode)
        if self.config.suffix_scope == "key":
            cfg = replace(cfg, scope=key)
        job = Job(ids, cfg, asyncio.get_running_loop(),
                  deadline=None if timeout is None else time.monotonic() + timeout)
        if not self.worker.accepting:
            why = f"the engine failed ({self.worker.failure})" if self.worker.failure else "the server is shutting down"
            raise APIError(503, why, type="unavailable")
        if not self.worker.submit(job):
            raise APIError(429, f"the server is busy ({self.worker.waiting} requests waiting); retry later",
                           type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(self.worker.retry_after())})
        self.telemetry.queue(self.worker.waiting, self.worker.running)
        return job

    def finish_reason(self, job: Job, tokens: list[int], stopped: bool = False) -> str:
        if not tokens or stopped:
            return "stop"
        hit_limit = len(tokens) >= job.cfg.max_new_tokens
        return "length" if hit_limit and tokens[-1] not in eos_ids(self.engine.model, job.cfg) else "stop"

    def summary(self, end: Finished) -> dict:
        """selfspec's own numbers for one response."""
        s = end.stats
        return {"mean_accepted": s.mean_accepted, "target_passes": s.target_forwards,
                "drafter": getattr(self.engine.drafter, "name", "none"), "decode_s": s.total_s}

    def failed(self, end: Finished) -> APIError:
        return APIError(ERROR_STATUS.get(end.error_type, 500), end.error or "decoding failed", type=end.error_type)

    # --- answers -------------------------------------------------------------------------------------

    async def answer(self, job: Job, request: Request, endpoint: str, record: AccessRecord) -> Finished:
        """Wait for the whole decode (non-streaming); cancel it if the client leaves."""
        first = True
        while True:
            try:
                event = await asyncio.wait_for(job.events.get(), timeout=0.25)
            except asyncio.TimeoutError:  # TimeoutError itself from Python 3.11 on
                if await request.is_disconnected():
                    job.cancel()
                continue
            if isinstance(event, Burst):
                if first and event.tokens:
                    self.first_token(record, event)
                    first = False
                continue
            self.done(endpoint, event, record)
            return event

    def record(self, req: ChatRequest | CompletionRequest, job: Job, rid: str, text: str, finish: str,
               end: Finished) -> None:
        """Append a request that finished well to the recording (``--record``), unless it asked not to be stored."""
        recorder = self.config.recorder
        if recorder is None or req.store is False or end.status != "ok":
            return
        line = {"id": rid, "created": int(time.time()), "endpoint": "chat" if isinstance(req, ChatRequest) else
                "completions", "model": self.config.model_name}
        if isinstance(req, ChatRequest):
            line["messages"] = [{"role": m.role, "content": m.text()} for m in req.messages]
            line["messages"].append({"role": "assistant", "content": text})
        else:
            line["prompt"], line["completion"] = req.prompt, text
        line.update(finish_reason=finish, usage={"prompt_tokens": len(job.ids), "completion_tokens": len(end.tokens)},
                    sampling={"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
                              "seed": req.seed, "max_tokens": job.cfg.max_new_tokens})
        recorder.append(line)

    def first_token(self, record: AccessRecord, burst: Burst) -> None:
        """Time to first token, one definition streamed or not: from arrival to the step that committed it."""
        record.ttft_s = burst.time - record.start
        self.telemetry.ttft.observe(record.ttft_s)

    def done(self, endpoint: str, end: Finished, record: AccessRecord) -> None:
        record.outcome = end.error_type if end.status == "error" else end.status
        record.completion_tokens = len(end.tokens)
        self.telemetry.requests.inc(endpoint=endpoint, status=end.status)
        self.telemetry.duration.observe(time.monotonic() - record.start)
        self.telemetry.queue(self.worker.waiting, self.worker.running)

    async def stream(self, job: Job, req, endpoint: str, rid: str, record: AccessRecord):
        """Server-sent events: one chunk per token (paced), the finish, usage if asked, ``[DONE]``."""
        chat = endpoint == "chat"
        model = self.config.model_name
        pacer = Pacer(enabled=self.config.smooth if req.smooth is None else req.smooth)
        text = IncrementalText(self.tokenizer)
        shown = StopText(job.cfg.stop_strings)  # the text up to, never including, a stop string
        sent: list[str] = []  # every piece sent (the text a recording keeps)
        backlog: deque[int] = deque()
        end: Finished | None = None
        last_sent: float | None = None

        def event(obj: dict) -> str:
            return f"data: {json.dumps(obj)}\n\n"

        def piece_chunk(piece: str) -> str:
            sent.append(piece)
            return event(chat_chunk(rid, model, {"content": piece}) if chat else completion_chunk(rid, model, piece))

        try:
            if chat:
                yield event(chat_chunk(rid, model, {"role": "assistant", "content": ""}))
            while True:
                while end is None and (not backlog or not job.events.empty()):
                    item = await job.events.get()
                    if isinstance(item, Burst):
                        if record.ttft_s is None and item.tokens:
                            self.first_token(record, item)
                        backlog.extend(item.tokens)
                        pacer.commit(len(item.tokens), item.time, len(backlog))
                    else:
                        end = item
                if backlog:
                    piece = shown.add(text.add([backlog.popleft()]))
                    if piece:
                        now = time.monotonic()
                        if last_sent is not None:
                            self.telemetry.gap.observe(now - last_sent)
                        last_sent = now
                        yield piece_chunk(piece)
                    delay = pacer.interval() if backlog else 0.0
                    if delay > 0:
                        await asyncio.sleep(delay)
                    continue
                rest = shown.add(text.finish()) + shown.finish()
                if rest:
                    yield piece_chunk(rest)
                self.done(endpoint, end, record)
                if end.status == "error":
                    yield event(self.failed(end).body())
                else:
                    finish = self.finish_reason(job, end.tokens, shown.stopped)
                    self.record(req, job, rid, "".join(sent), finish, end)
                    yield event(chat_chunk(rid, model, {}, finish) if chat else completion_chunk(rid, model, "", finish))
                    if req.stream_options and req.stream_options.include_usage:
                        kind = "chat.completion.chunk" if chat else "text_completion"
                        use = usage(len(job.ids), len(end.tokens), end.stats.cached_prompt_tokens)
                        yield event(usage_chunk(rid, model, kind, use))
                yield "data: [DONE]\n\n"
                return
        finally:
            if end is None:  # the client went away mid-stream (or the server is stopping): free the engine
                job.cancel()
                record.outcome, record.completion_tokens = "disconnected", len(job.tokens)
                self.telemetry.requests.inc(endpoint=endpoint, status="disconnected")

    async def handle(self, req: ChatRequest | CompletionRequest, request: Request, endpoint: str):
        record: AccessRecord = request.state.access
        if self.config.log_prompts:
            record.prompt = (json.dumps([m.model_dump(exclude_none=True) for m in req.messages])
                             if isinstance(req, ChatRequest) else str(req.prompt))
        try:
            job = self.submit(req, record.key)
        except APIError as exc:
            record.outcome = "rejected" if exc.status == 429 else "invalid"
            self.telemetry.requests.inc(endpoint=endpoint, status=record.outcome)
            raise
        record.prompt_tokens = len(job.ids)
        rid = record.id = new_id("chatcmpl" if endpoint == "chat" else "cmpl")
        if req.stream:
            return StreamingResponse(self.stream(job, req, endpoint, rid, record),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Request-Id": rid})
        end = await self.answer(job, request, endpoint, record)
        if end.status == "error":
            raise self.failed(end)
        shown = StopText(job.cfg.stop_strings)
        text = shown.cut(self.tokenizer.decode(end.tokens, skip_special_tokens=True))
        finish = self.finish_reason(job, end.tokens, shown.stopped)
        self.record(req, job, rid, text, finish, end)
        build = chat_response if endpoint == "chat" else completion_response
        use = usage(len(job.ids), len(end.tokens), end.stats.cached_prompt_tokens)
        return build(rid, self.config.model_name, text, finish, use, self.summary(end))


def _validation_message(exc: RequestValidationError) -> tuple[int, str, str | None]:
    """(status, message, param) of a request that did not parse: 400 for a body that is not JSON, else 422."""
    errors = exc.errors()
    if not errors:
        return 422, "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return 400, f"the request body is not valid JSON ({first.get('ctx', {}).get('error', 'parse error')})", None
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    where = ".".join(loc) or None
    return 422, (f"{where}: {first.get('msg', 'invalid')}" if where else str(first.get("msg", "invalid request"))), where


def endpoint_of(path: str) -> str:
    """The ``endpoint`` label of a request's path in ``selfspec_requests_total``."""
    return {"/v1/chat/completions": "chat", "/v1/completions": "completions"}.get(path, path)


def create_app(engine: BatchEngine, tokenizer, config: ServerConfig) -> FastAPI:
    """The application; the engine thread starts with it and stops with it."""
    server = Server(engine, tokenizer, config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.worker.start()
        yield
        await asyncio.to_thread(server.worker.stop, 60.0)
        if config.recorder is not None:
            config.recorder.close()

    app = FastAPI(title="selfspec", lifespan=lifespan)
    app.state.server = server
    app.add_middleware(Gate, keys=config.api_keys, metrics_public=config.metrics_public, max_body=config.max_body,
                       log_prompts=config.log_prompts,
                       on_refusal=lambda path, outcome: server.telemetry.requests.inc(endpoint=endpoint_of(path),
                                                                                       status=outcome))

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        status, message, param = _validation_message(exc)
        request.state.access.outcome = "invalid"
        server.telemetry.requests.inc(endpoint=endpoint_of(request.url.path), status="invalid")
        return JSONResponse(error_body(message, param=param), status_code=status)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        return JSONResponse(error_body(f"{type(exc).__name__}: {exc}", "server_error"), status_code=500)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest, request: Request):
        return await server.handle(req, request, "chat")

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        return await server.handle(req, request, "completions")

    @app.post("/v1/heads/reload")
    async def reload(request: Request):
        try:
            body = await request.json()
        except ValueError:
            body = None
        path = body.get("path") if isinstance(body, dict) else None
        if not isinstance(path, str) or not path:
            raise APIError(400, 'the body must be {"path": "<heads folder>"}', param="path")
        return await server.reload_heads(path)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": server.created,
                                            "owned_by": "selfspec"}]}

    @app.get("/health")
    async def health():
        worker = server.worker
        status = "ok" if worker.accepting else "failed" if worker.failure else "stopping"
        body = {"status": status, "waiting": worker.waiting, "running": worker.running}
        if worker.failure:
            body["error"] = worker.failure
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    @app.get("/metrics")
    async def metrics():
        server.telemetry.queue(server.worker.waiting, server.worker.running)
        drafter = server.engine.drafter
        suffix = drafter if hasattr(drafter, "indexes") else getattr(drafter, "lookup", None)
        if hasattr(suffix, "indexes"):
            server.telemetry.suffix_index(suffix.indexes())
        server.telemetry.footprint(server.worker)
        return PlainTextResponse(server.telemetry.render(), media_type="text/plain; version=0.0.4")

    return app
