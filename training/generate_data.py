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
"""

from __future__ import annotations

import argparse
import json
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
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.manual_seed(args.seed)
    try:
        model, tok = load_model(args.model, dtype=args.dtype, device=args.device)
        contiguous_head_input(model)
        ds = load_chat_dataset(args.data, split=args.split, limit=args.max_examples)
    except SelfspecError as exc:
        print(f"generate_data: error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    repair_tail(out)
    seen = done_ids(out)
    todo = []
    for ex in ds:
        if ex["id"] in seen:
            continue
        msgs = prompt_messages(ex["messages"])
        ids = apply_chat_template(tok, msgs)
        if len(ids) <= args.max_prompt_tokens:
            todo.append((ex, msgs, ids))
    replies = (selfspec_replies if args.engine == "selfspec" else transformers_replies)(model, tok, todo, args)
    with out.open("a") as f, tqdm(total=len(todo), desc="self-distill", unit="reply") as bar:  # replies/s
        for (ex, msgs, _), reply in replies:
            if reply:
                row = {"id": ex["id"], "category": ex["category"],
                       "messages": msgs + [{"role": "assistant", "content": reply}]}
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
                f.flush()
            bar.update(1)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
