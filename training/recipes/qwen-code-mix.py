"""Training conversations for Qwen2.5-Coder-1.5B EAGLE-style heads (the code-mix retraining in its model card).

    python training/recipes/qwen-code-mix.py --out runs/data/qwen-code-mix.jsonl

A coder is benchmarked on code and on chat, so its heads learn from both: from the ShareGPT train
split, conversations whose first user turn is at most 800 characters (so that a 320-token example
keeps room for the reply), 400 about code (the regex below) and 200 others, interleaved two to one
(others beyond half the code ones follow at the end).
Writes ``{"id", "category", "messages"}`` lines, which ``train_heads.py --data`` reads as they are.
"""

import argparse
import re
from pathlib import Path

from selfspec.data import iter_examples
from selfspec.data.jsonio import write_jsonl_atomic

CODE = re.compile(r"```|\bdef |\bfunction\b|\bpython\b|\bjavascript\b|\bjava\b|\bc\+\+|\bcode\b|\bsql\b"
                  r"|\bscript\b|\bclass\b|\bimplement|\bprogram", re.I)


def first_user_turn(messages: list[dict]) -> str:
    return next((m["content"] for m in messages if m["role"] == "user"), "")


def select(n_code: int, n_other: int, max_chars: int) -> list[dict]:
    """``n_code`` code conversations with one other after every second, in ShareGPT order; extra others last."""
    code, other = [], []
    for ex in iter_examples("sharegpt", "train", 0.02):
        user = first_user_turn(ex["messages"])
        if len(user) <= max_chars:
            (code if CODE.search(user) else other).append(ex)
        if len(code) >= n_code and len(other) >= n_other:
            break
    code, other, rows = code[:n_code], other[:n_other], []
    for i, ex in enumerate(code):
        rows.append(ex)
        if i % 2 == 1 and i // 2 < len(other):
            rows.append(other[i // 2])
    return rows + other[len(code) // 2:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--code", type=int, default=400)
    p.add_argument("--other", type=int, default=200)
    p.add_argument("--max-chars", type=int, default=800, help="longest first user turn kept")
    args = p.parse_args()
    rows = select(args.code, args.other, args.max_chars)
    count = write_jsonl_atomic(Path(args.out), ({k: ex[k] for k in ("id", "category", "messages")} for ex in rows))
    print(f"{count} conversations -> {args.out}")


if __name__ == "__main__":
    main()
