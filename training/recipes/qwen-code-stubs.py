"""Function-completion prompts written by the target itself, for heads that draft code completions.

HumanEval asks a model to complete a function from its signature and docstring; ShareGPT has
almost none of those (105 Python functions with a docstring in 11k conversations), so heads
trained on it draft the target's completions poorly. This recipe has the target invent such
exercises (self-instruct), then turns them into completion prompts whose replies
``generate_data.py`` self-distills as usual:

    python training/recipes/qwen-code-stubs.py requests --out runs/data/stub-requests.jsonl --n 720
    python training/generate_data.py --model qwen2.5-coder-1.5b-instruct --data runs/data/stub-requests.jsonl \\
        --split all --max-examples 720 --temperature 0.8 --seed 0 --max-new-tokens 200 --batch-size 48 --dtype bfloat16 \\
        --out runs/data/stubs-raw.jsonl
    python training/recipes/qwen-code-stubs.py prompts --stubs runs/data/stubs-raw.jsonl --out runs/data/stub-prompts.jsonl
    python training/generate_data.py --model qwen2.5-coder-1.5b-instruct --data runs/data/stub-prompts.jsonl \\
        --split train --max-new-tokens 176 --max-prompt-tokens 256 --batch-size 48 --dtype bfloat16 \\
        --out runs/data/qwen-selfdistill.jsonl

(28 + 15 min on 2 CPU cores: 720 exercises, 525 usable stubs, 516 in the train split.) Another
``--seed`` with a new raw file gives new exercises; names already in the output file are skipped.

Or, for any target and at no generation cost, stubs cut from Python source already on disk (the
standard library by default): every public top-level function with a docstring and a short body,
cut after its docstring:

    python training/recipes/qwen-code-stubs.py source --out runs/data/source-stubs.jsonl --n 3000

HumanEval is the benchmark, so it never enters training: a stub is dropped when it defines a
function named like any HumanEval function or shares a run of 8 words (numbers skipped) with any
HumanEval prompt. A reply cut short still gives its stub if the docstring is whole.
"""

import argparse
import ast
import random
import re
import sysconfig
from pathlib import Path

from selfspec.data import HUMANEVAL_TEMPLATE, humaneval_examples, load_chat_dataset
from selfspec.data.jsonio import write_jsonl_atomic

SUBJECTS = [
    "lists of integers", "lists of floats", "strings", "words in a sentence", "characters of a string",
    "dictionaries", "nested lists", "matrices", "tuples of coordinates", "sets", "prime numbers",
    "digits of an integer", "binary strings", "dates written as strings", "intervals", "brackets",
    "vowels and consonants", "palindromes", "Fibonacci-like sequences", "grades of students",
    "prices and discounts", "temperatures", "time given in minutes", "file paths", "email addresses",
    "version strings", "run-length encoding", "anagrams", "stack of plates", "bank account balances",
    "shopping carts", "geometric shapes", "polynomials given as coefficient lists", "roman numerals",
    "hexadecimal numbers", "sorted arrays", "histograms", "scores of a game", "DNA sequences", "graphs as adjacency lists",
]
TASKS = [
    "filtering", "counting", "sorting by a custom key", "finding the maximum or minimum", "checking a property",
    "summing or averaging", "transforming each element", "grouping", "removing duplicates", "parsing",
    "validating input", "merging two inputs", "finding a pair with a property", "rotating or shifting",
    "computing a running total", "comparing two inputs", "encoding or decoding", "searching",
]
REQUEST = ("Invent a short Python programming exercise about {subject}, on {task}. Write only the function "
           "header: the imports it needs, the def line with type hints, and a docstring that states the task "
           "and gives two or three >>> examples with their results. Do not write the function body.")

CODE_BLOCK = re.compile(r"```(?:python|py)?\n(.*?)(?:```|\Z)", re.S)  # a reply cut short leaves it open
DOC_START = re.compile(r"^def \w+\(.*?\).*?:[ \t]*\n[ \t]+(\"\"\"|\'\'\')", re.M | re.S)
DEF_NAME = re.compile(r"^\s*def (\w+)\(", re.M)


def requests(n: int, seed: int) -> list[dict]:
    """``n`` exercise requests over distinct (subject, task) pairs, in a seeded order."""
    pairs = [(s, t) for s in SUBJECTS for t in TASKS]
    if not 0 < n <= len(pairs):
        raise SystemExit(f"qwen-code-stubs.py: error: --n must be 1..{len(pairs)} (subjects x tasks), got {n}")
    random.Random(seed).shuffle(pairs)
    return [{"id": f"stub-request-{i}", "category": "code",
             "messages": [{"role": "user", "content": REQUEST.format(subject=s, task=t)}]}
            for i, (s, t) in enumerate(pairs[:n])]


def stub_of(reply: str) -> str | None:
    """Imports, the first top-level ``def`` line and its docstring from the first Python block of ``reply``."""
    block = CODE_BLOCK.search(reply)
    start = DOC_START.search(block.group(1)) if block else None
    end = block.group(1).find(start.group(1), start.end()) if start else -1
    if end < 0:
        return None
    code = block.group(1)[:end + 3]  # up to the docstring's end: the body, if any, is cut off
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return None
    imports = [ast.get_source_segment(code, n) for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    func = tree.body[-1]
    if not isinstance(func, ast.FunctionDef) or ast.get_docstring(func) is None:
        return None
    head = "\n".join(code.splitlines()[func.lineno - 1:])
    return ("\n".join(imports) + "\n\n\n" if imports else "") + head + "\n"


def word_runs(text: str, n: int = 8) -> set[tuple[str, ...]]:
    """Runs of ``n`` words (numbers skipped: "1 2 3 4 5 6 7 8" is in every example list)."""
    words = re.findall(r"[a-z_]\w*", text.lower())
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def humaneval_guard() -> tuple[set[str], set[tuple[str, ...]]]:
    """Every function name and every 8-word run of the HumanEval prompts."""
    names, runs = set(), set()
    for ex in humaneval_examples():
        text = ex["messages"][0]["content"]
        names.update(DEF_NAME.findall(text))
        runs |= word_runs(text)
    return names, runs


def prompts(stub_file: str) -> list[dict]:
    """Completion prompts from the target's exercises: parsed, deduplicated and kept clear of HumanEval."""
    names, runs = humaneval_guard()
    rows, seen, dropped = [], set(), {"unparsed": 0, "humaneval": 0, "duplicate": 0}
    for ex in load_chat_dataset(stub_file, split="all"):
        reply = next((m["content"] for m in ex["messages"] if m["role"] == "assistant"), "")
        stub = stub_of(reply)
        if stub is None:
            dropped["unparsed"] += 1
            continue
        name = DEF_NAME.search(stub).group(1)
        if name in names or word_runs(stub) & runs:
            dropped["humaneval"] += 1
            continue
        if name in seen:
            dropped["duplicate"] += 1
            continue
        seen.add(name)
        rows.append({"id": f"stub-{name}", "category": "code",
                     "messages": [{"role": "user", "content": HUMANEVAL_TEMPLATE.format(prompt=stub)}]})
    print(f"kept {len(rows)}, dropped {dropped}")
    return rows


SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "lib2to3", "turtledemo",
             "ensurepip", "pydoc_data", "encodings"}


def source_functions(root: Path):
    """(id, name, stub) for every public, undecorated top-level function under ``root`` with a docstring and a body
    of 2 to 25 lines after it: its ``def`` line(s) and docstring as written."""
    for path in sorted(root.rglob("*.py")):
        if SKIP_DIRS & set(path.relative_to(root).parts[:-1]) or path.name.startswith("test"):
            continue
        try:
            text = path.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = text.splitlines()
        for func in tree.body:
            if (not isinstance(func, ast.FunctionDef) or func.name.startswith("_") or func.decorator_list
                    or ast.get_docstring(func) is None or len(func.body) < 2):
                continue
            doc_end = func.body[0].end_lineno
            if not 2 <= func.end_lineno - doc_end <= 25:
                continue
            stub = "\n".join(lines[func.lineno - 1:doc_end]) + "\n"
            module = ".".join(path.relative_to(root).with_suffix("").parts)
            yield f"src-{module}.{func.name}", func.name, stub


def source_prompts(root: Path, n: int, seed: int) -> list[dict]:
    """Up to ``n`` completion prompts from ``root``'s functions, in a seeded order, deduplicated by name and kept
    clear of HumanEval."""
    names, runs = humaneval_guard()
    found = list(source_functions(root))
    random.Random(seed).shuffle(found)
    rows, seen, dropped = [], set(), {"long": 0, "humaneval": 0, "duplicate": 0}
    for ident, name, stub in found:
        if len(stub) > 1500:
            dropped["long"] += 1
        elif name in names or word_runs(stub) & runs:
            dropped["humaneval"] += 1
        elif name in seen:
            dropped["duplicate"] += 1
        else:
            seen.add(name)
            rows.append({"id": ident, "category": "code",
                         "messages": [{"role": "user", "content": HUMANEVAL_TEMPLATE.format(prompt=stub)}]})
        if len(rows) == n:
            break
    print(f"{len(found)} functions under {root}: kept {len(rows)}, dropped {dropped}")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="step", required=True)
    r = sub.add_parser("requests", help="write exercise requests for generate_data.py")
    r.add_argument("--out", required=True)
    r.add_argument("--n", type=int, default=len(SUBJECTS) * len(TASKS), help="requests (default: every pair)")
    r.add_argument("--seed", type=int, default=0)
    s = sub.add_parser("prompts", help="turn the generated exercises into completion prompts")
    s.add_argument("--stubs", required=True, help="generate_data.py's output for the requests")
    s.add_argument("--out", required=True)
    c = sub.add_parser("source", help="completion prompts cut from Python source on disk (no generation)")
    c.add_argument("--root", type=Path, default=Path(sysconfig.get_paths()["stdlib"]),
                   help="a folder of .py files (default: this Python's standard library)")
    c.add_argument("--n", type=int, default=3000, help="prompts at most")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--out", required=True)
    args = p.parse_args()
    if args.step == "source" and not args.root.is_dir():
        p.error(f"--root {args.root}: not a folder")
    if args.step == "requests":
        rows = requests(args.n, args.seed)
    else:
        rows = prompts(args.stubs) if args.step == "prompts" else source_prompts(args.root, args.n, args.seed)
    print(f"{write_jsonl_atomic(Path(args.out), iter(rows))} conversations -> {args.out}")


if __name__ == "__main__":
    main()
