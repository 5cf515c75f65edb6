"""The training loop, flat and visible: frozen target, trained heads, accelerate for devices and resume.

    load target (frozen) -> init heads -> tokenize data -> (cache target features) -> for each step:
    loss -> backward -> clip -> optimizer + warmup/cosine schedule -> log, checkpoint every N steps
    -> per-epoch held-out top-1 accuracy per depth -> augmented checkpoint (selfspec heads format)

Distribution is accelerate's own (DDP from `accelerate config`; FSDP or DeepSpeed through its
config files). Resuming restores model, optimizer, scheduler and RNG states with
``accelerator.load_state`` and skips the batches already seen in the epoch (seedable sampler), so
a resumed run ends with the same weights as an uninterrupted one.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from ..checkpoint import load_heads, save_heads
from ..data import load_chat_dataset, read_records
from ..errors import SelfspecError
from ..heads import init_heads
from ..zoo import load_model
from .config import TrainConfig, config_dict
from .features import FeatureCache, TokenDataset, build_feature_cache, pad_batch, tokenize_all
from .losses import depth_accuracy, feature_keys, head_loss, inner, target_features


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


def with_features(batch: dict[str, torch.Tensor], cfg: TrainConfig, target, heads) -> dict[str, torch.Tensor]:
    """Add the target's states to a batch unless they came from the feature cache."""
    if all(k in batch for k in feature_keys(cfg.family)):
        return batch
    return {**batch, **target_features(cfg.family, target, heads, batch["input_ids"], batch["attention_mask"])}


def set_draft_vocab(heads, examples: list[dict[str, torch.Tensor]], vocab: int) -> None:
    """EAGLE with a reduced draft vocabulary: keep the most frequent assistant tokens of the training data."""
    if heads.config.family != "eagle" or heads.d2t.numel() >= vocab:
        return
    counts = torch.zeros(vocab)
    for ex in examples:
        counts.index_add_(0, ex["input_ids"][ex["loss_mask"].bool()], torch.ones(int(ex["loss_mask"].sum())))
    heads.set_draft_vocab(counts)


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


def model_card(cfg: TrainConfig, log_path: Path, examples: int, heads) -> str:
    """A short README for the heads folder: base, data, steps, time, held-out top-1 per depth."""
    rows = read_records(log_path) if log_path.is_file() else []
    steps = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "heldout_top1_by_depth" in r]
    top1 = ", ".join(f"{a:.3f}" for a in evals[-1]["heldout_top1_by_depth"]) if evals else "not evaluated"
    params = sum(p.numel() for p in heads.parameters())
    hours = steps[-1]["elapsed_s"] / 3600 if steps else 0.0
    return "\n".join([
        f"# {cfg.family} heads for {cfg.base_model}", "",
        f"- family: {cfg.family} ({params / 1e6:.2f}M trained parameters), head settings: {cfg.head_args or 'defaults'}",
        f"- base model: {cfg.base_model}, frozen",
        f"- data: {cfg.data}; {examples} training conversations (max {cfg.max_length} tokens), loss on assistant tokens",
        f"- training: {len(steps)} optimizer steps, {cfg.epochs} epochs, batch {cfg.batch_size} x "
        f"{cfg.gradient_accumulation_steps} accumulation, lr {cfg.learning_rate} (warmup {cfg.warmup_steps}, cosine), "
        f"{hours:.2f} h of logged training time (last run segment)",
        f"- held-out top-1 accuracy by draft depth (teacher-forced tokens): {top1}",
        f"- final loss: {steps[-1]['loss']:.4f}" if steps else "- final loss: -",
        "", "Reproduce: `python training/train_heads.py --config train_config.json` (the run's settings are in "
        "train_config.json beside this card).", ""])


def train(cfg: TrainConfig, target: torch.nn.Module | None = None, tokenizer=None) -> Path:
    """Run (or resume) one training run; returns the folder of the trained heads checkpoint.

    ``target``/``tokenizer`` may be passed already loaded (frozen here); else ``cfg.base_model`` is loaded.
    """
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, set_seed
    from transformers import get_cosine_schedule_with_warmup

    out = Path(cfg.output_dir)
    accelerator = Accelerator(gradient_accumulation_steps=cfg.gradient_accumulation_steps,
                              mixed_precision=cfg.mixed_precision,
                              dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    set_seed(cfg.seed)
    if target is None:
        target, tokenizer = load_model(cfg.base_model, device=accelerator.device)
    target.eval().requires_grad_(False)  # frozen: no gradients, no optimizer state
    heads = init_heads(cfg.family, target, **cfg.head_args).float()
    if cfg.init_from:
        start, _ = load_heads(target, cfg.init_from, tokenizer=tokenizer)
        if start.config.family != cfg.family:
            raise SelfspecError(f"--init-from {cfg.init_from} holds {start.config.family} heads, not {cfg.family}")
        try:
            heads.load_state_dict(start.float().state_dict(), strict=True)
        except RuntimeError as exc:
            raise SelfspecError(f"--init-from {cfg.init_from} does not fit --head-arg {cfg.head_args}: "
                                f"{str(exc).splitlines()[-1].strip()}") from exc
    train_ex = load_examples(cfg, tokenizer, "train", cfg.max_examples)
    eval_ex = load_examples(cfg, tokenizer, "heldout", cfg.eval_examples)
    if not cfg.init_from or cfg.recount_draft_vocab:  # a continued run keeps its draft vocabulary unless told
        set_draft_vocab(heads, train_ex, target.get_output_embeddings().out_features)
    keys = feature_keys(cfg.family)
    if cfg.cache_features:
        with accelerator.main_process_first():
            # what the states depend on (not the family: medusa and eagle read the same ones)
            signature = {"base": cfg.base_model, "data": cfg.data, "max_examples": cfg.max_examples,
                         "max_length": cfg.max_length, "heldout_fraction": cfg.heldout_fraction,
                         "exit_layer": inner(heads).config.exit_layer if cfg.family == "early-exit" else None}

            def features(ids: torch.Tensor) -> dict[str, torch.Tensor]:
                with accelerator.autocast():  # the uncached path's precision (bf16 on AMX: 1.7x faster)
                    return target_features(cfg.family, target, heads, ids)

            train_set = build_feature_cache(features, train_ex, keys, Path(cfg.feature_dir or out / "features"),
                                            accelerator.device, signature)
    else:
        train_set = TokenDataset(train_ex)
    loader = DataLoader(train_set, batch_size=cfg.batch_size, shuffle=True, collate_fn=pad_batch,
                        generator=torch.Generator().manual_seed(cfg.seed))
    eval_loader = DataLoader(TokenDataset(eval_ex), batch_size=cfg.batch_size, collate_fn=pad_batch)
    optimizer = torch.optim.AdamW(heads.parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    # per process: accelerate gives each of N processes 1/N of the batches
    batches_per_epoch = math.ceil(len(train_set) / (cfg.batch_size * accelerator.num_processes))
    steps_per_epoch = math.ceil(batches_per_epoch / cfg.gradient_accumulation_steps)
    total_steps = steps_per_epoch * cfg.epochs
    # the prepared scheduler steps once per process per optimizer step (accelerate's convention)
    scheduler = get_cosine_schedule_with_warmup(optimizer, cfg.warmup_steps * accelerator.num_processes,
                                                total_steps * accelerator.num_processes)
    heads, optimizer, loader, scheduler = accelerator.prepare(heads, optimizer, loader, scheduler)

    step = 0
    ckpt = latest_checkpoint(out) if cfg.resume else None
    if cfg.resume:
        check_resumable(cfg, out)
    if ckpt is not None:
        accelerator.load_state(str(ckpt))
        step = int(ckpt.name.split("-")[1])
        accelerator.print(f"resumed from {ckpt} (step {step})")
    log_path = out / "log.jsonl"
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        (out / "train_config.json").write_text(json.dumps(config_dict(cfg), indent=2))
    stop_at = min(total_steps, cfg.max_steps) if cfg.max_steps else total_steps
    bar = tqdm(total=stop_at, initial=step, desc=f"train {cfg.family}", disable=not accelerator.is_local_main_process)
    start = time.perf_counter()
    heads.train()
    for epoch in range(step // steps_per_epoch, cfg.epochs):
        if step >= stop_at:
            break
        loader.set_epoch(epoch)
        done_in_epoch = (step - epoch * steps_per_epoch) * cfg.gradient_accumulation_steps
        batches = accelerator.skip_first_batches(loader, done_in_epoch) if done_in_epoch else loader
        for batch in batches:
            with accelerator.accumulate(heads):
                with accelerator.autocast():  # mixed precision covers the whole loss, the frozen LM head included
                    loss, parts = head_loss(cfg.family, heads, target, with_features(batch, cfg, target, heads), cfg)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(heads.parameters(), cfg.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if not accelerator.sync_gradients:
                continue
            step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.4f}")
            if accelerator.is_main_process:
                with log_path.open("a") as f:
                    f.write(json.dumps({"step": step, "epoch": epoch, "loss": loss.item(), **parts,
                                        "lr": scheduler.get_last_lr()[0],
                                        "elapsed_s": time.perf_counter() - start}) + "\n")
            if step % cfg.save_every == 0 or step == stop_at:
                save_checkpoint(accelerator, out, step)
            if step >= stop_at:
                break
        if step % steps_per_epoch == 0 or step >= total_steps:  # a whole epoch is done
            acc = evaluate(cfg, accelerator.unwrap_model(heads), target, eval_loader, accelerator.device)
            accelerator.print(f"epoch {epoch}: held-out top-1 by depth {[round(a, 3) for a in acc]}")
            if accelerator.is_main_process:
                with log_path.open("a") as f:
                    f.write(json.dumps({"step": step, "epoch": epoch, "heldout_top1_by_depth": acc}) + "\n")
    bar.close()
    accelerator.wait_for_everyone()
    final = out / "heads"
    if accelerator.is_main_process:
        save_heads(accelerator.unwrap_model(heads), target, final, tokenizer=tokenizer, base_name=cfg.base_model)
        (final / "README.md").write_text(model_card(cfg, log_path, len(train_ex), accelerator.unwrap_model(heads)))
        (final / "train_config.json").write_text(json.dumps(config_dict(cfg), indent=2))
    return final
