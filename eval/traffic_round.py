"""One round of heads learning from what they serve, measured: record traffic, train on it, reload, tau before/after.

    python -m selfspec_eval.traffic_round --heads checkpoints/smollm2-135m-instruct-eagle \\
        --config training/configs/smollm2-eagle-traffic.json --out runs/traffic-round

1. ``selfspec serve --heads HEADS --record OUT/traffic`` on a free loopback port.
2. The held-out questions (``--eval``: the first ``--n`` of each source, one client, greedy, ``"store": false`` so they
   are never recorded): the serving heads' tau, read from ``/metrics`` (``selfspec_heads_mean_accepted_tokens``).
3. The traffic: ``--traffic`` questions the held-out ones are not (HumanEval from question ``--n`` on, by default:
   code traffic for heads trained on chat), ``--clients`` at a time, greedy, recorded.
4. ``training/train_heads.py --config CONFIG --init-from HEADS --data OUT/traffic`` (a process of its own).
5. ``POST /v1/heads/reload`` with the new heads, and the held-out questions again: the new heads' tau.

Prints and writes ``OUT/report.json``: requests recorded, training steps and seconds, tau before and after, and
every answer to the held-out questions before and after (identical: the output never depends on the heads).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from selfspec.options import OneLineParser, positive_int, run_command
from selfspec.zoo import load_tokenizer

from .environment import environment
from .prompts import load_bench_prompts
from .serve_load import start_server

ROOT = Path(__file__).resolve().parent.parent


def post(url: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(f"{url}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=900) as r:
        return json.loads(r.read())


def ask(url: str, model: str, question: str, max_tokens: int, store: bool) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "temperature": 0, "store": store}
    return post(url, "/v1/chat/completions", body)["choices"][0]["message"]["content"]


def tau(url: str, heads: str) -> float:
    """The mean accepted length /metrics reports for the requests ``heads`` drafted."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        text = r.read().decode()
    found = re.search(rf'selfspec_heads_mean_accepted_tokens{{heads="{re.escape(heads)}"}} ([0-9.]+)', text)
    if not found:
        raise RuntimeError(f"/metrics names no tau for {heads}")
    return float(found.group(1))


def run(args: argparse.Namespace) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(args.model)
    held = [p.messages([])[-1]["content"] for p in load_bench_prompts(args.eval.split(","), args.n, tok, 300)]
    pool = load_bench_prompts([args.traffic], args.n + args.requests, tok, 300)
    traffic = [p.messages([])[-1]["content"] for p in pool[args.n:]] if args.traffic in args.eval.split(",") else \
        [p.messages([])[-1]["content"] for p in pool[:args.requests]]
    record = args.out / "traffic"
    extra = f"--heads {args.heads} --record {record} --max-batch {args.clients}"
    proc, url = start_server(args.model, extra, args.out / "server.log")
    result = {"model": args.model, "heads": args.heads, "config": str(args.config), "eval": args.eval, "n": args.n,
              "traffic": args.traffic, "environment": environment()}
    try:
        heads_a = str(Path(args.heads))
        before = [ask(url, args.model, q, args.max_tokens, store=False) for q in held]
        result["tau_before"] = tau(url, heads_a)
        print(f"traffic_round: tau on {len(held)} held-out questions, serving heads: {result['tau_before']:.3f}",
              flush=True)
        start = time.time()
        with ThreadPoolExecutor(args.clients) as pool_:
            list(pool_.map(lambda q: ask(url, args.model, q, args.max_tokens, store=True), traffic))
        result["traffic_s"] = round(time.time() - start, 1)
        result["recorded"] = sum(len(p.read_text().splitlines()) for p in record.glob("*.jsonl"))
        print(f"traffic_round: {result['recorded']} requests recorded in {result['traffic_s']} s", flush=True)
        trained = args.out / "round-1"
        cmd = [sys.executable, str(ROOT / "training" / "train_heads.py"), "--config", str(args.config),
               "--init-from", args.heads, "--data", str(record), "--output-dir", str(trained)]
        print(f"traffic_round: {' '.join(cmd)}", flush=True)
        start = time.time()
        with open(args.out / "train.out", "w") as log:
            subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT)
        result["train_s"] = round(time.time() - start, 1)
        heads_b = str(trained / "heads")
        post(url, "/v1/heads/reload", {"path": heads_b})
        after = [ask(url, args.model, q, args.max_tokens, store=False) for q in held]
        result["tau_after"] = tau(url, heads_b)
        result["identical"] = sum(a == b for a, b in zip(before, after))
        result["answers"] = {"before": before, "after": after}
    finally:
        proc.terminate()
        proc.wait(60)
    (args.out / "report.json").write_text(json.dumps(result, indent=1))
    print(f"traffic_round: tau {result['tau_before']:.3f} -> {result['tau_after']:.3f} on the held-out questions; "
          f"answers identical {result['identical']}/{len(held)}", flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m selfspec_eval.traffic_round``."""
    p = OneLineParser(prog="traffic_round", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--heads", required=True, help="the heads serving at first (the round starts from them)")
    p.add_argument("--config", type=Path, required=True, help="the training recipe of the round")
    p.add_argument("--eval", default="code,chat", help="held-out question sources (never recorded)")
    p.add_argument("--n", type=positive_int, default=12, help="held-out questions per source")
    p.add_argument("--traffic", default="code", help="the traffic's source (past the held-out questions where shared)")
    p.add_argument("--requests", type=positive_int, default=150, help="traffic requests")
    p.add_argument("--clients", type=positive_int, default=8)
    p.add_argument("--max-tokens", type=positive_int, default=128)
    p.add_argument("--out", type=Path, required=True)
    return run_command("traffic_round", run, p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
