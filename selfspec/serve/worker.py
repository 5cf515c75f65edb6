"""One engine, many clients: a bounded queue of requests and the thread that decodes them, batched.

The engine thread owns a ``BatchEngine``: requests decode together, up to its ``max_batch`` at a time, one target
pass per step for all of them (``selfspec/batching.py``); requests join between steps as rows free up. Beyond
the batch, at most ``max_waiting`` requests wait in a queue; past it :meth:`EngineWorker.submit` refuses (the
server answers 429). Each step's committed tokens go to the request's ``asyncio.Queue`` on the server's event
loop. A request whose client went away is cancelled: its row is freed at the next step. A step that fails is
answered as a server fault (500) for the requests in it and the worker goes on with a fresh batch; if the thread
itself dies, it logs why, fails every waiting request and refuses new ones (``failure``: the server's health
turns 503).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from ..batching import BatchEngine
from ..errors import SelfspecError
from ..request import DecodeConfig, Request
from ..stats import GenerationStats
from . import footprint

log = logging.getLogger("selfspec.serve")
TRIM_EVERY_S = 60.0


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
class Swap:
    """Newer heads to draft with, handed to the engine thread, which applies them between steps."""

    drafter: object
    name: str
    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None


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
    heads: str | None = None  # the heads serving when it started (they draft it to its end)
    deadline: float | None = None  # time.monotonic() past which the request ends with a timeout (None: never)
    tokens: list[int] = field(default_factory=list)  # committed so far

    def send(self, event: Burst | Finished) -> None:
        """Hand ``event`` to the request's coroutine (from any thread)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def cancel(self) -> None:
        """Stop this request after the step in progress (or before it starts)."""
        self.cancelled.set()

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline

    def timeout(self) -> str:
        return (f"the request did not finish within this server's --request-timeout "
                f"({self.deadline - self.submitted:.3g} s); it was stopped and its row freed")


class EngineWorker:
    """The thread that owns the batch engine; requests reach it through :meth:`submit`. ``on_finish(job, end)`` is
    called as a request ends, ``on_step(step)`` (a ``StepStats``) after every batched pass (engine thread both)."""

    def __init__(self, engine: BatchEngine, max_waiting: int = 16, on_finish=None, on_step=None) -> None:
        if max_waiting < 1:
            raise SelfspecError(f"the queue must hold at least one request, got {max_waiting}")
        self.engine = engine
        self.max_waiting = max_waiting
        self.on_finish, self.on_step = on_finish, on_step
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.lock = threading.Lock()
        self.waiting = 0  # queued, not yet in the batch
        self.active: dict[Request, Job] = {}  # in the batch (joining or decoding)
        self.accepting = True
        self.stopping = False
        self.failure: str | None = None  # why the engine thread died, if it did
        self.request_s: float | None = None  # moving average of a request's decoding time (for Retry-After)
        self.heads: str | None = None  # the heads new requests draft with (a name for /metrics)
        self.swap_pending: Swap | None = None
        self.trimmed, self.trim_s = time.monotonic(), 0.0  # the last trim of the C heap, seconds spent trimming
        self.thread = threading.Thread(target=self._loop, name="selfspec-engine", daemon=True)

    @property
    def running(self) -> int:
        """Requests in the batch."""
        return len(self.active)

    def start(self) -> None:
        self.thread.start()

    def submit(self, job: Job) -> bool:
        """Queue ``job``; False when the batch's free rows and the queue are full or the worker is shutting down."""
        with self.lock:
            if not self.accepting or self.waiting + len(self.active) >= self.max_waiting + self.engine.max_batch:
                return False
            self.waiting += 1
        self.jobs.put(job)
        return True

    def swap(self, swap: Swap, timeout: float = 60.0) -> None:
        """Hand newer heads to the engine thread and wait until it drafts new requests with them (between two steps;
        at once when idle); ``swap.error`` says why it refused them."""
        with self.lock:
            if not self.accepting:
                swap.error = "the server is shutting down"
                return
            self.swap_pending = swap
        self.jobs.put(swap)  # wakes an idle engine thread
        if not swap.done.wait(timeout):
            swap.error = f"the engine thread did not take the new heads within {timeout:.0f} s"

    def _apply_swap(self) -> None:
        with self.lock:
            swap, self.swap_pending = self.swap_pending, None
        if swap is None:
            return
        try:
            self.engine.swap_drafter(swap.drafter)
            self.heads = swap.name
        except SelfspecError as exc:
            swap.error = str(exc)
        swap.done.set()

    def retry_after(self) -> int:
        """Seconds a refused client should wait: the queue ahead of it, a batch at a time, at the measured time per
        request."""
        batches = (self.waiting + 1) / self.engine.max_batch
        return max(1, round(batches * (self.request_s or 1.0)))

    def stop(self, timeout: float | None = None) -> None:
        """Refuse new requests, fail the queued ones, let the batch finish (up to ``timeout``)."""
        with self.lock:
            self.accepting = False
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if isinstance(job, Swap):
                job.error = "the server is shutting down"
                job.done.set()
            elif job is not None:
                with self.lock:
                    self.waiting -= 1
                job.send(Finished("error", GenerationStats(), [], "the server is shutting down", "unavailable"))
        self.jobs.put(None)
        self.thread.join(timeout)

    def _loop(self) -> None:
        try:
            while self._admit():
                self._apply_swap()
                self._step()
                self._trim()
        except BaseException as exc:  # the thread is dying: say why, and let nobody wait for it
            self._die(exc)

    def _admit(self) -> bool:
        """Move queued jobs into the batch while it has rows (waiting for one when idle). False: stop."""
        while len(self.active) < self.engine.max_batch:
            try:
                job = self.jobs.get(block=not self.active and not self.stopping)
            except queue.Empty:
                break
            if job is None:
                self.stopping = True
                continue
            if isinstance(job, Swap):  # a wake-up: applied here when idle, else before the next step
                self._apply_swap()
                continue
            req = None
            if job.cancelled.is_set():
                self._finish(job, Finished("cancelled", GenerationStats(), []))
            elif job.expired(time.monotonic()):
                self._finish(job, Finished("error", GenerationStats(), [], job.timeout(), "timeout_error"))
            else:
                try:
                    req = self.engine.add(job.ids, job.cfg, GenerationStats())
                except SelfspecError as exc:  # a request the server's checks let through but this engine cannot run
                    self._finish(job, Finished("error", GenerationStats(), [], str(exc), "invalid_request_error"))
            with self.lock:  # from the queue into the batch in one move, as submit counts them
                self.waiting -= 1
                if req is not None:
                    job.started, job.heads = time.monotonic(), self.heads
                    self.active[req] = job
        return bool(self.active) or not self.stopping

    def _step(self) -> None:
        """One batched step; its tokens to their requests; requests that ended answered."""
        now = time.monotonic()
        for req, job in list(self.active.items()):
            if job.cancelled.is_set() or job.expired(now):  # its row is freed at the start of the step below
                self.engine.cancel(req)
                if job.cancelled.is_set():
                    self._end(req, "cancelled")
                else:
                    self._end(req, "error", job.timeout(), "timeout_error")
        try:
            events = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - a fault of the server's, which must not stop it
            log.exception("a batched decoding step failed")
            self.engine.reset()
            for req in list(self.active):
                self._end(req, "error", f"{type(exc).__name__}: {exc}")
            return
        now = time.monotonic()
        for req, new in events:
            self.active[req].tokens += new
            self.active[req].send(Burst(new, now))
        if self.on_step is not None and events:
            self.on_step(self.engine.last_step)
        for req in [r for r in self.active if r.finished]:
            self._end(req, "ok")

    def _trim(self) -> None:
        """Every ``TRIM_EVERY_S`` between steps, hand the C heap's free pages back to the system (prompts' KV, passes'
        activations and the drafter's rows come and go in every size, and glibc keeps the holes they leave)."""
        now = time.monotonic()
        if now - self.trimmed >= TRIM_EVERY_S:
            footprint.trim()
            self.trimmed = time.monotonic()
            self.trim_s += self.trimmed - now

    def _end(self, req: Request, status: str, error: str | None = None, error_type: str = "server_error") -> None:
        job = self.active.pop(req)
        if status == "ok":
            elapsed = time.monotonic() - job.started
            self.request_s = elapsed if self.request_s is None else 0.7 * self.request_s + 0.3 * elapsed
        self._finish(job, Finished(status, req.stats, job.tokens, error, error_type))

    def _die(self, exc: BaseException) -> None:
        log.error("the engine thread died; the server refuses requests from now on", exc_info=exc)
        with self.lock:
            self.accepting = False
            self.failure = f"{type(exc).__name__}: {exc}"
        pending = list(self.active.values())
        self.active.clear()
        while True:
            try:
                pending.append(self.jobs.get_nowait())
            except queue.Empty:
                break
        for waiting in pending:
            if isinstance(waiting, Swap):
                waiting.error = f"the engine failed ({self.failure})"
                waiting.done.set()
            elif waiting is not None:
                waiting.send(Finished("error", GenerationStats(), [], f"the engine failed ({self.failure})",
                                      "unavailable"))

    def _finish(self, job: Job, end: Finished) -> None:
        if self.on_finish is not None:
            self.on_finish(job, end)
        job.send(end)
