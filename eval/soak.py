"""A soak of ``selfspec serve``: many clients for a long time, and whether the server's memory stays flat.

    python -m selfspec_eval.soak --model smollm2-135m-instruct \\
        --server "--heads checkpoints/smollm2-135m-instruct-eagle" --clients 8 --minutes 60 --out runs/soak.json

Starts the server on a free loopback port (or uses ``--url``, loopback only, with ``--pid`` to read its memory),
then ``--clients`` clients send requests back to back until ``--minutes`` have passed (or ``--max-requests``):
every prompt new (a held-out ShareGPT or HumanEval first turn with a random suffix, so no two requests share
more than the question), 16 / 48 / 96 new tokens, greedy or sampled (temperature 0.8), streamed or not, chosen per
request from a seeded generator. Every minute it prints the requests answered by status, tokens/s, the server's
resident memory (``/proc/PID/status`` VmRSS) and its memory by part from ``/metrics`` (``selfspec_memory_bytes``:
the KV rows, the prefix cache as accounted and as held, the drafter's caches, the C heap in use and free); at the
end, a verdict on memory over the second half of the run (growth under ``--max-growth``, 1% by default, is flat)
and, with ``--out``, every minute as JSON. Add
``--server "--prefix-cache 0"`` to soak without the prefix cache (so it cannot hide a leak elsewhere).
``python -m selfspec_eval.soak summary NAME=FILE ...`` prints finished runs side by side as a markdown table.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from urllib.parse import urlparse

from selfspec.options import OneLineParser, positive_int, run_command
from selfspec.zoo import load_tokenizer

from .environment import environment
from .prompts import load_bench_prompts
from .serve_load import LOOPBACK, start_server, wait_ready

LENGTHS = (16, 48, 96)


def rss_mib(pid: int) -> float | None:
    """The process's resident memory in MiB (None when it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def request_once(url: str, model: str, prompt: str, rng: random.Random) -> tuple[int, int]:
    """One request with settings drawn from ``rng``: (HTTP status, completion tokens)."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": rng.choice(LENGTHS),
            "temperature": rng.choice((0.0, 0.8)), "seed": rng.randrange(1 << 30), "stream": rng.random() < 0.5}
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            if not body["stream"]:
                return r.status, json.loads(r.read())["usage"]["completion_tokens"]
            tokens = 0
            for raw in r:
                line = raw.decode().strip()
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        return 500, tokens
                    tokens += sum(1 for c in chunk["choices"] if c["delta"].get("content"))
            return r.status, tokens
    except urllib.error.HTTPError as err:
        return err.code, 0
    except OSError:
        return 0, 0  # no answer at all (connection refused or reset, timeout)


class Tally:
    """Requests by status and tokens, shared by the client threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.status: Counter[int] = Counter()
        self.tokens = 0

    def add(self, status: int, tokens: int) -> None:
        with self.lock:
            self.status[status] += 1
            self.tokens += tokens

    def snapshot(self) -> tuple[dict[int, int], int]:
        with self.lock:
            return dict(self.status), self.tokens


def client(url: str, model: str, questions: list[str], seed: int, tally: Tally, stop: threading.Event,
           budget: list[int]) -> None:
    rng = random.Random(seed)
    while not stop.is_set():
        with tally.lock:
            if budget[0] <= 0:
                return
            budget[0] -= 1
        prompt = f"{rng.choice(questions)}\n\n(ref {rng.randrange(1 << 40):x})"  # every prompt new
        tally.add(*request_once(url, model, prompt, rng))


def memory_parts(url: str) -> dict[str, float]:
    """The server's memory by part as its ``/metrics`` reports it (``selfspec_memory_bytes``), MiB (counts as is),
    and the seconds it spent trimming its heap."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        if line.startswith('selfspec_memory_bytes{part="'):
            part, value = line[len('selfspec_memory_bytes{part="'):].split('"} ')
            out[part] = float(value) if part.endswith("_entries") else round(float(value) / 2**20, 2)
        elif line.startswith("selfspec_heap_trim_seconds_total "):
            out["heap_trim_s"] = round(float(line.split()[1]), 3)
    return out


def verdict(minutes: list[dict], max_growth: float) -> dict:
    """Memory over the second half of the run: growth from its first report to its last, and whether it is flat;
    beside it the least-squares slope through every report of that half (MiB a minute), which two noisy end points
    can hide."""
    rss = [m["rss_mib"] for m in minutes if m["rss_mib"] is not None]
    if len(rss) < 4:
        return {"flat": None, "why": "fewer than 4 reports of memory"}
    half = rss[len(rss) // 2:]
    growth = (half[-1] - half[0]) / half[0]
    return {"flat": growth < max_growth, "growth": round(growth, 4), "from_mib": round(half[0], 1),
            "to_mib": round(half[-1], 1), "max_growth": max_growth, "slope_mib_per_min": round(slope(half), 3)}


def slope(values: list[float]) -> float:
    """The least-squares slope through ``values``, one a minute."""
    n = len(values)
    mx, my = (n - 1) / 2, sum(values) / n
    return sum((i - mx) * (v - my) for i, v in enumerate(values)) / sum((i - mx) ** 2 for i in range(n))


def second_half(minutes: list[dict], part: str) -> dict | None:
    """A part of the server's memory (MiB) from the first to the last report of the run's second half: whether a
    growth is memory in use (a leak) or memory freed and kept (fragmentation)."""
    values = [m["parts"][part] for m in minutes[len(minutes) // 2:] if part in m.get("parts", {})]
    return {"from_mib": values[0], "to_mib": values[-1]} if values else None


def questions(model: str) -> list[str]:
    """Held-out ShareGPT and HumanEval first turns (64 of each at most, prompts of at most 300 tokens)."""
    tok = load_tokenizer(model)
    return [p.messages([])[-1]["content"] for p in load_bench_prompts(["chat", "code"], 64, tok, 300)]


def run(args: argparse.Namespace) -> int:
    if args.url and urlparse(args.url).hostname not in LOOPBACK:
        raise SystemExit("soak: error: --url must be a loopback address (127.0.0.1 / localhost)")
    asked = questions(args.model)
    proc = None
    if args.url:
        url, pid = args.url.rstrip("/"), args.pid
        wait_ready(url, None, 30)
    else:
        log = Path(args.out or "soak").with_suffix(".server.log")
        proc, url = start_server(args.model, args.server, log)
        pid = proc.pid
    tally, stop, budget = Tally(), threading.Event(), [args.max_requests]
    threads = [threading.Thread(target=client, args=(url, args.model, asked, args.seed + i, tally, stop, budget),
                                daemon=True) for i in range(args.clients)]
    minutes, start = [], time.monotonic()
    try:
        for t in threads:
            t.start()
        last_tokens, ticks = 0, max(1, round(args.minutes * 60 / args.interval))
        for tick in range(1, ticks + 1):
            end = start + args.interval * tick
            while time.monotonic() < end and any(t.is_alive() for t in threads):
                time.sleep(min(1.0, max(0.0, end - time.monotonic())))
            status, tokens = tally.snapshot()
            row = {"minute": round(tick * args.interval / 60, 2), "requests": status,
                   "tokens_per_s": round((tokens - last_tokens) / args.interval, 1),
                   "rss_mib": None if pid is None else rss_mib(pid), "parts": memory_parts(url)}
            last_tokens = tokens
            minutes.append(row)
            print(json.dumps(row), flush=True)
            if not any(t.is_alive() for t in threads):
                break
    finally:
        stop.set()
        for t in threads:
            t.join(660)
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    status, tokens = tally.snapshot()
    result = {"model": args.model, "server": args.server, "clients": args.clients, "minutes": minutes,
              "requests": status, "all_ok": set(status) <= {200}, "memory": verdict(minutes, args.max_growth),
              "environment": environment()}
    result["heap"] = {part: second_half(minutes, part) for part in ("malloc_in_use", "malloc_free")}
    print(json.dumps({k: result[k] for k in ("requests", "all_ok", "memory", "heap")}), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0 if result["all_ok"] else 1


def summary(runs: dict[str, dict], at: Iterable[float] = (1, 5, 15, 30, 45, 60)) -> str:
    """Soak results (``--out`` files) by name -> a markdown table: requests, the verdict over the second half, and
    resident memory and the C heap (in use / free) at a few minutes, MiB."""
    at = tuple(at)
    lines = ["| run | requests | tokens/s | second-half RSS growth | fitted MiB/min | "
             + " | ".join(f"min {m:g}" for m in at) + " |", "|---|---|---|---|---|" + "---|" * len(at)]
    for name, result in runs.items():
        minutes = {m["minute"]: m for m in result["minutes"]}
        cells = []
        for m in at:
            row = minutes.get(float(m))
            heap = (row or {}).get("parts", {})
            cells.append("-" if row is None else f"{row['rss_mib']:.0f} ({heap.get('malloc_in_use', 0):.0f} / "
                         f"{heap.get('malloc_free', 0):.0f})")
        rate = sum(m["tokens_per_s"] for m in result["minutes"]) / len(result["minutes"])
        mem = result["memory"]
        growth = f"{100 * mem['growth']:+.2f}% ({mem['from_mib']:.0f} -> {mem['to_mib']:.0f})" if mem["flat"] \
            is not None else "-"
        fit = verdict(result["minutes"], mem.get("max_growth", 0.01)).get("slope_mib_per_min")  # files before it
        fitted = "-" if fit is None else f"{fit:+.2f}"
        requests = ", ".join(f"{n:,} x {code}" for code, n in sorted(result["requests"].items()))
        lines.append(f"| {name} | {requests} | {rate:.1f} | {growth} | {fitted} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m selfspec_eval.soak``."""
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "summary":  # soak summary NAME=FILE ...: the table of finished runs
        print(summary({name: json.loads(Path(path).read_text()) for name, path in (a.split("=", 1) for a in argv[1:])}))
        return 0
    p = OneLineParser(prog="soak", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--server", default="", help="extra `selfspec serve` arguments (one string)")
    p.add_argument("--url", help="a running server on this machine instead of starting one (loopback only)")
    p.add_argument("--pid", type=int, help="with --url: the server's process id, to read its memory")
    p.add_argument("--clients", type=positive_int, default=8)
    p.add_argument("--minutes", type=float, default=60.0)
    p.add_argument("--max-requests", type=positive_int, default=1_000_000, help="stop sending after this many")
    p.add_argument("--max-growth", type=float, default=0.01, help="memory growth over the second half called flat")
    p.add_argument("--interval", type=float, default=60.0, help="seconds between two reports (default a minute)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="every minute and the verdict, as JSON")
    return run_command("soak", run, p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
