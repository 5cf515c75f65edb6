"""Load a ``selfspec serve`` endpoint (and vLLM's own OpenAI server beside it) and measure what clients see.

    python -m selfspec_eval.serve_load --model smollm2-135m-instruct \\
        --server "--heads checkpoints/smollm2-135m-instruct-eagle" --server "--drafter none" \\
        --vllm plain --vllm checkpoints/experimental/smollm2-135m-instruct-eagle3 \\
        --concurrency 1,4,16 --requests 16 --max-tokens 96 --smooth off

For each ``--server`` (extra ``selfspec serve`` arguments; each starts its own server on a free loopback
port and stops it afterwards), each ``--vllm`` (``plain``, or a heads folder exported to vLLM's layout and drafted
with; vLLM's OpenAI server from its environment, ``make vllm-env``, bf16, eager, Intel OpenMP as
``vllm_worker.py`` runs it) and each concurrency, ``--requests`` streamed chat requests (held-out ShareGPT and
HumanEval first turns, greedy) are sent by that many concurrent clients (``--smooth both``: each prompt twice
in a row, selfspec's smoothing on and off). Per cell: total tokens/s (every token over the cell's wall time);
per request, as the client receives it: time to first token, the gaps between tokens (inter-token latency), and
tokens per second after the first token. Bounded: at most ``--requests`` per cell, each at most
``--max-tokens``, the whole run under ``--time-limit`` seconds. Loopback only: ``--url`` must point at
127.0.0.1 / localhost.
"""

from __future__ import annotations

import argparse
import json
import os
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

from .environment import environment
from .prompts import load_bench_prompts

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


@dataclass
class Sample:
    """One streamed request as the client saw it."""

    smooth: bool | None  # selfspec's stream smoothing asked for (None: not asked, another server)
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


def start_vllm(model: str, which: str, log: Path) -> tuple[subprocess.Popen, str]:
    """vLLM's OpenAI server for ``model`` (``which``: "plain" or a heads folder to export and draft with)."""
    from selfspec.export import export_for_serving, vllm_serve_flags
    from selfspec.zoo import resolve

    from .vllm_client import missing_environment, vllm_python
    from .vllm_worker import ENV_DEFAULTS, OPENMP

    if missing_environment():
        raise RuntimeError(missing_environment())
    folder = resolve(model)
    python = vllm_python()
    port = free_port()
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", folder, "--served-model-name", model,
           "--port", str(port), "--host", "127.0.0.1", "--dtype", "bfloat16", "--enforce-eager", "--seed", "0"]
    if which != "plain":
        exported = export_for_serving(which, log.with_suffix(".export"), "vllm", base=folder)
        cmd += vllm_serve_flags(exported)
    # The model gets every core: by default vLLM's server keeps one for its scheduler, and on 2 cores the model then
    # ran on one (Qwen2.5-Coder-1.5B plain: 3.8 / 13.5 / 46.9 tokens/s at 1 / 4 / 16 clients, 6.4 / 23.0 / 78.4
    # with both), as the offline worker's in-process engine does.
    env = {**ENV_DEFAULTS, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", **os.environ}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the API server runs its engine core in its own process
    lib = python.parent.parent / "lib" / OPENMP
    if lib.is_file():
        env["LD_PRELOAD"] = ":".join(filter(None, [str(lib), env.get("LD_PRELOAD")]))
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, proc, 900)
    return proc, url


def stream_once(url: str, model: str, messages: list[dict], max_tokens: int, smooth: bool | None) -> Sample:
    """One streamed chat request (``smooth`` None: no selfspec field, for other servers); the arrival time of
    every content chunk."""
    fields = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    body = json.dumps({**fields, **({} if smooth is None else {"smooth": smooth})}).encode()
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


def summarize(samples: list[Sample], cell_tokens_per_s: float) -> dict:
    """The figures of ``samples`` (the cell's total throughput, every request of it, given)."""
    ok = [s for s in samples if s.error is None]
    gaps = [g for s in ok for g in s.gaps_s]
    return {"requests": len(samples), "errors": len(samples) - len(ok), "total_tokens_per_s": cell_tokens_per_s,
            "ttft_p50_ms": 1e3 * percentile([s.ttft_s for s in ok], 50),
            "ttft_p99_ms": 1e3 * percentile([s.ttft_s for s in ok], 99),
            "itl_p50_ms": 1e3 * percentile(gaps, 50), "itl_p99_ms": 1e3 * percentile(gaps, 99),
            "itl_stdev_ms": 1e3 * (statistics.pstdev(gaps) if len(gaps) > 1 else 0.0),
            "tokens_per_s": statistics.mean([s.tokens_per_s for s in ok]) if ok else 0.0}


def prompts_needed(cells: int, requests: int, smooth: str, fresh: bool) -> int:
    """Distinct prompts a run sends: the warm-up's own, then requests/2 shared by every cell, or (``fresh``) each
    cell's own, one per request (one per pair with ``smooth`` both, whose pairs send a prompt twice)."""
    per_cell = max(1, requests // 2 if smooth == "both" or not fresh else requests)
    return 1 + per_cell * (cells if fresh else 1)


def split_prompts(prompts: list, cells: int, fresh: bool) -> tuple[object, list[list]]:
    """(the warm-up's prompt, each cell's prompts) from ``prompts_needed`` prompts: the warm-up's is never sent
    again; ``fresh``: no two cells share a prompt, else every cell sends the same ones."""
    warm, rest = prompts[-1], prompts[:-1]
    if not fresh:
        return warm, [rest] * cells
    per_cell = len(rest) // cells
    return warm, [rest[i * per_cell:(i + 1) * per_cell] for i in range(cells)]


def run_cell(url: str, model: str, prompts: list[list[dict]], concurrency: int, requests: int, max_tokens: int,
             deadline: float, smooth: str = "both") -> tuple[list[Sample], float]:
    """``requests`` streamed requests by ``concurrency`` clients (``smooth`` "both": each prompt twice in a row,
    smoothing on then off, so both settings see the same prompts; "on", "off"; "none": no selfspec field).
    Returns the samples and the cell's wall time."""
    lock = threading.Lock()
    if smooth == "both":
        jobs = [(prompts[(i // 2) % len(prompts)], i % 2 == 0) for i in range(requests)]
    else:
        jobs = [(prompts[i % len(prompts)], {"on": True, "off": False, "none": None}[smooth]) for i in range(requests)]
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

    start = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        for _ in range(concurrency):
            pool.submit(client)
    return samples, time.monotonic() - start


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m selfspec_eval.serve_load", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="the model the servers serve")
    p.add_argument("--server", action="append", default=[],
                   help="extra `selfspec serve` arguments for one server (repeat to compare; default: plain)")
    p.add_argument("--vllm", action="append", default=[], metavar="plain|HEADS",
                   help="vLLM's OpenAI server too: plain, or drafting with a heads folder exported to vLLM (repeat)")
    p.add_argument("--url", help="an already running server on this machine instead of starting one")
    p.add_argument("--smooth", choices=("both", "on", "off"), default="both",
                   help="selfspec's stream smoothing per request (both: each prompt with it on and off)")
    p.add_argument("--concurrency", default="1,4", help="concurrent clients, comma-separated")
    p.add_argument("--requests", type=int, default=8, help="requests per cell (server x concurrency)")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--fresh", action="store_true",
                   help="prompts never sent before to the server: each cell its own, once each (twice with --smooth "
                        "both); by default a cell sends each of requests/2 prompts twice and every cell the same "
                        "ones, which a server's prefix cache (selfspec's, vLLM's) then mostly answers from memory")
    p.add_argument("--time-limit", type=float, default=1800.0, help="stop sending after this many seconds")
    p.add_argument("--out", help="write every sample and the summary here (JSON)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.url and urlparse(args.url).hostname not in LOOPBACK:
        print("serve_load: error: --url must be a loopback address (127.0.0.1 / localhost)", file=sys.stderr)
        return 2
    tok = load_tokenizer(args.model)
    levels = [int(x) for x in args.concurrency.split(",")]
    want = prompts_needed(len(levels), args.requests, args.smooth, args.fresh)
    prompts = [p.messages([]) for p in load_bench_prompts(["chat", "code"], -(-want // 2), tok, 300)]
    if len(prompts) < want:
        raise SystemExit(f"serve_load: error: {want} held-out prompts needed, {len(prompts)} found")
    warm, cell_prompts = split_prompts(prompts[:want], len(levels), args.fresh)
    deadline = time.monotonic() + args.time_limit
    servers = [("url", None)] if args.url else [("selfspec", x) for x in args.server or ([] if args.vllm else
                                                                                         ["--drafter none"])]
    servers += [("vllm", x) for x in args.vllm]
    log = Path(args.out or "serve_load")
    results = []
    for i, (kind, extra) in enumerate(servers):
        proc = None
        if kind == "url":
            url = args.url.rstrip("/")
            wait_ready(url, None, 30)
        elif kind == "vllm":
            proc, url = start_vllm(args.model, extra, log.with_suffix(f".vllm{i}.log"))
        else:
            proc, url = start_server(args.model, extra, log.with_suffix(f".server{i}.log"))
        modes = ["none"] if kind == "vllm" else ["on", "off"] if args.smooth == "both" else [args.smooth]
        try:
            stream_once(url, args.model, warm, 8, None if kind == "vllm" else False)  # warm-up
            for cell, c in enumerate(levels):
                samples, wall = run_cell(url, args.model, cell_prompts[cell], c, args.requests, args.max_tokens,
                                         deadline, "none" if kind == "vllm" else args.smooth)
                total = sum(s.tokens for s in samples if s.error is None) / wall
                for mode in modes:
                    mine = [s for s in samples if {"on": s.smooth is True, "off": s.smooth is False,
                                                   "none": True}[mode]]
                    row = {"server": f"vllm {extra}" if kind == "vllm" else extra or url, "concurrency": c,
                           "smooth": mode, **summarize(mine, total)}
                    results.append({**row, "samples": [asdict(s) for s in mine]})
                    print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                          flush=True)
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(60)
    if args.out:
        Path(args.out).write_text(json.dumps({"environment": environment(), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
