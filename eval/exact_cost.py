"""What the exact target pass costs: tokens/s of plain, heads and heads + lookup with the exact pass and with the
static pass it replaces, side by side on the same questions, and whether each output equals plain's.

    python -m selfspec_eval.exact_cost --model smollm2-135m-instruct --n 6 --max-new-tokens 96
    python -m selfspec_eval.exact_cost --model qwen2.5-coder-1.5b-instruct --n 4 --max-new-tokens 64

Both passes share the model (its packed weights) and each keeps its own cache; for every question the methods
run in turn, each first on one pass and then on the other (the order alternating by question), so that both
see the same machine noise. Greedy, the model's default dtype, the adaptive controller on (each pass prices
its own trees). Prints a table and writes ``exact-cost.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from selfspec.checkpoint import find_heads, load_heads
from selfspec.data import apply_chat_template
from selfspec.drafters.lookup_first import LookupFirstDrafter
from selfspec.dtypes import dtype_name
from selfspec.engine import DecodeConfig, SpeculativeEngine
from selfspec.errors import SelfspecError
from selfspec.memory import model_dtype
from selfspec.options import (OneLineParser, add_heads_path_option, add_model_options, load_target, positive_int,
                              run_command)
from selfspec.target import make_target_pass

from .environment import environment
from .prompts import load_bench_prompts

PASSES = ("exact", "static")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_options(p)
    add_heads_path_option(p)
    p.add_argument("--prompts", default="chat,code", help="held-out sources: chat (ShareGPT), code (HumanEval)")
    p.add_argument("--n", type=positive_int, default=6, help="questions per source")
    p.add_argument("--max-new-tokens", type=positive_int, default=96)
    p.add_argument("--max-nodes", type=positive_int, default=16)
    p.add_argument("--out", default="runs/exact-cost",
                   help="folder for exact-cost.json (default under runs/, which is not committed)")


def exact_cost(args: argparse.Namespace) -> dict:
    """Run every (question, method, pass); returns the per-method summary and every row."""
    model, tokenizer = load_target(args)
    folders = find_heads(args.model, args.heads_path)
    eagle = next((f for f in folders if f.name.endswith("-eagle")), None)
    drafters = {"plain": None}
    if eagle is not None:
        heads = load_heads(model, str(eagle), tokenizer)[1]
        drafters.update({"eagle": heads, "eagle+lookup": LookupFirstDrafter(heads)})
    passes = {"exact": make_target_pass(model, "static", exact=True),
              "static": make_target_pass(model, "static", exact=False)}
    if not passes["exact"].exact:
        raise SelfspecError(f"this device's self-test refuses the exact pass: {passes['exact'].support.reason}")
    prompts = load_bench_prompts(args.prompts.split(","), args.n, tokenizer)
    cfg = DecodeConfig(max_new_tokens=args.max_new_tokens, max_nodes=args.max_nodes)
    warm = apply_chat_template(tokenizer, prompts[0].messages([])[: len(prompts[0].system) + 1])
    for target in passes.values():  # warm-up: every method on a question-sized prompt (kernels' first shapes)
        for drafter in drafters.values():
            SpeculativeEngine(model, drafter, backend=target).generate(warm, DecodeConfig(max_new_tokens=16))
    rows = []
    for q, prompt in enumerate(prompts):
        ids = apply_chat_template(tokenizer, prompt.messages([])[: len(prompt.system) + 1])
        order = PASSES if q % 2 == 0 else PASSES[::-1]
        plain = {}
        for method, drafter in drafters.items():
            for name in order:
                res = SpeculativeEngine(model, drafter, backend=passes[name]).generate(ids, cfg)
                if method == "plain":
                    plain[name] = res.tokens
                rows.append({"question": prompt.id, "category": prompt.category, "method": method, "pass": name,
                             "tokens": len(res.tokens), "seconds": res.stats.total_s, "tau": res.stats.mean_accepted,
                             "identical": res.tokens == plain[name], "exact": res.stats.exact})
                print(f"{prompt.id:<24} {method:<13} {name:<7} {res.stats.tokens_per_s:7.2f} tokens/s  "
                      f"tau {res.stats.mean_accepted:.2f}  identical to plain: {res.tokens == plain[name]}",
                      flush=True)
    summary = {}
    for method in drafters:
        per = {}
        for name in PASSES:
            mine = [r for r in rows if r["method"] == method and r["pass"] == name]
            per[name] = {"tokens_per_s": sum(r["tokens"] for r in mine) / sum(r["seconds"] for r in mine),
                         "tau": sum(r["tau"] for r in mine) / len(mine),
                         "identical": sum(r["identical"] for r in mine), "outputs": len(mine)}
        per["exact_vs_static"] = per["exact"]["tokens_per_s"] / per["static"]["tokens_per_s"]
        summary[method] = per
    return {"model": args.model, "dtype": dtype_name(model_dtype(model)), "questions": len(prompts),
            "max_new_tokens": args.max_new_tokens, "summary": summary, "rows": rows}


def table(report: dict) -> str:
    lines = [f"{report['model']}, {report['dtype']}, {report['questions']} held-out questions, "
             f"{report['max_new_tokens']} new tokens, greedy",
             f"{'method':<14} {'exact tok/s':>11} {'static tok/s':>12} {'exact/static':>12} "
             f"{'identical to plain (exact | static)':>36}"]
    for method, s in report["summary"].items():
        e, st = s["exact"], s["static"]
        lines.append(f"{method:<14} {e['tokens_per_s']:>11.2f} {st['tokens_per_s']:>12.2f} "
                     f"{s['exact_vs_static']:>11.3f}x {e['identical']:>15}/{e['outputs']} | "
                     f"{st['identical']}/{st['outputs']}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    report = {**exact_cost(args), "environment": environment()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "exact-cost.json").write_text(json.dumps(report, indent=1))
    print(table(report))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = OneLineParser(prog="python -m selfspec_eval.exact_cost", description=__doc__.split("\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    return run_command(p.prog, run, args)


if __name__ == "__main__":
    sys.exit(main())
