"""Engine benchmark: transformers vs selfspec, side by side, interleaved on the same prompts.

Methods (one process, one model load, each prompt runs every method before the next prompt):
  hf           transformers `generate`, greedy
  hf-assisted  transformers assisted generation with a separate assistant model
  plain        selfspec, no drafter (the honest baseline through the same loop)
  draft-model  selfspec with the same separate draft model
  prompt-lookup selfspec, n-gram drafts from the context

Results go to a jsonl (one line per prompt x method) so a killed run resumes where it stopped;
the summary (tokens/s per method, tau, ratios, identical-output check) is printed and written as
Markdown and JSON next to it.

    python eval/bench_engine.py --target qwen2.5-coder-1.5b-instruct \
        --draft qwen2.5-coder-0.5b-instruct --out eval/results/engine-qwen1.5b
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from selfspec.data import apply_chat_template, load_prompts
from selfspec.drafters.draft_model import DraftModelDrafter
from selfspec.drafters.prompt_lookup import PromptLookupDrafter
from selfspec.engine import DecodeConfig, SpeculativeEngine
from selfspec.zoo import load_model
from selfspec_eval.methods import run_hf

METHODS = ("hf", "hf-assisted", "plain", "draft-model", "prompt-lookup")


def pick_prompts(tokenizer, n_code: int, n_chat: int, max_prompt_tokens: int) -> list[dict]:
    """HumanEval (all 164, first n) and ShareGPT held-out prompts no longer than ``max_prompt_tokens``."""
    out = []
    for source, split, n in (("humaneval", "all", n_code), ("sharegpt", "heldout", n_chat)):
        if n <= 0:
            continue
        for ex in load_prompts(source, 200 if source == "sharegpt" else n, split=split):
            ids = apply_chat_template(tokenizer, ex["messages"])
            if len(ids) <= max_prompt_tokens:
                out.append({"id": ex["id"], "category": ex["category"], "ids": ids})
            if sum(p["category"] == ex["category"] for p in out) == n:
                break
    code = [p for p in out if p["category"] == "code"]
    chat = [p for p in out if p["category"] != "code"]
    mixed = [p for pair in zip(code, chat) for p in pair]  # alternate, so a partial run covers both
    return mixed + code[len(mixed) // 2:] + chat[len(mixed) // 2:]


def run_method(method: str, target, draft, ids: list[int], max_new: int, depth: int = 16, nodes: int = 16) -> dict:
    """One prompt through one method: tokens, seconds, tau, target passes."""
    if method in ("hf", "hf-assisted"):
        run = run_hf(target, ids, max_new, draft if method == "hf-assisted" else None)
        return {"tokens": run.tokens, "seconds": run.seconds, "tau": None, "target_forwards": None}
    drafter = {"plain": None, "draft-model": DraftModelDrafter(draft) if draft is not None else None,
               "prompt-lookup": PromptLookupDrafter()}[method]
    res = SpeculativeEngine(target, drafter).generate(ids, DecodeConfig(max_new_tokens=max_new, max_depth=depth,
                                                                        max_nodes=nodes))
    s = res.stats
    return {"tokens": res.tokens, "seconds": s.total_s, "tau": s.mean_accepted, "target_forwards": s.target_forwards,
            "acceptance_by_depth": s.acceptance_by_depth, "draft_s": s.draft_s, "verify_s": s.verify_s}


def summarize(rows: list[dict], methods: list[str]) -> dict:
    """Per method: mean tokens/s (per prompt, then averaged), mean tau, identical-to-hf count, ratios."""
    by = {(r["prompt"], r["method"]): r for r in rows}
    prompts = sorted({r["prompt"] for r in rows if all((r["prompt"], m) in by for m in methods)})
    out = {"prompts": len(prompts), "methods": {}}
    for m in methods:
        rs = [by[(p, m)] for p in prompts]
        tps = [len(r["tokens"]) / r["seconds"] for r in rs]
        taus = [r["tau"] for r in rs if r["tau"] is not None]
        same = sum(r["tokens"] == by[(r["prompt"], "hf")]["tokens"] for r in rs) if "hf" in methods else None
        out["methods"][m] = {"tokens_per_s": statistics.mean(tps), "tau": statistics.mean(taus) if taus else None,
                             "identical_to_hf": same}
    base = out["methods"].get("hf", {}).get("tokens_per_s")
    for m, v in out["methods"].items():
        v["speedup_vs_hf"] = v["tokens_per_s"] / base if base else None
    return out


def markdown(summary: dict, args: argparse.Namespace) -> str:
    """The summary as a Markdown table."""
    lines = [f"# Engine benchmark: {args.target}" + (f" (draft {args.draft})" if args.draft else ""),
             "", f"{summary['prompts']} prompts, {args.max_new_tokens} new tokens, greedy, {args.dtype}, CPU, "
             "methods interleaved per prompt.", "",
             "| method | tokens/s | vs hf | tau | output identical to hf |", "|---|---|---|---|---|"]
    for m, v in summary["methods"].items():
        tau = f"{v['tau']:.2f}" if v["tau"] is not None else "-"
        lines.append(f"| {m} | {v['tokens_per_s']:.2f} | {v['speedup_vs_hf']:.2f}x | {tau} | "
                     f"{v['identical_to_hf']}/{summary['prompts']} |")
    ratios = summary.get("ratios", {})
    if ratios:
        lines += ["", *[f"- {k}: {v:.3f}" for k, v in ratios.items()]]
    return "\n".join(lines) + "\n"


def main() -> None:
    """Run (or resume) the benchmark and write the report."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--n-code", type=int, default=10)
    p.add_argument("--n-chat", type=int, default=10)
    p.add_argument("--max-prompt-tokens", type=int, default=400)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-depth", type=int, default=16, help="selfspec: deepest draft (adaptive picks up to it)")
    p.add_argument("--max-nodes", type=int, default=16, help="selfspec: largest draft tree, root included")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    p.add_argument("--out", default="eval/results/engine")
    p.add_argument("--report-only", action="store_true", help="summarise the runs already in --out; run nothing")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    methods = args.methods.split(",")
    out = Path(args.out)
    if not args.report_only:
        run_all(args, methods, out)
    report(args, methods, out)


def run_all(args: argparse.Namespace, methods: list[str], out: Path) -> None:
    """Run every prompt x method not yet in ``out/runs.jsonl``, appending as it goes."""
    dtype = getattr(torch, args.dtype)
    target, tok = load_model(args.target, dtype=dtype)
    draft = load_model(args.draft, dtype=dtype)[0] if args.draft else None
    prompts = pick_prompts(tok, args.n_code, args.n_chat, args.max_prompt_tokens)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "runs.jsonl"
    done = {(r["prompt"], r["method"]) for r in map(json.loads, log.read_text().splitlines())} if log.exists() else set()
    run_method("plain", target, draft, prompts[0]["ids"][:16], 4)  # warm-up
    for i, pr in enumerate(prompts):
        for m in methods:
            if (pr["id"], m) in done:
                continue
            r = run_method(m, target, draft, pr["ids"], args.max_new_tokens, args.max_depth, args.max_nodes)
            r.update(prompt=pr["id"], category=pr["category"], method=m, prompt_tokens=len(pr["ids"]))
            with log.open("a") as f:
                f.write(json.dumps(r) + "\n")
            tau = f" tau {r['tau']:.2f}" if r["tau"] is not None else ""
            print(f"[{i + 1}/{len(prompts)}] {pr['id']:<14} {m:<14} {len(r['tokens']) / r['seconds']:6.2f} tok/s{tau}",
                  flush=True)


def report(args: argparse.Namespace, methods: list[str], out: Path) -> None:
    """Summary JSON and Markdown from ``out/runs.jsonl`` (prompts that every method finished)."""
    rows = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    summary = summarize(rows, methods)
    for cat in ("code", "chat"):
        summary[cat] = summarize([r for r in rows if r["category"] == cat], methods)
    v = summary["methods"]
    ratios = {}
    if "plain" in v and "hf" in v:
        ratios["selfspec plain / hf"] = v["plain"]["tokens_per_s"] / v["hf"]["tokens_per_s"]
    if "draft-model" in v and "hf-assisted" in v:
        ratios["selfspec draft-model / hf-assisted"] = v["draft-model"]["tokens_per_s"] / v["hf-assisted"]["tokens_per_s"]
    summary["ratios"] = ratios
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    text = markdown(summary, args)
    for cat in ("code", "chat"):
        text += "\n## " + cat + "\n\n" + "\n".join(markdown(summary[cat], args).splitlines()[4:]) + "\n"
    (out / "report.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
