"""A workload where traffic repeats: one instruction over many HumanEval functions, asked in order, measured per request.

    python -m selfspec_eval.templated --model smollm2-135m-instruct --task tests --n 20 \\
        --methods prompt-lookup,suffix,eagle+lookup,eagle+suffix --out runs/templated-smollm2

Templated traffic (the same task over every item: write its tests, type it, make it a class) shares a skeleton
between answers that no single request's context holds: what a drafter that remembers earlier answers (``suffix``)
is for. This writes the task's prompts (``OUT/prompts.jsonl``: the instruction over HumanEval's functions, prompt
and canonical solution, in task order), runs ``selfspec bench`` on them (greedy, every method on each request in
turn, each method keeping what it learned from the requests before: the same run's output identity check), then
prints tau (tokens per target pass) and tokens/s over the first and the last ``--window`` requests per method,
and the ratio of the last window's tau to the first method's (prompt lookup, by default the baseline).
Writes ``OUT/templated.json`` beside the bench's report (vLLM's methods: tau from vLLM's own acceptance counters).
Options after ``--`` go to the bench as they are.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from selfspec.data.jsonio import read_records
from selfspec.data.sources import humaneval_records
from selfspec.options import OneLineParser, positive_int, run_command

from . import bench

TASKS = {
    "tests": "Write pytest unit tests for this function. Reply with one Python code block only.",
    "hints": "Add type hints and a Google-style docstring to this function. Reply with the whole function in one "
             "Python code block only.",
    "class": "Rewrite this function as a method of a class named Solution. Reply with one Python code block only.",
}


def prompts(task: str, n: int) -> list[dict]:
    """The first ``n`` HumanEval functions (signature, docstring and canonical body) under ``task``'s instruction."""
    out = []
    for rec in humaneval_records()[:n]:
        code = (rec["prompt"] + rec["canonical_solution"]).strip("\n")
        out.append({"id": rec["task_id"].replace("/", "-"), "category": f"templated-{task}",
                    "prompt": f"```python\n{code}\n```\n\n{TASKS[task]}"})
    return out


def passes(row: dict) -> float:
    """Target passes of one request: counted by selfspec, or from vLLM's own acceptance counters (its tau)."""
    if row["target_forwards"] is not None:
        return row["target_forwards"]
    return len(row["tokens"]) / row["tau"] if row.get("tau") else 0.0


def pooled(part: list[dict]) -> dict:
    """tau (tokens over target passes) and tokens/s (tokens over seconds) of some requests together."""
    tokens = sum(len(r["tokens"]) for r in part)
    passes_ = sum(passes(r) for r in part)
    seconds = sum(r["seconds"] for r in part)
    return {"requests": len(part), "tau": tokens / passes_ if passes_ else None,
            "tokens_per_s": tokens / seconds if seconds else None}


def windows(rows: list[dict], methods: list[str], order: list[str], window: int) -> dict:
    """Per method: the first and the last ``window`` requests (in ``order``) pooled, and every consecutive window's
    tau (``series``: the curve as the server sees more answers)."""
    out = {}
    for m in methods:
        by_prompt = {r["prompt"]: r for r in rows if r["method"] == m}
        served = [by_prompt[p] for p in order if p in by_prompt]
        series = [pooled(served[i:i + window])["tau"] for i in range(0, len(served), window)]
        out[m] = {"first": pooled(served[:window]), "last": pooled(served[-window:]), "series": series}
    return out


def fmt(value: float | None) -> str:
    return f"{value:.2f}" if value is not None else "-"


def table(result: dict, baseline: str) -> str:
    """The per-window table as markdown, with each method's last-window tau over the baseline's."""
    base = result[baseline]["last"]["tau"]
    lines = ["| method | tau, first | tau, last | tok/s, first | tok/s, last | last tau / " + baseline + " |",
             "|---|---|---|---|---|---|"]
    for m, parts in result.items():
        f, last = parts["first"], parts["last"]
        ratio = f"{last['tau'] / base:.2f}x" if base and last["tau"] else "-"
        lines.append(f"| {m} | {fmt(f['tau'])} | {fmt(last['tau'])} | {fmt(f['tokens_per_s'])} | "
                     f"{fmt(last['tokens_per_s'])} | {ratio} |")
    lines.append("")
    for m, parts in result.items():
        if m != baseline:
            over = [a / b if a and b else None for a, b in zip(parts["series"], result[baseline]["series"])]
            lines.append(f"{m} tau / {baseline}'s, window by window: " + " ".join(f"{fmt(v)}x" for v in over))
    return "\n".join(lines)


def run(args: argparse.Namespace, rest: list[str]) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    asked = prompts(args.task, args.n)
    path = out / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in asked))
    methods = args.methods.split(",")
    status = 0 if args.report_only else bench.main(
        ["--model", args.model, "--methods", args.methods, "--prompts", str(path), "--n", str(args.n),
         "--max-prompt-tokens", "1000", "--out", str(out), "--no-plots", *rest])
    rows = read_records(out / "runs.jsonl")
    order = list(dict.fromkeys(r["prompt"] for r in rows))  # as served
    result = windows(rows, methods, order, args.window)
    text = table(result, methods[0])
    print(f"\n{args.task} over {len(order)} HumanEval functions, in order ({args.window} requests a window):\n{text}")
    (out / "templated.json").write_text(json.dumps({"task": args.task, "instruction": TASKS[args.task],
                                                    "requests": len(order), "window": args.window,
                                                    "methods": result}, indent=1) + "\n")
    return status


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = OneLineParser(prog="python -m selfspec_eval.templated", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--task", choices=sorted(TASKS), default="tests")
    p.add_argument("--n", type=positive_int, default=20, help="HumanEval functions, in order (default: %(default)s)")
    p.add_argument("--window", type=positive_int, default=10,
                   help="requests in the first and the last window (default: %(default)s)")
    p.add_argument("--methods", default="prompt-lookup,suffix,eagle+lookup,eagle+suffix",
                   help="bench methods, the baseline first (default: %(default)s)")
    p.add_argument("--out", default="runs/templated")
    p.add_argument("--report-only", action="store_true", help="the windows of the runs already in --out; run nothing")
    return run_command(p.prog, lambda a: run(a, rest), p.parse_args(own))


if __name__ == "__main__":
    sys.exit(main())
