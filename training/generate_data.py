"""Self-distillation data: the target regenerates the assistant replies, so heads learn its own distribution.

    python training/generate_data.py --model smollm2-135m-instruct --data sharegpt \
        --max-examples 2000 --max-new-tokens 256 --out runs/data/smollm2-sharegpt.jsonl
    accelerate launch training/train_heads.py --data runs/data/smollm2-sharegpt.jsonl ...

Takes each conversation's first user turn (and system message), generates the reply with the
target (greedy by default) through selfspec's batch engine (``--batch-size`` requests decoded together, each
written as it finishes, drafted by ``--heads`` where given, else by prompt lookup: the replies are the target's own
either way; ``--engine transformers``: left-padded ``model.generate`` batches instead), and appends
``{"id", "category", "messages"}`` lines. A rerun skips the ids already written and first cuts a torn last line (a
run killed mid-write), so a killed run resumes where it stopped without a duplicate or a broken line.

``--workers N`` (CPU): N processes of ``cores / N`` threads each, worker k answering prompts k, k + N, ... and
appending to the same file (each line one ``write``). On a small CPU a batched step of a small model leaves its
other threads waiting between kernels: on 2 cores, 2 one-thread workers make more replies an hour than one
two-thread process (training/README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from tqdm.auto import tqdm

from selfspec.data import apply_chat_template, jsonl_lines, load_chat_dataset
from selfspec.errors import SelfspecError
from selfspec.zoo import DEFAULT_MODEL, load_model


def prompt_messages(messages: list[dict]) -> list[dict]:
    """The leading system message (if any) and the first user turn."""
    head = [m for m in messages[:1] if m["role"] == "system"]
    user = next(m for m in messages if m["role"] == "user")
    return head + [user]


def done_ids(path: Path) -> set[str]:
    """Ids already written by an earlier (maybe interrupted) run; a torn last line is dropped."""
    if not path.exists():
        return set()
    ids = set()
    for line in jsonl_lines(path.read_text(encoding="utf-8")):
        try:
            ids.add(json.loads(line)["id"])
        except (json.JSONDecodeError, KeyError):
            continue
    return ids


def repair_tail(path: Path) -> None:
    """Cut a last line that a killed run left without its newline: the next rows then start on a line of their own
    (its id was not counted as done, so that conversation is generated again)."""
    if not path.exists() or path.stat().st_size == 0:
        return
    data = path.read_bytes()
    if not data.endswith(b"\n"):
        path.write_bytes(data[:data.rfind(b"\n") + 1])


def contiguous_head_input(model) -> None:
    """Make the LM head's input contiguous: after prefill ``generate`` passes it a slice (B, 1, H), which
    torch's CPU matmul turns into a batched product copying the whole head B times (seconds per batch)."""
    model.get_output_embeddings().register_forward_pre_hook(lambda _, args: (args[0].contiguous(), *args[1:]))


def selfspec_replies(model, tokenizer, todo: list, args: argparse.Namespace):
    """(item, reply) for every item of ``todo`` (``(example, messages, ids)``) as its request finishes, decoded
    ``args.batch_size`` at a time by selfspec's batch engine (prompt lookup drafting where the load lets it pay)."""
    from selfspec.batching import BatchEngine
    from selfspec.checkpoint import load_heads
    from selfspec.drafters.prompt_lookup import PromptLookupDrafter
    from selfspec.engine import DecodeConfig
    from selfspec.sampling import SamplingConfig

    if not todo:
        return
    context = max(len(ids) for _, _, ids in todo) + args.max_new_tokens
    drafter = load_heads(model, args.heads, tokenizer=tokenizer)[1] if args.heads else PromptLookupDrafter()
    engine = BatchEngine(model, drafter, tokenizer, max_batch=args.batch_size, context=context)
    sampling = SamplingConfig(temperature=args.temperature)
    items = {engine.add(item[2], DecodeConfig(max_new_tokens=args.max_new_tokens, sampling=sampling,
                                              seed=args.seed + i)): item for i, item in enumerate(todo)}
    while engine.busy:
        for req, _ in engine.step():
            if req.finished:
                yield items.pop(req), tokenizer.decode(req.generated, skip_special_tokens=True).strip()


def transformers_replies(model, tokenizer, todo: list, args: argparse.Namespace):
    """The same, through ``model.generate`` in left-padded batches of ``args.batch_size`` (similar lengths)."""
    todo = sorted(todo, key=lambda t: len(t[2]))  # similar lengths per batch: less padding
    for i in range(0, len(todo), args.batch_size):
        chunk = todo[i:i + args.batch_size]
        yield from zip(chunk, generate_batch(model, tokenizer, [c[2] for c in chunk], args.max_new_tokens,
                                             args.temperature))


@torch.no_grad()
def generate_batch(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, temperature: float) -> list[str]:
    """Left-padded batched generation; returns the decoded replies."""
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    out = model.generate(ids.to(model.device), attention_mask=mask.to(model.device), max_new_tokens=max_new_tokens,
                         pad_token_id=pad, **sampling)
    return [tokenizer.decode(row[width:], skip_special_tokens=True).strip() for row in out]


def write_replies(out: Path, replies, total: int, desc: str = "self-distill", position: int = 0) -> tuple[int, bool]:
    """Append each (item, reply) as a line the moment it arrives, in one ``write`` (workers share the file):
    (lines written, whether the user interrupted); every line written before an interrupt is whole, so a rerun
    resumes after them."""
    written = 0
    try:
        with out.open("ab", buffering=0) as f, tqdm(total=total, desc=desc, unit="reply", position=position) as bar:
            for (ex, msgs, _), reply in replies:
                if reply:
                    row = {"id": ex["id"], "category": ex["category"],
                           "messages": msgs + [{"role": "assistant", "content": reply}]}
                    f.write((json.dumps(row, ensure_ascii=False) + "\n").encode())
                    written += 1
                bar.update(1)
    except KeyboardInterrupt:
        return written, True
    return written, False


def pending(ds, seen: set[str], tokenizer, max_prompt_tokens: int, part: tuple[int, int] = (0, 1)) -> list:
    """(example, messages, prompt ids) for every example of shard ``part`` = (k, N) not yet written: shard k owns
    examples k, k + N, ... of the data by position, whatever other workers have written by the time it looks."""
    k, n = part
    todo = []
    for i, ex in enumerate(ds):
        if i % n != k or ex["id"] in seen:
            continue
        msgs = prompt_messages(ex["messages"])
        ids = apply_chat_template(tokenizer, msgs)
        if len(ids) <= max_prompt_tokens:
            todo.append((ex, msgs, ids))
    return todo


def shard(text: str) -> tuple[int, int]:
    """``k/N`` -> (k, N): this process answers prompts k, k + N, k + 2N, ..."""
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a shard is k/N, got {text!r}") from None
    if not 0 <= k < n:
        raise argparse.ArgumentTypeError(f"a shard k/N needs 0 <= k < N, got {text!r}")
    return k, n


def run_workers(argv: list[str], workers: int) -> int:
    """Start ``workers`` processes of this script, worker k with ``--shard k/workers`` and the CPU's cores shared
    out as threads; wait for them all (Ctrl-C reaches each: each says what it wrote)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, cores // workers))}
    procs = [subprocess.Popen([sys.executable, __file__, *argv, "--workers", "1", "--shard", f"{k}/{workers}"],
                              env=env) for k in range(workers)]
    codes = []
    for proc in procs:
        while True:
            try:
                codes.append(proc.wait())
                break
            except KeyboardInterrupt:  # the workers got it too: wait for them to write their last lines
                continue
    return next((c for c in codes if c), 0)


def main() -> int:
    """Generate (or resume generating) the self-distillation file."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--data", default="sharegpt", help="sharegpt | humaneval | a .json/.jsonl file | hub id")
    p.add_argument("--split", default="train", help="train | heldout | all")
    p.add_argument("--max-examples", type=int, default=1000)
    p.add_argument("--max-prompt-tokens", type=int, default=512, help="skip longer prompts")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (what greedy decoding will draft)")
    p.add_argument("--seed", type=int, default=0, help="for sampling (--temperature > 0)")
    p.add_argument("--batch-size", type=int, default=8, help="requests decoded together")
    p.add_argument("--engine", choices=("selfspec", "transformers"), default="selfspec",
                   help="selfspec's batch engine (continuous batching, default) or transformers' generate")
    p.add_argument("--heads", help="a heads folder that drafts in the batch engine (default: prompt lookup); the "
                   "replies are the target's own either way")
    p.add_argument("--dtype", default="auto",
                   help="auto (default): what `selfspec serve` picks on this machine, so the replies are the greedy "
                   "answers the server will verify against; float32 / bfloat16 to pin it")
    p.add_argument("--device", default="cpu")
    p.add_argument("--workers", type=int, default=1, help="processes sharing the prompts and the CPU's cores "
                   "(CPU; each line is appended whole)")
    p.add_argument("--shard", type=shard, default=(0, 1), help=argparse.SUPPRESS)  # k/N: set by --workers
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if args.workers < 1:
        p.error(f"--workers must be >= 1, got {args.workers}")
    out = Path(args.out)
    if args.workers > 1:
        if args.device != "cpu":
            p.error("--workers shares a CPU's cores between processes: use it with --device cpu")
        out.parent.mkdir(parents=True, exist_ok=True)
        repair_tail(out)  # once, before any worker appends
        return run_workers(sys.argv[1:], args.workers)
    torch.manual_seed(args.seed)
    try:
        model, tok = load_model(args.model, dtype=args.dtype, device=args.device)
        contiguous_head_input(model)
        ds = load_chat_dataset(args.data, split=args.split, limit=args.max_examples)
    except SelfspecError as exc:
        print(f"generate_data: error: {exc}", file=sys.stderr)
        return 2
    out.parent.mkdir(parents=True, exist_ok=True)
    k, n = args.shard
    if n == 1:
        repair_tail(out)
    todo = pending(ds, done_ids(out), tok, args.max_prompt_tokens, (k, n))
    replies = (selfspec_replies if args.engine == "selfspec" else transformers_replies)(model, tok, todo, args)
    desc = "self-distill" if n == 1 else f"self-distill {k + 1}/{n}"
    written, interrupted = write_replies(out, replies, len(todo), desc, position=k)
    if interrupted:
        print(f"generate_data: interrupted: {written} replies written to {out} this run; the same command resumes",
              file=sys.stderr)
        return 130
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
