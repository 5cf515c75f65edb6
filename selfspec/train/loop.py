"""The training loop, flat and visible: frozen target, trained heads, accelerate for devices and resume.

    frozen_target -> starting_heads -> load_examples -> training_set (target features cached once)
    -> prepare (loaders, optimizer, warmup + cosine schedule) -> resume
    -> run_epochs: train_step (loss -> backward -> clip -> optimizer step) per batch, a log line and
       every N steps a checkpoint per optimizer step, held-out top-1 accuracy per depth per epoch
    -> write_heads (selfspec heads format, model card)

Distribution is accelerate's own (DDP from `accelerate config`; FSDP or DeepSpeed through its
config files). Resuming restores model, optimizer, scheduler and RNG states with
``accelerator.load_state`` and skips the batches already seen in the epoch (seedable sampler), so
a resumed run ends with the same weights as an uninterrupted one.
"""

from __future__ import annotations

import json
import math
import time
from itertools import islice
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from ..checkpoint import load_heads, save_heads
from ..data import load_chat_dataset
from ..data.load import iter_examples
from ..errors import SelfspecError
from ..heads import init_heads
from ..zoo import load_model
from .card import model_card
from .config import TrainConfig, config_dict
from .features import FeatureCache, TokenDataset, build_feature_cache, pad_batch, tokenize_all
from .losses import depth_accuracy, feature_keys, feature_settings, head_loss, prepare_heads, target_features


def load_examples(cfg: TrainConfig, tokenizer, split: str, limit: int) -> list[dict[str, torch.Tensor]]:
    """Tokenised conversations of one split (assistant-token loss masks).

    ``cfg.data`` may list several sources separated by commas (e.g. a self-distillation file, then
    ``sharegpt``): they fill ``limit`` in order, and an id already taken from an earlier source is skipped.
    """
    conversations, seen = [], set()
    for source in [s.strip() for s in cfg.data.split(",") if s.strip()]:
        if len(conversations) >= limit:
            break
        ds = load_chat_dataset(source, split=split, heldout_fraction=cfg.heldout_fraction,
                               limit=limit - len(conversations) + len(seen))
        for ex_id, messages in zip(ds["id"], ds["messages"]):
            if ex_id not in seen and len(conversations) < limit:
                seen.add(ex_id)
                conversations.append(messages)
    return tokenize_all(tokenizer, conversations, cfg.max_length)


def check_data(cfg: TrainConfig, look: int = 200) -> None:
    """Refuse, before any model loads, data that has nothing to train on: no source of ``cfg.data`` whose first
    ``look`` training conversations hold an assistant reply (HumanEval's prompts, a prompts-only file)."""
    sources = [s.strip() for s in cfg.data.split(",") if s.strip()]
    for source in sources:
        for ex in islice(iter_examples(source, "train", cfg.heldout_fraction), look):
            if any(m.get("role") == "assistant" and m.get("content") for m in ex["messages"]):
                return
    raise SelfspecError(f"--data {cfg.data}: no conversation with an assistant reply to train on (prompts only); "
                        "write replies first, e.g. python training/generate_data.py --data "
                        f"{sources[0] if sources else 'SOURCE'} --out replies.jsonl, then --data replies.jsonl")


def with_features(batch: dict[str, torch.Tensor], cfg: TrainConfig, target, heads) -> dict[str, torch.Tensor]:
    """Add the target's states to a batch unless they came from the feature cache."""
    if all(k in batch for k in feature_keys(heads)):
        return batch
    return {**batch, **target_features(cfg.family, target, heads, batch["input_ids"], batch["attention_mask"])}


EVAL_DEPTH = 4


def evaluate(cfg: TrainConfig, heads, target, loader, device: torch.device) -> list[float]:
    """Held-out top-1 accuracy per draft depth (1 .. EVAL_DEPTH)."""
    heads.eval()
    correct, total = [0] * EVAL_DEPTH, [0] * EVAL_DEPTH
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        c, t = depth_accuracy(cfg.family, heads, target, with_features(batch, cfg, target, heads), EVAL_DEPTH)
        correct = [a + b for a, b in zip(correct, c)]
        total = [a + b for a, b in zip(total, t)]
    heads.train()
    return [c / t for c, t in zip(correct, total) if t]


def latest_checkpoint(out: Path) -> Path | None:
    """The newest complete ``step-N`` folder under ``out/checkpoints`` (a killed save leaves only ``.tmp``)."""
    steps = [p for p in (out / "checkpoints").glob("step-*") if p.name.split("-")[1].isdigit()]
    return max(steps, key=lambda p: int(p.name.split("-")[1])) if steps else None


def save_checkpoint(accelerator, out: Path, step: int) -> None:
    """accelerate state (model, optimizer, scheduler, RNG) written to a temporary folder, then renamed."""
    final = out / "checkpoints" / f"step-{step}"
    tmp = final.with_name(final.name + ".tmp")
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        tmp.rename(final)


def check_resumable(cfg: TrainConfig, out: Path) -> None:
    """Resuming is exact only with the settings the run started with."""
    saved = out / "train_config.json"
    if not saved.is_file():
        return
    before = json.loads(saved.read_text())
    now = config_dict(cfg)
    differ = sorted(k for k in now if k not in ("resume", "max_steps") and before.get(k) != now[k])
    if differ:
        raise SelfspecError(f"cannot resume {out}: settings changed since it started ({', '.join(differ)}); "
                            "use the original settings or a new --output-dir")


@dataclass
class Prepared:
    """What the loop steps: accelerate's prepared heads, optimizer, schedule and loaders, and the schedule's length."""

    heads: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    loader: DataLoader
    eval_loader: DataLoader
    steps_per_epoch: int
    total_steps: int


def frozen_target(cfg: TrainConfig, device: torch.device, target=None, tokenizer=None):
    """The target (``cfg.base_model`` unless given) with gradients off: no optimizer state, never trained."""
    if target is None:
        target, tokenizer = load_model(cfg.base_model, device=device)
    target.eval().requires_grad_(False)
    return target, tokenizer


def starting_heads(cfg: TrainConfig, target, tokenizer) -> torch.nn.Module:
    """Untrained heads of ``cfg.family`` in float32, or ``cfg.init_from``'s weights when continuing a run."""
    heads = init_heads(cfg.family, target, **cfg.head_args).float()
    if not cfg.init_from:
        return heads
    start, _ = load_heads(target, cfg.init_from, tokenizer=tokenizer)
    if start.config.family != cfg.family:
        raise SelfspecError(f"--init-from {cfg.init_from} holds {start.config.family} heads, not {cfg.family}")
    # the drafter may have packed the loaded module's linears (oneDNN, opaque to .float()): its state dict is dense
    state = {k: v.float() if v.is_floating_point() else v for k, v in start.state_dict().items()}
    try:
        heads.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise SelfspecError(f"--init-from {cfg.init_from} does not fit --head-arg {cfg.head_args}: "
                            f"{str(exc).splitlines()[-1].strip()}") from exc
    return heads


def training_set(cfg: TrainConfig, accelerator, target, heads, examples: list[dict[str, torch.Tensor]], out: Path):
    """The training examples with the target's states cached on disk (``cfg.cache_features``), or tokens only."""
    if not cfg.cache_features:
        return TokenDataset(examples)
    with accelerator.main_process_first():
        # what the states depend on (not the family: medusa and eagle read the same ones)
        signature = {"base": cfg.base_model, "data": cfg.data, "max_examples": cfg.max_examples,
                     "max_length": cfg.max_length, "heldout_fraction": cfg.heldout_fraction, **feature_settings(heads)}

        def features(ids: torch.Tensor) -> dict[str, torch.Tensor]:
            with accelerator.autocast():  # the uncached path's precision (bf16 on AMX: 1.7x faster)
                return target_features(cfg.family, target, heads, ids)

        return build_feature_cache(features, examples, feature_keys(heads),
                                   Path(cfg.feature_dir or out / "features"), accelerator.device, signature)


def prepare(cfg: TrainConfig, accelerator, heads, train_set, eval_examples: list[dict[str, torch.Tensor]]) -> Prepared:
    """Loaders (a seeded shuffle), AdamW, warmup + cosine schedule, all through ``accelerator.prepare``."""
    from transformers import get_cosine_schedule_with_warmup

    loader = DataLoader(train_set, batch_size=cfg.batch_size, shuffle=True, collate_fn=pad_batch,
                        generator=torch.Generator().manual_seed(cfg.seed))
    eval_loader = DataLoader(TokenDataset(eval_examples), batch_size=cfg.batch_size, collate_fn=pad_batch)
    optimizer = torch.optim.AdamW(heads.parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    # per process: accelerate gives each of N processes 1/N of the batches
    batches_per_epoch = math.ceil(len(train_set) / (cfg.batch_size * accelerator.num_processes))
    steps_per_epoch = math.ceil(batches_per_epoch / cfg.gradient_accumulation_steps)
    total_steps = steps_per_epoch * cfg.epochs
    # the prepared scheduler steps once per process per optimizer step (accelerate's convention)
    scheduler = get_cosine_schedule_with_warmup(optimizer, cfg.warmup_steps * accelerator.num_processes,
                                                total_steps * accelerator.num_processes)
    heads, optimizer, loader, scheduler = accelerator.prepare(heads, optimizer, loader, scheduler)
    return Prepared(heads, optimizer, scheduler, loader, eval_loader, steps_per_epoch, total_steps)


def resume(cfg: TrainConfig, accelerator, out: Path) -> int:
    """The optimizer step to start from: 0, or the latest checkpoint's after restoring its states (``--resume``)."""
    if not cfg.resume:
        return 0
    check_resumable(cfg, out)
    ckpt = latest_checkpoint(out)
    if ckpt is None:
        return 0
    accelerator.load_state(str(ckpt))
    accelerator.print(f"resumed from {ckpt} (step {ckpt.name.split('-')[1]})")
    return int(ckpt.name.split("-")[1])


def append_log(accelerator, log_path: Path, row: dict) -> None:
    """One JSON line in ``log.jsonl`` (main process only)."""
    if accelerator.is_main_process:
        with log_path.open("a") as f:
            f.write(json.dumps(row) + "\n")


def train_step(cfg: TrainConfig, accelerator, run: Prepared, target, batch: dict[str, torch.Tensor]):
    """One micro-batch: loss, backward; at an accumulation boundary, clip. Returns (loss, its parts)."""
    with accelerator.accumulate(run.heads):
        with accelerator.autocast():  # mixed precision covers the whole loss, the frozen LM head included
            loss, parts = head_loss(cfg.family, run.heads, target, with_features(batch, cfg, target, run.heads), cfg)
        accelerator.backward(loss)
        if accelerator.sync_gradients:
            accelerator.clip_grad_norm_(run.heads.parameters(), cfg.max_grad_norm)
        run.optimizer.step()
        run.scheduler.step()
        run.optimizer.zero_grad()
    return loss, parts


def run_epochs(cfg: TrainConfig, accelerator, run: Prepared, target, out: Path, step: int) -> None:
    """The loop, from optimizer step ``step``: log every step, checkpoint every ``save_every``, evaluate per epoch."""
    log_path = out / "log.jsonl"
    stop_at = min(run.total_steps, cfg.max_steps) if cfg.max_steps else run.total_steps
    bar = tqdm(total=stop_at, initial=step, desc=f"train {cfg.family}", disable=not accelerator.is_local_main_process)
    start = time.perf_counter()
    run.heads.train()
    for epoch in range(step // run.steps_per_epoch, cfg.epochs):
        if step >= stop_at:
            break
        run.loader.set_epoch(epoch)
        done_in_epoch = (step - epoch * run.steps_per_epoch) * cfg.gradient_accumulation_steps
        batches = accelerator.skip_first_batches(run.loader, done_in_epoch) if done_in_epoch else run.loader
        for batch in batches:
            loss, parts = train_step(cfg, accelerator, run, target, batch)
            if not accelerator.sync_gradients:
                continue
            step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.4f}")
            append_log(accelerator, log_path, {"step": step, "epoch": epoch, "loss": loss.item(), **parts,
                                               "lr": run.scheduler.get_last_lr()[0],
                                               "elapsed_s": time.perf_counter() - start})
            if step % cfg.save_every == 0 or step == stop_at:
                save_checkpoint(accelerator, out, step)
            if step >= stop_at:
                break
        if step % run.steps_per_epoch == 0 or step >= run.total_steps:  # a whole epoch is done
            acc = evaluate(cfg, accelerator.unwrap_model(run.heads), target, run.eval_loader, accelerator.device)
            accelerator.print(f"epoch {epoch}: held-out top-1 by depth {[round(a, 3) for a in acc]}")
            append_log(accelerator, log_path, {"step": step, "epoch": epoch, "heldout_top1_by_depth": acc})
    bar.close()


def write_heads(cfg: TrainConfig, accelerator, heads, target, tokenizer, out: Path, examples: int) -> Path:
    """``OUT/heads``: the trained heads in the selfspec format, with a model card and the run's settings."""
    accelerator.wait_for_everyone()
    final = out / "heads"
    if accelerator.is_main_process:
        heads = accelerator.unwrap_model(heads)
        save_heads(heads, target, final, tokenizer=tokenizer, base_name=cfg.base_model)
        (final / "README.md").write_text(model_card(cfg, out / "log.jsonl", examples, heads))
        (final / "train_config.json").write_text(json.dumps(config_dict(cfg), indent=2))
    return final


def train(cfg: TrainConfig, target: torch.nn.Module | None = None, tokenizer=None) -> Path:
    """Run (or resume) one training run; returns the folder of the trained heads checkpoint.

    ``target``/``tokenizer`` may be passed already loaded (frozen here); else ``cfg.base_model`` is loaded.
    """
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, set_seed

    out = Path(cfg.output_dir)
    check_data(cfg)  # before the model loads
    accelerator = Accelerator(gradient_accumulation_steps=cfg.gradient_accumulation_steps,
                              mixed_precision=cfg.mixed_precision,
                              dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    set_seed(cfg.seed)
    target, tokenizer = frozen_target(cfg, accelerator.device, target, tokenizer)
    heads = starting_heads(cfg, target, tokenizer)
    train_ex = load_examples(cfg, tokenizer, "train", cfg.max_examples)
    if not train_ex:
        raise SelfspecError(f"--data {cfg.data}: no training conversation left after tokenizing (max_length "
                            f"{cfg.max_length}, {cfg.max_examples} examples at most)")
    eval_ex = load_examples(cfg, tokenizer, "heldout", cfg.eval_examples)
    if not cfg.init_from or cfg.recount_draft_vocab:  # a continued run keeps its draft vocabulary unless told
        prepare_heads(cfg.family, heads, target, train_ex)
    run = prepare(cfg, accelerator, heads, training_set(cfg, accelerator, target, heads, train_ex, out), eval_ex)
    step = resume(cfg, accelerator, out)
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        (out / "train_config.json").write_text(json.dumps(config_dict(cfg), indent=2))
    run_epochs(cfg, accelerator, run, target, out, step)
    return write_heads(cfg, accelerator, run.heads, target, tokenizer, out, len(train_ex))
