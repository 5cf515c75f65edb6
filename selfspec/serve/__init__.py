"""``selfspec serve``: an OpenAI-compatible HTTP server over one speculative engine.

    app.py        the routes: /v1/chat/completions, /v1/completions (streamed as server-sent events or
                  not), /v1/models, /health, /metrics
    gate.py       in front of the routes: the API key, the body's size limit, the access log
    protocol.py   OpenAI's request and response shapes, checked as they parse; its error JSON
    worker.py     the bounded queue, per-request deadlines, and the thread that decodes the batch
    pacing.py     stream smoothing: tokens committed in bursts released at the measured rate
    telemetry.py  what /metrics counts; metrics.py the Prometheus text format

FastAPI on uvicorn: the ASGI stack most Python model servers use (vLLM's OpenAI server among them), with
request validation built in, server-sent events through ``StreamingResponse``, and client disconnects
surfaced to the stream's task. Install with ``pip install "selfspec[serve]"``.
"""

from __future__ import annotations

from .app import ServerConfig, create_app

__all__ = ["ServerConfig", "create_app", "run"]


def run(engine, tokenizer, config: ServerConfig, host: str = "127.0.0.1", port: int = 8000,
        log_level: str = "info", graceful_timeout: float = 30.0) -> None:
    """Serve until interrupted; on SIGINT/SIGTERM finish or cancel (after ``graceful_timeout`` s) what is in flight."""
    import logging

    import uvicorn

    access = logging.getLogger("selfspec.access")  # our access log replaces uvicorn's (it knows tokens and TTFT)
    if not access.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s access %(message)s"))
        access.addHandler(handler)
        access.propagate = False
    access.setLevel(log_level.upper())
    uvicorn.run(create_app(engine, tokenizer, config), host=host, port=port, log_level=log_level,
                timeout_graceful_shutdown=graceful_timeout, access_log=False)
