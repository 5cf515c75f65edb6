"""selfspec bench: plain, separate-draft and self-speculative decoding side by side, on the same questions.

Every method runs in this one process, interleaved per question (each question goes through every
method before the next), after a warm-up, greedy; a noisy machine slows all methods alike, so read
the ratios. Each run appends a line to ``OUT/runs.jsonl``: a killed benchmark resumes where it
stopped, and ``--report-only`` rebuilds the report from it. Outputs: ``report.json``, ``report.md``,
``speedup_by_category.png``, ``speedup_vs_memory.png``, ``acceptance_by_depth.png``.

    selfspec bench --model smollm2-135m-instruct --n 4 --max-new-tokens 64 --out runs/smollm2
    selfspec bench --model qwen2.5-coder-1.5b-instruct --draft-model qwen2.5-coder-0.5b-instruct \\
        --memory-budget 4GiB,6GiB,8GiB --out runs/qwen2.5-coder-1.5b
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from selfspec.data import apply_chat_template, load_prompts, read_records
from selfspec.context import context_length
from selfspec.engine import sync_device
from selfspec.dtypes import dtype_name
from selfspec.errors import SelfspecError
from selfspec.memory import counted_bytes, model_dtype, parse_bytes, predict_target, storages
from selfspec.options import (OneLineParser, add_decoding_options, add_drafter_options, add_heads_path_option,
                              add_model_options, load_target, non_negative_int, positive_int, run_command)
from selfspec.target.packed_linear import is_packed, linear_modules
from selfspec.target import CompiledPass, make_target_pass
from selfspec.zoo import load_model, resolve

from . import report as report_mod
from .budgets import budget_table, measured_added, predicted_added
from .divergences import check_outputs, failure_message, real_divergences, verdicts
from .methods import BASE_METHODS, VLLM_METHODS, Method, build_methods, heads_folders, is_vllm
from .metrics import summarize
from .prompts import load_bench_prompts
from .environment import environment
from .vllm_client import WorkerConfig, has_arctic_inference, missing_environment

HELP = "benchmark plain, separate-draft and self-speculative decoding"


def memory_budgets(text: str) -> str:
    """Comma-separated memory sizes (4GiB,8GiB), each checked as the line is parsed."""
    try:
        [parse_bytes(b) for b in text.split(",") if b.strip()]
    except SelfspecError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Every option of ``selfspec bench``: the shared model, decoding and drafting ones, then the benchmark's."""
    add_model_options(p)
    add_decoding_options(p)
    add_drafter_options(p, several_heads=True)
    add_heads_path_option(p)
    p.add_argument("--methods", help="comma-separated, in order (default: every available one of "
                   f"{', '.join(BASE_METHODS)}, eagle, medusa, early-exit, {', '.join(VLLM_METHODS)} (after "
                   "`make vllm-env`)); a head method with "
                   "'+lookup' (e.g. eagle+lookup) drafts by prompt lookup first where the context repeats itself; "
                   "'vllm+' and an eagle3 (or EAGLE-1-layout eagle) head method (e.g. vllm+eagle3) runs vLLM with "
                   "those heads exported")
    p.add_argument("--vllm-spec-tokens", type=positive_int, default=3,
                   help="chain length vLLM drafts with exported heads (vllm+<heads>; vLLM drafts no trees)")
    p.add_argument("--prompts", default="code,chat",
                   help="comma-separated sources: chat (ShareGPT held-out), code (HumanEval), or jsonl/json files "
                        "with 'prompt' records or MT-bench questions (question_id, category, turns)")
    p.add_argument("--n", type=positive_int, default=10, help="questions per source")
    p.add_argument("--max-prompt-tokens", type=positive_int, default=400,
                   help="skip questions whose first turn is longer")
    p.add_argument("--draft-vocab", type=non_negative_int, default=0,
                   help="selfspec draft-model: draft over this many frequent token ids only (0: the whole vocabulary)")
    p.add_argument("--memory-budget", default="", type=memory_budgets,
                   help="comma-separated budgets (e.g. 4GiB,8GiB): what fits each, and the longest context")
    p.add_argument("--context", type=positive_int, default=2048,
                   help="context (prompt + output tokens) a budget must hold")
    p.add_argument("--budget-speed", action="store_true",
                   help="also measure each method at the longest context that fits each budget (capped by "
                        "--budget-max-context); on CUDA the budget is enforced and an out-of-memory is recorded")
    p.add_argument("--budget-max-context", type=positive_int, default=4096)
    p.add_argument("--out", default="runs/bench", help="folder for runs.jsonl and the report "
                   "(a --fixed-tree run: its own)")
    p.add_argument("--report-only", action="store_true", help="report the runs already in --out; run nothing")
    p.add_argument("--no-plots", action="store_true", help="skip the PNGs (no matplotlib needed)")


def run_one(method: Method, target, ids: list[int], args: argparse.Namespace) -> dict:
    """One turn through one method, as a JSON-ready row (CUDA peak memory when on a GPU)."""
    cuda = target.device.type == "cuda"
    if cuda:
        sync_device(target.device)
        torch.cuda.reset_peak_memory_stats(target.device)
    run = method.run(target, ids, args.max_new_tokens, args.max_depth, args.max_nodes, adaptive=not args.fixed_tree)
    if cuda:
        run.cuda_peak_bytes = torch.cuda.max_memory_allocated(target.device)
    return {**vars(run), "prompt_tokens": len(ids), "prompt_ids": list(ids)}  # ids: the divergence check


def precompile(methods: list[Method], tokenizer, prompts, args: argparse.Namespace) -> None:
    """On a compiled target pass, build every graph the questions' first turns will use before timing any:
    per set of states the methods' drafters read, every tree-size bucket they may draft (plain: the root)."""
    selfspec = [m for m in methods if m.kind == "selfspec"]
    shared = selfspec[0].target_pass if selfspec else None
    if not isinstance(shared, CompiledPass):
        return
    longest = max(len(apply_chat_template(tokenizer, q.messages([]))) for q in prompts) + args.max_new_tokens
    nodes: dict[tuple, int] = {}
    for m in selfspec:
        layers = m.drafter.state_layers if m.drafter is not None and m.drafter.needs_hidden_states else ()
        nodes[layers] = max(nodes.get(layers, 1), 1 if m.drafter is None else args.max_nodes)
    seconds = sum(shared.precompile(longest, n, layers) for layers, n in nodes.items())
    print(f"compiled the target pass's graphs in {seconds:.0f} s", flush=True)


def run_questions(methods: list[Method], target, tokenizer, prompts, args: argparse.Namespace, log: Path) -> None:
    """Every question x method not yet in ``log``; later turns follow each method's own earlier answers."""
    from tqdm.auto import tqdm

    done = {}
    if log.exists():
        for r in read_records(log):
            done[(r["prompt"], r["method"])] = r
    for m in methods:  # warm-up: kernels, allocator, lazy inits
        m.run(target, apply_chat_template(tokenizer, prompts[0].messages([]))[:16], 4, args.max_depth, args.max_nodes)
    precompile(methods, tokenizer, prompts, args)
    total = sum(len(p.turns) for p in prompts) * len(methods)
    bar = tqdm(total=total, desc="bench", unit="run")
    answers = {m.name: {} for m in methods}
    for q in prompts:
        for m in methods:
            answers[m.name][q.id] = []
        for k in range(len(q.turns)):
            pid = q.id if k == 0 else f"{q.id}#{k + 1}"
            for m in methods:
                row = done.get((pid, m.name))
                if row is None:
                    ids = apply_chat_template(tokenizer, q.messages(answers[m.name][q.id]))
                    row = {"prompt": pid, "category": q.category, "method": m.name, **run_one(m, target, ids, args)}
                    with log.open("a") as f:
                        f.write(json.dumps(row) + "\n")
                    tau = f" tau {row['tau']:.2f}" if row["tau"] is not None else ""
                    bar.write(f"{pid:<16} {m.name:<14} {len(row['tokens']) / row['seconds']:7.2f} tok/s{tau}")
                answers[m.name][q.id].append(tokenizer.decode(row["tokens"], skip_special_tokens=True))
                bar.update(1)
    bar.close()


def long_prompt(tokenizer, length: int) -> list[int]:
    """A real-text prompt of about ``length`` tokens: held-out ShareGPT turns, then a request to summarise."""
    texts, n = [], 0
    for ex in load_prompts("sharegpt", 400, split="heldout"):
        texts.append(ex["turns"][0])
        n += len(tokenizer(texts[-1])["input_ids"])
        if n > length:
            break
    doc = tokenizer(" ".join(texts))["input_ids"]
    question = "\n\nSummarise the text above in three sentences."
    overhead = len(apply_chat_template(tokenizer, [{"role": "user", "content": question}]))
    body = tokenizer.decode(doc[:max(length - overhead, 1)])
    return apply_chat_template(tokenizer, [{"role": "user", "content": body + question}])[:length]


def speed_at(method: Method, target, ids: list[int], args: argparse.Namespace, fraction: float | None) -> dict:
    """tokens/s of ``method`` on ``ids``; on CUDA under a memory fraction, an out-of-memory is a result."""
    if fraction is not None:
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(min(fraction, 1.0), target.device)
    try:
        run = method.run(target, ids, min(args.max_new_tokens, 64), args.max_depth, args.max_nodes,
                         adaptive=not args.fixed_tree)
        return {"context": len(ids), "tokens_per_s": len(run.tokens) / run.seconds}
    except torch.cuda.OutOfMemoryError:
        return {"context": len(ids), "error": "out of memory"}
    finally:
        if fraction is not None:
            torch.cuda.set_per_process_memory_fraction(1.0, target.device)
            torch.cuda.empty_cache()


def method_tensors(m: Method):
    """What a method keeps resident beside the target (its drafter or transformers' assistant)."""
    return m.drafter if m.drafter is not None else m.assistant


def budget_speeds(rows: list[dict], methods: list[Method], target, tokenizer, args: argparse.Namespace) -> None:
    """Measure each fitting budget x method at its longest context (capped); CUDA enforces the budget.

    Every method is loaded at once, so the fraction on CUDA allows for the *other* methods' resident
    tensors, which a deployment of this method alone would not hold.
    """
    by_name = {m.name: m for m in methods}
    cuda = target.device.type == "cuda"
    total_mem = torch.cuda.get_device_properties(target.device).total_memory if cuda else None
    target_st = storages(target)
    for row in rows:
        if row["max_context"] <= args.max_new_tokens:
            continue
        m = by_name[row["method"]]
        length = min(row["max_context"], args.budget_max_context) - min(args.max_new_tokens, 64)
        fraction = None
        if cuda:
            own = storages(method_tensors(m)) if method_tensors(m) is not None else {}
            others = sum(counted_bytes(method_tensors(o), exclude={**target_st, **own})
                         for o in methods if o is not m and method_tensors(o) is not None)
            fraction = (row["budget"] + others) / total_mem
        row["speed"] = speed_at(m, target, long_prompt(tokenizer, length), args, fraction)
        print(f"budget {row['budget'] / 2**30:.2f} GiB {m.name:<14} context {row['speed']['context']}: "
              f"{row['speed'].get('tokens_per_s', row['speed'].get('error'))}", flush=True)


def without_missing_vllm(names: list[str]) -> list[str]:
    """``names`` less vLLM's methods when its environment is missing (and vllm-suffix where Arctic Inference is),
    said in one line."""
    asked = [n for n in names if is_vllm(n)]
    reason = missing_environment() if asked else None
    if reason is not None:
        print(f"skipping {', '.join(asked)}: {reason}", flush=True)
        return [n for n in names if not is_vllm(n)]
    if "vllm-suffix" in names and not has_arctic_inference():
        print("skipping vllm-suffix: vLLM's suffix decoding needs Arctic Inference: run `make vllm-suffix`", flush=True)
        return [n for n in names if n != "vllm-suffix"]
    return names


RESUMED_SETTINGS = ("model", "max_new_tokens", "max_depth", "max_nodes", "fixed_tree", "vllm_spec_tokens")


def folder_stamp(folder: str) -> list[list]:
    """Each file of a heads folder with its size and modification time: retrained or replaced heads differ."""
    return sorted([p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in Path(folder).iterdir() if p.is_file())


def recorded_environment(out: Path) -> dict | None:
    """The environment the runs in ``out`` were measured in (their last report's), for ``--report-only``."""
    try:
        return json.loads((out / "report.json").read_text()).get("environment")
    except (OSError, ValueError):
        return None


def resume_guard(out: Path, args: argparse.Namespace, dtype: str, heads: dict[str, str]) -> None:
    """Record what the runs in ``out`` were measured with; refuse to add runs to ones measured otherwise (a method
    named like an earlier one, with other heads or settings, would otherwise be reported from the old runs)."""
    setup = {**{k: getattr(args, k) for k in RESUMED_SETTINGS}, "dtype": dtype,
             "heads": {name: folder_stamp(folder) for name, folder in heads.items()}}
    path = out / "setup.json"
    if (out / "runs.jsonl").exists() and path.exists():
        old = json.loads(path.read_text())
        changed = [k for k in setup if k != "heads" and old.get(k) != setup[k]]
        changed += [f"heads {name}" for name, stamp in setup["heads"].items()
                    if name in old.get("heads", {}) and old["heads"][name] != stamp]
        if changed:
            raise SelfspecError(f"{out} holds runs measured with other {', '.join(changed)}: pass another --out, "
                                "or remove it to measure again")
        setup["heads"] = {**old.get("heads", {}), **setup["heads"]}
    path.write_text(json.dumps(setup, indent=2) + "\n")


def bench(args: argparse.Namespace) -> dict:
    """Load, run (or resume), and build the report dict; writes the report files."""
    out = Path(args.out)
    budgets = [parse_bytes(b) for b in args.memory_budget.split(",") if b.strip()]
    target, tok = load_target(args)
    dtype = model_dtype(target)  # what --dtype auto chose
    print(f"target {args.model}: {dtype_name(dtype)} (--dtype {args.dtype}) on {target.device}", flush=True)
    draft = load_model(args.draft_model, dtype=dtype, device=args.device)[0] if args.draft_model else None
    heads = heads_folders(args.model, args.heads, args.heads_path)
    names = args.methods.split(",") if args.methods else [
        m for m in BASE_METHODS if draft is not None or m not in ("hf-assisted", "draft-model")] + list(heads)
    names = without_missing_vllm(names + ([] if args.methods else list(VLLM_METHODS)))
    vllm = WorkerConfig(resolve(args.model), dtype_name(dtype), torch.get_num_threads(), log_dir=str(out))
    methods = build_methods(names, target, tok, draft, heads, args.draft_vocab, lookup=not args.no_lookup, vllm=vllm,
                            vllm_spec_tokens=args.vllm_spec_tokens)
    dense = linear_modules(target)  # transformers' methods keep running on the dense weights the pass packs
    shared = make_target_pass(target, args.target_pass, args.exact)
    for m in methods:
        m.target_pass = shared
        m.dense = dense if m.kind == "hf" and is_packed(target) else None
    out.mkdir(parents=True, exist_ok=True)  # the first thing written: after every input was checked
    log = out / "runs.jsonl"
    if not args.report_only:
        resume_guard(out, args, dtype_name(dtype), heads)
        prompts = load_bench_prompts(args.prompts.split(","), args.n, tok, args.max_prompt_tokens)
        run_questions(methods, target, tok, prompts, args, log)
    for m in methods:  # vLLM workers hold a model copy each: free them before the float32 copy below
        m.close()
    if not log.exists():
        raise SelfspecError(f"no runs in {out} to report")
    rows = read_records(log)
    rows = [r for r in rows if r["method"] in names]
    divergence = check_outputs(rows, names, target, args.max_new_tokens, out, shared.exact)  # float32 re-checks
    summary = summarize(rows, names, verdicts=verdicts(divergence),
                        identical_to=divergence["reference"] if divergence else None)
    plain = "plain" if "plain" in names else summary["baseline"]
    plain_rows = {r["prompt"]: r for r in rows if r["method"] == plain}
    added = {m.name: predicted_added(m, target, args.max_nodes) for m in methods}
    memory = {m.name: {"predicted": added[m.name].to_dict(), "predicted_at_context": added[m.name].at(args.context),
                       "measured": measured_added(m, target, [r for r in rows if r["method"] == m.name], plain_rows)}
              for m in methods}
    budget_rows = budget_table(names, target, added, budgets, args.context, context_length(target.config))
    if args.budget_speed and not args.report_only:
        budget_speeds(budget_rows, methods, target, tok, args)
    for m in methods:
        m.close()
    report = {"setup": {**{k: v for k, v in vars(args).items() if k != "heads"}, "heads": heads,
                        "methods": names, "device": str(target.device), "dtype_used": dtype_name(dtype),
                        "target_pass_used": shared.name, "exact": shared.exact,
                        "torch_threads": torch.get_num_threads()},
              "summary": summary, "target_memory": predict_target(target).to_dict(), "memory": memory,
              "budgets": budget_rows, "divergence": divergence,
              "environment": recorded_environment(out) if args.report_only else environment()}
    files = report_mod.write(report, out, with_plots=not args.no_plots)
    print(report_mod.markdown(report))
    print("wrote " + ", ".join(str(f) for f in files))
    if failure_message(divergence):
        print(failure_message(divergence), file=sys.stderr, flush=True)
    return report


def run(args: argparse.Namespace) -> int:
    """``selfspec bench``: exit status 1 when a lossless method diverged for real (a bug), else 0."""
    return 1 if real_divergences(bench(args)["divergence"]) else 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m selfspec_eval.bench``: the same command as ``selfspec bench``."""
    parser = OneLineParser(prog="selfspec bench", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run_command("selfspec bench", run, parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
