"""What more data buys: heads trained by one recipe on the first 1k, 2k, 4k, 8k ... conversations, side by side.

    python -m selfspec_eval.scaling --config training/configs/smollm2-eagle-scaling.json \\
        --data runs/data/smollm2-sharegpt.jsonl --sizes 1000,2000,4000,8000 --out runs/scaling-smollm2

For each size, ``training/train_heads.py --config CONFIG --max-examples N`` (its own process, its log beside it,
resumed where a stage stopped; the target's features cached once in ``OUT/features`` and shared by every size),
then for every trained size at once, on the same questions:

- held-out top-1 by draft depth, teacher-forced (``selfspec_eval.heldout``'s measure, on ShareGPT conversations as
  written that the id split keeps out of every size's data), and
- held-out tau: ``selfspec bench`` with each size's heads drafting their own fixed tree (``--fixed-tree``, default
  16 nodes, depth 6), greedy, on held-out ShareGPT and HumanEval questions, interleaved per question.

Writes ``OUT/report.md`` / ``report.json`` (the table, the commands, the environment) and ``OUT/scaling.png``.
A step already done (a size trained, the bench's runs) is not done again: rerun the command to go on.
``--earlier REPORT``: rows of an earlier run's ``report.json`` for sizes this run does not train (its ``runs/`` lost
with a machine, say) join the table and the plot, marked with that run's commit and date. Held-out top-1 and tau
are deterministic given the heads and the questions, so such a row stands beside new ones where the recipe, the
data's first N conversations and the questions are the same (rerun one shared size to check: its row repeats).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from selfspec.options import OneLineParser, positive_int, run_command

from .environment import environment

ROOT = Path(__file__).resolve().parent.parent


def sizes(text: str) -> list[int]:
    out = sorted({int(n) for n in text.split(",") if n.strip()})
    if not out or out[0] < 1:
        raise argparse.ArgumentTypeError(f"sizes are conversation counts >= 1, got {text}")
    return out


def label(n: int) -> str:
    return f"{n // 1000}k" if n % 1000 == 0 else str(n)


def heads_dir(out: Path, n: int) -> Path:
    """Where size ``n``'s heads live under a name of their own (the bench names a method by its folder)."""
    return out / f"heads-{label(n)}"


def train(args: argparse.Namespace, n: int) -> dict:
    """Train size ``n`` (or go on with it); the seconds it has taken, from its log."""
    run = args.out / label(n)
    link = heads_dir(args.out, n)
    if not (run / "heads" / "selfspec_heads.json").exists():
        cmd = [sys.executable, str(ROOT / "training" / "train_heads.py"), "--config", str(args.config),
               "--data", args.data, "--max-examples", str(n), "--output-dir", str(run),
               "--feature-dir", str(args.out / "features")]
        if any(run.glob("checkpoint-*")):
            cmd.append("--resume")
        print(f"scaling: training on {n} conversations: {' '.join(cmd)}", flush=True)
        run.mkdir(parents=True, exist_ok=True)
        with open(run / "train.out", "a") as log:
            subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT)
    if not link.exists():
        link.symlink_to((run / "heads").resolve())
    steps = [r for line in (run / "log.jsonl").read_text().splitlines() if "loss" in (r := json.loads(line))]
    return {"conversations": n, "steps": steps[-1]["step"], "train_s": round(steps[-1]["elapsed_s"], 1),
            "final_loss": round(steps[-1]["loss"], 4)}


def bench(args: argparse.Namespace) -> dict:
    """The bench over every size's heads (resumed from its runs.jsonl); its report."""
    names = [heads_dir(args.out, n).name for n in args.sizes]
    cmd = [sys.executable, "-m", "selfspec_cli", "bench", "--model", args.model,
           *[a for n in args.sizes for a in ("--heads", str(heads_dir(args.out, n)))],
           "--methods", ",".join(["plain", "eagle", *names]), "--prompts", "chat,code", "--n", str(args.n),
           "--max-new-tokens", str(args.max_new_tokens), "--fixed-tree", "--max-depth", str(args.max_depth),
           "--max-nodes", str(args.max_nodes), "--out", str(args.out / "bench"), "--no-plots"]
    print(f"scaling: {' '.join(cmd)}", flush=True)
    subprocess.run(cmd, check=True)
    return json.loads((args.out / "bench" / "report.json").read_text())


def heldout(args: argparse.Namespace) -> dict[str, list[float]]:
    """Held-out top-1 by depth of every size's heads and the committed ones, on the same ShareGPT conversations (as
    written; the id split keeps them out of every size's data): heads folder -> accuracies."""
    folders = [str(heads_dir(args.out, n)) for n in args.sizes]
    cmd = [sys.executable, "-m", "selfspec_eval.heldout", "--model", args.model, "--heads", *folders,
           "--data", "sharegpt", "--examples", str(args.heldout_examples), "--max-length", "384"]
    print(f"scaling: {' '.join(cmd)}", flush=True)
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    print(out, flush=True)
    found = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 4 and cells[0] in folders:
            found[cells[0]] = [float(a) for a in cells[2].split() if a != "-"]
    return found


def method_for(report: dict, n: int) -> str:
    """The bench's method name for size ``n``'s heads (the first family takes the family's name)."""
    folder = str(heads_dir(report["_out"], n))
    return next(name for name, path in report["setup"]["heads"].items() if path == folder)


def earlier_rows(path: Path, sizes: list[int]) -> list[dict]:
    """Rows of an earlier report for sizes not in ``sizes``, each marked with the run it came from."""
    report = json.loads(path.read_text())
    env = report.get("environment", {})
    return [{**row, "earlier": {"report": str(path), "commit": env.get("commit"), "date": env.get("date")}}
            for row in report["rows"] if row["conversations"] not in sizes]


def table(rows: list[dict]) -> list[str]:
    lines = ["| conversations | steps | training | held-out top-1 by depth 1..4 | tau chat | tau code | tau overall |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        top1 = " ".join(f"{a:.3f}" for a in r["heldout_top1_by_depth"])
        mark = " (earlier run)" if "earlier" in r else ""
        lines.append(f"| {r['conversations']:,}{mark} | {r['steps']:,} | {r['train_s'] / 60:.0f} min | {top1} | "
                     f"{r['tau']['chat']:.2f} | {r['tau']['code']:.2f} | **{r['tau']['overall']:.2f}** |")
    return lines


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    xs = [r["conversations"] for r in rows]
    for key, style in (("overall", "o-"), ("chat", "s--"), ("code", "^--")):
        left.plot(xs, [r["tau"][key] for r in rows], style, label=key)
    left.set(xscale="log", xlabel="self-distilled conversations", ylabel="held-out tau (tokens per target pass)",
             title="acceptance length")
    for d in range(4):
        right.plot(xs, [r["heldout_top1_by_depth"][d] for r in rows if len(r["heldout_top1_by_depth"]) > d],
                   "o-", label=f"depth {d + 1}")
    right.set(xscale="log", xlabel="self-distilled conversations", ylabel="held-out top-1",
              title="top-1 by draft depth (teacher-forced)")
    for ax in (left, right):
        ax.minorticks_off()  # a log axis would label 3x10^3 between the sizes
        ax.set_xticks(xs, [label(x) for x in xs])
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    rows = [train(args, n) for n in args.sizes]
    top1 = heldout(args)
    for row in rows:
        row["heldout_top1_by_depth"] = top1[str(heads_dir(args.out, row["conversations"]))]
    report = bench(args)
    report["_out"] = args.out
    for row in rows:
        name = method_for(report, row["conversations"])
        row["tau"] = {cat: report["summary"]["categories"][cat][name]["tau"] for cat in ("chat", "code", "overall")}
    if args.earlier:
        rows = sorted(rows + earlier_rows(args.earlier, args.sizes), key=lambda r: r["conversations"])
    result = {"model": args.model, "config": json.loads(Path(args.config).read_text()), "data": args.data,
              "bench": {"questions_per_source": args.n, "max_new_tokens": args.max_new_tokens,
                        "tree": f"fixed, {args.max_nodes} nodes, depth {args.max_depth}"},
              "rows": rows, "environment": environment(), "wall_s": round(time.time() - start)}
    (args.out / "report.json").write_text(json.dumps(result, indent=1))
    lines = [f"# Held-out acceptance by training data: {args.model}", "",
             (f"Recipe `{args.config}`, data `{args.data}` (the first N conversations), held-out tau from "
              f"`selfspec bench --fixed-tree` ({args.max_nodes} nodes, depth {args.max_depth}), {args.n} ShareGPT + "
              f"{args.n} HumanEval questions, {args.max_new_tokens} new tokens, greedy."), "", *table(rows), "",
             *[f"Earlier run: `{r['earlier']['report']}` (commit {r['earlier']['commit']}, "
               f"{r['earlier']['date']}), {r['conversations']:,} conversations." for r in rows if "earlier" in r], "",
             (f"    python -m selfspec_eval.scaling --config {args.config} --data {args.data} "
              f"--sizes {','.join(map(str, args.sizes))} --out {args.out}"
              + (f" --earlier {args.earlier}" if args.earlier else "")), "",
             f"Environment: `{json.dumps(result['environment'])}`"]
    (args.out / "report.md").write_text("\n".join(lines) + "\n")
    plot(rows, args.out / "scaling.png")
    print("\n".join(table(rows)))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m selfspec_eval.scaling``."""
    p = OneLineParser(prog="scaling", description=__doc__.split("\n")[0])
    p.add_argument("--config", type=Path, required=True, help="the training recipe (a train_heads.py config)")
    p.add_argument("--data", required=True, help="the conversations, as train_heads.py --data takes them")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--sizes", type=sizes, default=[1000, 2000, 4000, 8000], help="conversation counts, comma-separated")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--n", type=positive_int, default=12, help="held-out questions per source (chat, code)")
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--max-depth", type=positive_int, default=6)
    p.add_argument("--max-nodes", type=positive_int, default=16)
    p.add_argument("--heldout-examples", type=positive_int, default=48, help="held-out ShareGPT conversations")
    p.add_argument("--earlier", type=Path, help="an earlier run's report.json: its rows for other sizes join the table")
    args = p.parse_args(argv)
    if args.earlier and not args.earlier.is_file():
        p.error(f"--earlier {args.earlier}: no such report.json")
    return run_command("scaling", run, args)


if __name__ == "__main__":
    sys.exit(main())
