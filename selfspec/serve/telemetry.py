"""What the server counts, as Prometheus metrics (``/metrics``).

Per engine step (engine thread): one target pass, its seconds and the drafting before it, however many requests
share it, so the seconds add up to at most the wall time. Per finished request (engine thread): tokens, the
passes it took part in (``selfspec_row_passes_total``: τ = tokens / row passes), drafts reaching and accepted at
each depth, the time it queued. Per request on the event loop: the outcome, time to first token (from arrival
to the engine committing its first token, streamed or not), the gaps between streamed tokens as the client
receives them.
"""

from __future__ import annotations

from ..batching import StepStats
from . import footprint
from .metrics import Counter, Gauge, Histogram, Registry
from .worker import Finished, Job

BATCH_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256)
GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)


class Telemetry:
    """The server's metrics and the hooks that fill them."""

    def __init__(self) -> None:
        r = self.registry = Registry()
        self.requests = r.add(Counter("selfspec_requests_total", "Requests answered, by endpoint and outcome"))
        self.prompt_tokens = r.add(Counter("selfspec_prompt_tokens_total", "Prompt tokens of requests decoded"))
        self.cached = r.add(Counter("selfspec_prompt_tokens_cached_total",
                                    "Prompt tokens whose K/V the prefix cache gave (not recomputed)"))
        self.tokens = r.add(Counter("selfspec_generation_tokens_total", "Tokens the engine committed"))
        self.passes = r.add(Counter("selfspec_target_passes_total",
                                    "Target verification passes (one per engine step, whatever the rows)"))
        self.row_passes = r.add(Counter("selfspec_row_passes_total",
                                        "Per request: target passes each finished request took part in, summed"))
        self.tau = r.add(Gauge("selfspec_mean_accepted_tokens",
                               "Tokens per request per pass over finished requests (tau = tokens / row passes)"))
        self.draft_s = r.add(Counter("selfspec_draft_seconds_total", "Seconds the engine spent drafting"))
        self.verify_s = r.add(Counter("selfspec_verify_seconds_total", "Seconds the engine spent in target passes"))
        self.reached = r.add(Counter("selfspec_draft_reached_total",
                                     "Draft steps whose accepted path reached depth-1 (the draft was judged at depth)"))
        self.accepted = r.add(Counter("selfspec_draft_accepted_total", "Draft tokens accepted, by depth"))
        self.waiting = r.add(Gauge("selfspec_queue_length", "Requests waiting for the engine"))
        self.running = r.add(Gauge("selfspec_requests_running", "Requests in the engine's batch"))
        self.batch = r.add(Histogram("selfspec_batch_size", "Requests verified per target pass", BATCH_BUCKETS))
        self.drafted = r.add(Histogram("selfspec_draft_tokens_per_step",
                                       "Draft tokens verified per target pass, all requests together", BATCH_BUCKETS))
        self.ttft = r.add(Histogram("selfspec_time_to_first_token_seconds",
                                    "From the request's arrival to the engine committing its first token"))
        self.gap = r.add(Histogram("selfspec_inter_token_latency_seconds",
                                   "Gaps between tokens sent to a streaming client", GAP_BUCKETS))
        self.queued = r.add(Histogram("selfspec_queue_wait_seconds", "From a request's arrival to its start"))
        self.duration = r.add(Histogram("selfspec_request_duration_seconds", "From arrival to the last token sent"))
        self.heads = r.add(Gauge("selfspec_heads_info", "Heads folders: 1 for the one new requests draft with"))
        self.heads_tau = r.add(Gauge("selfspec_heads_mean_accepted_tokens",
                                     "tau of the finished requests each heads folder drafted (tokens / row passes)"))
        self.suffix = r.add(Gauge("selfspec_suffix_index", "The suffix drafter's index (--drafter suffix): bytes held "
                                  "(within its bound), sequences, lookups and lookups that found a match, summed over its "
                                  "indexes (scopes: one shared, one per API key with --suffix-scope key)"))
        self.resident = r.add(Gauge("process_resident_memory_bytes", "Resident memory of the server process"))
        self.memory = r.add(Gauge("selfspec_memory_bytes", "The server's memory by part: the target's KV rows, the "
                                  "prefix cache as it accounts itself, as its tensors hold it and its bound "
                                  "(--prefix-cache), the drafter's caches, the C heap in use and free (*_entries: "
                                  "counts)"))
        self.trim_s = r.add(Gauge("selfspec_heap_trim_seconds_total", "Seconds the engine thread spent handing the C "
                                  "heap's free pages back to the system (once a minute between steps)"))
        self._by_heads: dict[str, list[float]] = {}  # heads -> [tokens, row passes]
        self._heads_seen: set[str] = set()

    def on_finish(self, job: Job, end: Finished) -> None:
        """Engine thread: count what the request's decoding did."""
        s = end.stats
        self.prompt_tokens.inc(len(job.ids))
        self.cached.inc(s.cached_prompt_tokens)
        self.tokens.inc(s.new_tokens)
        self.row_passes.inc(s.target_forwards)
        for depth, (r, a) in enumerate(zip(s.reached_depth, s.accepted_at_depth), start=1):
            self.reached.inc(r, depth=str(depth))
            self.accepted.inc(a, depth=str(depth))
        passes = self.row_passes.value()
        self.tau.set(self.tokens.value() / passes if passes else 0.0)
        if job.started is not None:
            self.queued.observe(job.started - job.submitted)
        if job.heads is not None and s.target_forwards:
            total = self._by_heads.setdefault(job.heads, [0.0, 0.0])
            total[0] += s.new_tokens
            total[1] += s.target_forwards
            self.heads_tau.set(total[0] / total[1], heads=job.heads)

    def serving(self, heads: str) -> None:
        """``heads`` now drafts new requests."""
        self._heads_seen.add(heads)
        for name in self._heads_seen:
            self.heads.set(1 if name == heads else 0, heads=name)

    def on_step(self, step: StepStats) -> None:
        """Engine thread: one batched pass over ``step.rows`` requests verified ``step.drafted`` draft tokens."""
        self.passes.inc()
        self.verify_s.inc(step.pass_s)
        self.draft_s.inc(step.draft_s)
        self.batch.observe(step.rows)
        self.drafted.observe(step.drafted)

    def queue(self, waiting: int, running: int) -> None:
        self.waiting.set(waiting)
        self.running.set(running)

    def suffix_index(self, indexes) -> None:
        """The suffix drafter's indexes as they stand, summed (read between steps: plain integers, no lock needed);
        ``scopes``: how many (one shared, and one per API key that sent a request under ``--suffix-scope key``)."""
        for what, value in (("bytes", sum(i.nbytes for i in indexes)), ("max_bytes", sum(i.max_bytes for i in indexes)),
                            ("sequences", sum(len(i.seqs) for i in indexes)), ("lookups", sum(i.lookups for i in indexes)),
                            ("hits", sum(i.hits for i in indexes)), ("scopes", len(indexes))):
            self.suffix.set(value, part=what)

    def footprint(self, worker) -> None:
        """The process's resident memory, the engine's by part (``serve/footprint.py``), the time spent trimming."""
        resident = footprint.resident_bytes()
        if resident is not None:
            self.resident.set(resident)
        for part, value in footprint.parts(worker.engine).items():
            self.memory.set(value, part=part)
        self.trim_s.set(worker.trim_s)

    def render(self) -> str:
        return self.registry.render()
