"""One engine, many clients: a bounded queue of requests and the thread that decodes them one at a time.

The engine decodes one sequence at a time (its static KV cache is shared by every request), so requests
wait in a queue of at most ``max_waiting``; past it :meth:`EngineWorker.submit` refuses (the server answers
429). Each step's committed tokens go to the request's ``asyncio.Queue`` on the server's event loop. A request
whose client went away is cancelled: the engine stops it after the step in progress and takes the next.
A request whose decoding fails is answered as a server fault (500) and the worker goes on; if the thread itself
dies, it logs why, fails every waiting request and refuses new ones (``failure``: the server's health turns 503).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from ..engine import DecodeConfig, SpeculativeEngine
from ..errors import SelfspecError
from ..stats import GenerationStats

log = logging.getLogger("selfspec.serve")


@dataclass
class Burst:
    """Tokens one step committed, and when."""

    tokens: list[int]
    time: float


@dataclass
class Finished:
    """The request's end: ``status`` is "ok", "cancelled" or "error" (then ``error`` says why)."""

    status: str
    stats: GenerationStats
    tokens: list[int]
    error: str | None = None
    error_type: str = "server_error"


@dataclass
class Job:
    """One request's prompt, settings and outbox."""

    ids: list[int]
    cfg: DecodeConfig
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.monotonic)
    started: float | None = None

    def send(self, event: Burst | Finished) -> None:
        """Hand ``event`` to the request's coroutine (from any thread)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def cancel(self) -> None:
        """Stop this request after the step in progress (or before it starts)."""
        self.cancelled.set()


class EngineWorker:
    """The thread that owns the engine; requests reach it through :meth:`submit`."""

    def __init__(self, engine: SpeculativeEngine, max_waiting: int = 16, on_finish=None) -> None:
        if max_waiting < 1:
            raise SelfspecError(f"the queue must hold at least one request, got {max_waiting}")
        self.engine = engine
        self.max_waiting = max_waiting
        self.on_finish = on_finish  # the metrics hook, called on the engine thread as a request ends
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.lock = threading.Lock()
        self.waiting = 0
        self.running: Job | None = None
        self.accepting = True
        self.failure: str | None = None  # why the engine thread died, if it did
        self.request_s: float | None = None  # moving average of a request's decoding time (for Retry-After)
        self.thread = threading.Thread(target=self._loop, name="selfspec-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def submit(self, job: Job) -> bool:
        """Queue ``job``; False when the queue is full or the worker is shutting down."""
        with self.lock:
            if not self.accepting or self.waiting >= self.max_waiting:
                return False
            self.waiting += 1
        self.jobs.put(job)
        return True

    def retry_after(self) -> int:
        """Seconds a refused client should wait: the queue ahead of it at the measured time per request."""
        return max(1, round((self.waiting + 1) * (self.request_s or 1.0)))

    def stop(self, timeout: float | None = None) -> None:
        """Refuse new requests, fail the queued ones, let the running one finish (up to ``timeout``)."""
        with self.lock:
            self.accepting = False
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                with self.lock:
                    self.waiting -= 1
                job.send(Finished("error", GenerationStats(), [], "the server is shutting down", "unavailable"))
        self.jobs.put(None)
        self.thread.join(timeout)

    def _loop(self) -> None:
        job = None
        try:
            while True:
                job = self.jobs.get()
                if job is None:
                    return
                with self.lock:
                    self.waiting -= 1
                    self.running = job
                try:
                    self._run(job)
                finally:
                    with self.lock:
                        self.running = None
        except BaseException as exc:  # the thread is dying: say why, and let nobody wait for it
            self._die(exc, job)

    def _die(self, exc: BaseException, job: Job | None) -> None:
        log.error("the engine thread died; the server refuses requests from now on", exc_info=exc)
        with self.lock:
            self.accepting = False
            self.failure = f"{type(exc).__name__}: {exc}"
        pending = [job] if job is not None else []
        while True:
            try:
                pending.append(self.jobs.get_nowait())
            except queue.Empty:
                break
        for waiting in pending:
            if waiting is not None:
                waiting.send(Finished("error", GenerationStats(), [], f"the engine failed ({self.failure})",
                                      "unavailable"))

    def _run(self, job: Job) -> None:
        stats, tokens = GenerationStats(), []
        if job.cancelled.is_set():
            return self._finish(job, Finished("cancelled", stats, tokens))
        job.started = time.monotonic()
        steps = None
        try:
            steps = self.engine.steps(job.ids, job.cfg, stats)
            for new in steps:
                tokens += new
                job.send(Burst(new, time.monotonic()))
                if job.cancelled.is_set():
                    break
        except Exception as exc:  # noqa: BLE001 - the request was checked when it came in: a fault of the server's,
            log.exception("decoding a request failed")  # which must not stop it
            return self._finish(job, Finished("error", stats, tokens, f"{type(exc).__name__}: {exc}"))
        finally:
            if steps is not None:
                steps.close()
        elapsed = time.monotonic() - job.started
        self.request_s = elapsed if self.request_s is None else 0.7 * self.request_s + 0.3 * elapsed
        self._finish(job, Finished("cancelled" if job.cancelled.is_set() else "ok", stats, tokens))

    def _finish(self, job: Job, end: Finished) -> None:
        if self.on_finish is not None:
            self.on_finish(job, end)
        job.send(end)
