"""Load a ``selfspec serve`` endpoint and measure what its clients see.

    python -m selfspec_eval.serve_load --model smollm2-135m-instruct \\
        --server "--heads checkpoints/smollm2-135m-instruct-eagle" --server "--drafter none" \\
        --concurrency 1,4 --requests 8 --max-tokens 96

For each ``--server`` (extra ``selfspec serve`` arguments; each starts its own server on a free loopback
port and stops it afterwards) and each concurrency, ``--requests`` streamed chat requests (held-out
ShareGPT and HumanEval first turns, greedy) are sent by that many concurrent clients, each prompt twice
in a row with smoothing on and off. Per request, as the client receives it: time to first token, the gaps
between tokens (inter-token latency), and tokens per second after the first token. Bounded: at most
``--requests`` per cell, each at most ``--max-tokens``, the whole run under ``--time-limit`` seconds.
Loopback only: ``--url`` must point at 127.0.0.1 / localhost.
"""

from __future__ import annotations

import argparse
import json
import shlex
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from selfspec.zoo import load_tokenizer

from .prompts import load_bench_prompts

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


@dataclass
class Sample:
    """One streamed request as the client saw it."""

    smooth: bool
    ttft_s: float
    gaps_s: list[float] = field(default_factory=list)
    tokens: int = 0
    total_s: float = 0.0
    error: str | None = None

    @property
    def tokens_per_s(self) -> float:
        after_first = self.total_s - self.ttft_s
        return (self.tokens - 1) / after_first if self.tokens > 1 and after_first > 0 else 0.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen | None, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"no server answered at {url} within {timeout:.0f} s")


def start_server(model: str, extra: str, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "selfspec_cli", "serve", "--model", model, "--port", str(port),
           "--queue-size", "64", *shlex.split(extra)]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, proc, 600)
    return proc, url


def stream_once(url: str, model: str, messages: list[dict], max_tokens: int, smooth: bool) -> Sample:
    """One streamed chat request; the arrival time of every content chunk."""
    body = json.dumps({"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True, "smooth": smooth}).encode()
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    start = time.monotonic()
    arrivals = []
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return Sample(smooth, 0.0, error=chunk["error"]["message"])
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    arrivals.append(time.monotonic())
    except OSError as exc:
        return Sample(smooth, 0.0, error=str(exc))
    if not arrivals:
        return Sample(smooth, 0.0, error="no tokens")
    return Sample(smooth, arrivals[0] - start, [b - a for a, b in zip(arrivals, arrivals[1:])], len(arrivals),
                  arrivals[-1] - start)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))]


def summarize(samples: list[Sample]) -> dict:
    ok = [s for s in samples if s.error is None]
    gaps = [g for s in ok for g in s.gaps_s]
    return {"requests": len(samples), "errors": len(samples) - len(ok),
            "ttft_p50_ms": 1e3 * percentile([s.ttft_s for s in ok], 50),
            "itl_p50_ms": 1e3 * percentile(gaps, 50), "itl_p99_ms": 1e3 * percentile(gaps, 99),
            "itl_stdev_ms": 1e3 * (statistics.pstdev(gaps) if len(gaps) > 1 else 0.0),
            "tokens_per_s": statistics.mean([s.tokens_per_s for s in ok]) if ok else 0.0}


def run_cell(url: str, model: str, prompts: list[list[dict]], concurrency: int, requests: int, max_tokens: int,
             deadline: float) -> list[Sample]:
    """``requests`` streamed requests by ``concurrency`` clients: each prompt twice in a row, smoothing on then
    off, so both settings see the same prompts."""
    lock = threading.Lock()
    jobs = [(prompts[(i // 2) % len(prompts)], i % 2 == 0) for i in range(requests)]
    samples: list[Sample] = []

    def client() -> None:
        while time.monotonic() < deadline:
            with lock:
                if not jobs:
                    return
                messages, smooth = jobs.pop(0)
            sample = stream_once(url, model, messages, max_tokens, smooth)
            with lock:
                samples.append(sample)

    with ThreadPoolExecutor(concurrency) as pool:
        for _ in range(concurrency):
            pool.submit(client)
    return samples


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m selfspec_eval.serve_load", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="the model the servers serve")
    p.add_argument("--server", action="append", default=[],
                   help="extra `selfspec serve` arguments for one server (repeat to compare; default: plain)")
    p.add_argument("--url", help="an already running server on this machine instead of starting one")
    p.add_argument("--concurrency", default="1,4", help="concurrent clients, comma-separated")
    p.add_argument("--requests", type=int, default=8, help="requests per cell (server x concurrency)")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--time-limit", type=float, default=1800.0, help="stop sending after this many seconds")
    p.add_argument("--out", help="write every sample and the summary here (JSON)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.url and urlparse(args.url).hostname not in LOOPBACK:
        print("serve_load: error: --url must be a loopback address (127.0.0.1 / localhost)", file=sys.stderr)
        return 2
    tok = load_tokenizer(args.model)
    prompts = [p.messages([]) for p in load_bench_prompts(["chat", "code"], max(1, args.requests // 4), tok, 300)]
    deadline = time.monotonic() + args.time_limit
    servers = [None] if args.url else (args.server or ["--drafter none"])
    results = []
    for extra in servers:
        proc = None
        if args.url:
            url = args.url.rstrip("/")
            wait_ready(url, None, 30)
        else:
            proc, url = start_server(args.model, extra, Path(args.out or "serve_load").with_suffix(".server.log"))
        try:
            stream_once(url, args.model, prompts[0], 8, False)  # warm-up
            for c in (int(x) for x in args.concurrency.split(",")):
                samples = run_cell(url, args.model, prompts, c, args.requests, args.max_tokens, deadline)
                for smooth in (True, False):
                    row = {"server": extra or url, "concurrency": c, "smooth": smooth,
                           **summarize([s for s in samples if s.smooth == smooth])}
                    results.append({**row, "samples": [asdict(s) for s in samples if s.smooth == smooth]})
                    print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                          flush=True)
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(60)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
