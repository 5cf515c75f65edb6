"""A prepared GPU run: the CUDA tests, the compiled pass, a short heads training and the bench, in one report.

    python -m selfspec_eval.gpu_check                    # a CUDA machine: full size; elsewhere: smoke size
    python -m selfspec_eval.gpu_check --smoke --steps cuda-tests,bench-smollm2

Run from the clone's root (the steps use tests/, training/ and checkpoints/). The steps, in order, each a
subprocess with a time limit (``STEPS``):

    cuda-tests     pytest -m cuda: the tests that need CUDA (on a CPU they skip, and the report says so)
    compiled-pass  selfspec bench --target-pass compiled (on CUDA: the graphs replayed as CUDA graphs), SmolLM2
                   plain and committed eagle heads, each output checked against plain's
    train-heads    EAGLE heads for SmolLM2 on ShareGPT, on one GPU time-boxed (--train-budget, 5 minutes): at the
                   box the run is stopped and its heads written from its last checkpoint (--resume --max-steps N)
    bench-smollm2  selfspec bench: hf, plain, eagle (committed heads), draft-model and the heads just trained
    bench-qwen     selfspec bench of Qwen2.5-Coder-1.5B: hf, plain, eagle, draft-model (Qwen2.5-Coder-0.5B)

Full size where CUDA is available, smoke size elsewhere or with ``--smoke`` (``SMOKE``: one question per
source, 16 tokens, two training steps, SmolLM2 only), so CI keeps every step working on a CPU. Writes
``OUT/report.json`` and ``OUT/report.md`` (device, torch, git commit, per step: command, status, return code,
seconds, figures, the tail of its output), each step's whole output in ``OUT/logs/`` and its files in
``OUT/<step>/``. Exit status 1 when a step failed or ran out of time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from .gpu_report import environment, write_report

SMALL, LARGE, LARGE_DRAFT = "smollm2-135m-instruct", "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
BENCH_METHODS = "hf,plain,eagle,draft-model"


@dataclass(frozen=True)
class Size:
    """How much each step runs (and how long it may take)."""

    name: str
    questions: int  # bench: questions per source (chat, code)
    new_tokens: int
    compiled: list[str]  # compiled-pass: its bench options beyond the model and methods
    train: list[str]  # train-heads: its options beyond model, family, data and output folder
    train_budget_s: float | None  # stopped there and its heads written (None: runs to its end)
    large_model: bool  # bench-qwen runs
    limit_s: dict[str, float]  # per step: killed past this (a time-out)


FULL = Size("full", questions=3, new_tokens=96,
            compiled=["--n", "2", "--max-new-tokens", "64"],
            train=["--max-examples", "2000", "--epochs", "50", "--batch-size", "8", "--mixed-precision", "bf16",
                   "--save-every", "100"],
            train_budget_s=300, large_model=True,
            limit_s={"cuda-tests": 1200, "compiled-pass": 1800, "train-heads": 600, "bench-smollm2": 2400,
                     "bench-qwen": 2400})
SMOKE = Size("smoke", questions=1, new_tokens=16,
             compiled=["--n", "1", "--prompts", "code", "--max-new-tokens", "16", "--max-nodes", "4"],
             train=["--max-examples", "8", "--max-steps", "2", "--max-length", "128", "--eval-examples", "4"],
             train_budget_s=None, large_model=False,
             limit_s={"cuda-tests": 600, "compiled-pass": 900, "train-heads": 600, "bench-smollm2": 900,
                      "bench-qwen": 900})


@dataclass
class Check:
    """One run of the check: where it writes, how big it is, which device the commands use."""

    out: Path
    size: Size
    device: str  # "cuda" or "cpu": what selfspec bench runs on (training: accelerate picks the GPU itself)

    def folder(self, step: str) -> Path:
        """The step's own output folder, emptied first (a bench would otherwise resume an older run)."""
        path = self.out / step
        shutil.rmtree(path, ignore_errors=True)
        return path

    def log(self, step: str, part: str = "") -> Path:
        (self.out / "logs").mkdir(parents=True, exist_ok=True)
        return self.out / "logs" / f"{step}{part}.log"

    def limit(self, step: str) -> float:
        return self.size.limit_s[step]


@dataclass
class Outcome:
    """One subprocess: how it ended (exited | budget: stopped at its time box | timeout: killed at its limit)."""

    command: list[str]
    returncode: int
    seconds: float
    output: str
    ended: str


@dataclass
class StepResult:
    """One step as the report shows it."""

    name: str
    status: str  # passed | failed | timed out | skipped
    commands: list[str] = field(default_factory=list)
    returncode: int | None = None
    seconds: float = 0.0
    figures: dict = field(default_factory=dict)
    note: str = ""
    tail: list[str] = field(default_factory=list)


# --- running a command ----------------------------------------------------------------------------------

def stop(proc: subprocess.Popen, grace_s: float = 30) -> None:
    """SIGTERM to the command's own process group (its workers too), SIGKILL if it lingers."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=grace_s)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue
    proc.wait()


def run_command(argv: list[str], log: Path, limit_s: float, budget_s: float | None = None) -> Outcome:
    """``argv`` from the current folder, its output into ``log``; stopped at ``budget_s`` (an expected end) or
    killed at ``limit_s`` (a time-out), whichever comes first."""
    deadline = min(limit_s, budget_s if budget_s is not None else math.inf)
    start = time.monotonic()
    with log.open("w") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            proc.wait(timeout=deadline)
            ended = "exited"
        except subprocess.TimeoutExpired:
            stop(proc)
            ended = "budget" if budget_s is not None and budget_s < limit_s else "timeout"
    return Outcome(argv, proc.returncode, time.monotonic() - start, log.read_bytes().decode(errors="replace"), ended)


def tail(output: str, lines: int = 30) -> list[str]:
    """The last non-empty lines of ``output``, each as a terminal shows it (progress bars: their last state)."""
    shown = [line.rsplit("\r", 1)[-1].rstrip() for line in output.split("\n")]  # splitlines() would split at "\r"
    return [line for line in shown if line][-lines:]


def result(name: str, outcomes: list[Outcome], figures: dict | None = None, note: str = "") -> StepResult:
    """A step's result from its commands: the last one decides the status."""
    last = outcomes[-1]
    status = "timed out" if last.ended == "timeout" else "passed" if last.returncode == 0 else "failed"
    return StepResult(name, status, [" ".join(o.command) for o in outcomes], last.returncode,
                      round(sum(o.seconds for o in outcomes), 1), figures or {}, note, tail(last.output))


# --- the steps ------------------------------------------------------------------------------------------

def selfspec() -> list[str]:
    return [sys.executable, "-m", "selfspec_cli"]


def pytest_counts(output: str) -> dict[str, int]:
    """pytest's closing line ("1 failed, 3 passed, 2 skipped in 2.1s") as counts."""
    for line in reversed(tail(output, 5)):
        found = re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)\b", line)
        if found:
            return {word.removesuffix("s") if word.startswith("error") else word: int(n) for n, word in found}
    return {}


def cuda_tests(check: Check) -> StepResult:
    """The tests marked ``cuda``; where CUDA is missing they skip, which is this step's status then."""
    if not Path("tests").is_dir():
        return StepResult("cuda-tests", "skipped", note="no tests/ here: run from the clone's root")
    outcome = run_command([sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", "tests"],
                          check.log("cuda-tests"), check.limit("cuda-tests"))
    counts = pytest_counts(outcome.output)
    res = result("cuda-tests", [outcome], counts)
    if outcome.returncode == 5:
        res.note = "no test is marked cuda"
    elif res.status == "passed" and not counts.get("passed") and counts.get("skipped"):
        res.status, res.note = "skipped", f"no CUDA here: {counts['skipped']} tests skipped"
    return res


def bench_figures(folder: Path, output: str) -> dict:
    """What a bench measured, from its ``report.json``: per method tokens/s, speedup, tau, output diagnosis."""
    path = folder / "report.json"
    if not path.is_file():
        return {}
    report = json.loads(path.read_text())
    setup, summary = report["setup"], report["summary"]
    compiled = re.search(r"compiled the target pass's graphs in (\d+) s", output)
    methods = {m: {"tokens_per_s": round(v["tokens_per_s"], 2), "speedup": round(v["speedup"], 2),
                   "tau": None if v["tau"] is None else round(v["tau"], 2), "outputs": v.get("divergence")}
               for m, v in summary["categories"]["overall"].items()}
    return {"device": setup["device"], "dtype": setup["dtype_used"], "target_pass": setup["target_pass_used"],
            "questions": summary["questions"], "speedup_against": summary["baseline"],
            **({"compile_s": int(compiled.group(1))} if compiled else {}), "methods": methods}


def bench(check: Check, name: str, argv: list[str], note: str = "") -> StepResult:
    """One ``selfspec bench`` into ``OUT/<name>``, no plots."""
    folder = check.folder(name)
    argv = [*selfspec(), "bench", *argv, "--device", check.device, "--heads-path", "checkpoints", "--no-plots",
            "--out", str(folder)]
    outcome = run_command(argv, check.log(name), check.limit(name))
    return result(name, [outcome], bench_figures(folder, outcome.output), note)


def compiled_pass(check: Check) -> StepResult:
    """The compiled target pass (CUDA graphs on a GPU): plain and eagle heads, outputs diagnosed against plain."""
    return bench(check, "compiled-pass", ["--model", SMALL, "--target-pass", "compiled", "--methods", "plain,eagle",
                                          *check.size.compiled])


def training_figures(folder: Path) -> dict:
    """Steps, last loss, tokens per second and held-out top-1 by depth, from the run's ``log.jsonl``."""
    path = folder / "log.jsonl"
    rows = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # the line being written when the time box stopped the run
            continue
    steps = [r for r in rows if "loss" in r]
    heldout = [r["heldout_top1_by_depth"] for r in rows if "heldout_top1_by_depth" in r]
    figures = {"heads": str(folder / "heads") if (folder / "heads").is_dir() else None}
    if steps:
        last = steps[-1]
        figures.update(steps=last["step"], loss=round(last["loss"], 4), train_s=round(last["elapsed_s"], 1),
                       tokens_per_s=round(sum(r.get("tokens", 0) for r in steps) / max(last["elapsed_s"], 1e-9)))
    if heldout:
        figures["heldout_top1_by_depth"] = [round(a, 3) for a in heldout[-1]]
    return figures


def train_heads(check: Check) -> StepResult:
    """EAGLE heads for SmolLM2; time-boxed on a GPU, then finished from the last checkpoint."""
    from selfspec.train.loop import latest_checkpoint

    folder = check.folder("train-heads")
    argv = [sys.executable, "training/train_heads.py", "--base-model", SMALL, "--family", "eagle", "--data",
            "sharegpt", "--output-dir", str(folder), *check.size.train]
    budget = check.size.train_budget_s
    outcomes = [run_command(argv, check.log("train-heads"), check.limit("train-heads") + (budget or 0), budget)]
    note = ""
    if outcomes[0].ended == "budget":
        ckpt = latest_checkpoint(folder)
        if ckpt is None:
            return result("train-heads", outcomes, training_figures(folder),
                          f"no checkpoint within the {budget:.0f} s time box")
        step = ckpt.name.split("-")[1]
        note = f"stopped at the {budget:.0f} s time box; heads written from its checkpoint at step {step}"
        outcomes.append(run_command([*argv, "--resume", "--max-steps", step], check.log("train-heads", "-finish"),
                                    check.limit("train-heads")))
    return result("train-heads", outcomes, training_figures(folder), note)


def bench_smollm2(check: Check) -> StepResult:
    """SmolLM2: hf, plain, committed eagle heads, draft-model, and the heads train-heads wrote (when it did)."""
    trained = check.out / "train-heads" / "heads"
    methods, extra = BENCH_METHODS, []
    note = ("draft-model drafts with SmolLM2 itself (the zoo has no smaller model with its tokenizer): it checks "
            "the path, its speed means nothing")
    if trained.is_dir():
        methods, extra = f"{methods},heads", ["--heads", str(trained)]
        note += "; 'heads': the heads train-heads just wrote"
    else:
        note += "; no heads from train-heads to bench"
    return bench(check, "bench-smollm2", ["--model", SMALL, "--draft-model", SMALL, "--methods", methods, *extra,
                                          "--n", str(check.size.questions),
                                          "--max-new-tokens", str(check.size.new_tokens)], note)


def bench_qwen(check: Check) -> StepResult:
    """Qwen2.5-Coder-1.5B: hf, plain, committed eagle heads, Qwen2.5-Coder-0.5B as draft model (full size only)."""
    if not check.size.large_model:
        return StepResult("bench-qwen", "skipped", note="smoke size: CI stays on the small model")
    return bench(check, "bench-qwen", ["--model", LARGE, "--draft-model", LARGE_DRAFT, "--methods", BENCH_METHODS,
                                       "--n", str(check.size.questions),
                                       "--max-new-tokens", str(check.size.new_tokens)])


STEPS: dict[str, Callable[[Check], StepResult]] = {
    "cuda-tests": cuda_tests, "compiled-pass": compiled_pass, "train-heads": train_heads,
    "bench-smollm2": bench_smollm2, "bench-qwen": bench_qwen}


# --- the command ----------------------------------------------------------------------------------------

def step_names(text: str) -> list[str]:
    """Comma-separated step names, each checked, in the order they run."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in STEPS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown step '{','.join(unknown)}'; choose from {', '.join(STEPS)}")
    return [n for n in STEPS if n in names]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m selfspec_eval.gpu_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/gpu-check", help="folder for the report, the logs and each step's files")
    p.add_argument("--smoke", action="store_true", help="smoke size even where CUDA is available")
    p.add_argument("--steps", type=step_names, default=list(STEPS),
                   help=f"comma-separated steps to run (default: all, in order: {', '.join(STEPS)})")
    p.add_argument("--train-budget", type=float, default=None,
                   help=f"train-heads' time box in seconds on a full-size run (default {FULL.train_budget_s:.0f})")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the chosen steps in order, write the report, exit 1 when a step failed or timed out."""
    args = build_parser().parse_args(argv)
    import torch

    cuda = torch.cuda.is_available()
    size = SMOKE if args.smoke or not cuda else FULL
    if args.train_budget is not None and size is FULL:
        size = replace(size, train_budget_s=args.train_budget)
    check = Check(Path(args.out), size, "cuda" if cuda else "cpu")
    check.out.mkdir(parents=True, exist_ok=True)
    env = environment(size.name)
    print(f"gpu-check ({size.name} size) on {env['device']}, torch {env['torch']}, commit {env['git_commit']}",
          flush=True)
    results, start = [], time.monotonic()
    for name in args.steps:
        print(f"[{name}] ...", flush=True)
        res = STEPS[name](check)
        results.append(res)
        print(f"[{name}] {res.status} in {res.seconds:.0f} s{': ' + res.note if res.note else ''}", flush=True)
        files = write_report(check.out, env, [asdict(r) for r in results], time.monotonic() - start)  # kept if killed
    print("wrote " + ", ".join(map(str, files)))
    return 1 if any(r.status in ("failed", "timed out") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
