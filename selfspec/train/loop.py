"""The training loop, flat and visible: frozen target, trained heads, accelerate for processes and devices.

    frozen_target -> starting_heads -> load_examples -> training_set (target features cached once, by every process)
    -> prepare (heads and AdamW through accelerate, warmup + cosine schedule) -> resume
    -> run_epochs: per optimizer step, this process's micro-batches (``batches.py``) -> train_step (losses summed,
       divided once by the loss tokens of the whole step on every process -> backward -> clip -> optimizer step);
       a log line per step, a checkpoint every N steps, held-out top-1 per depth per epoch (over every process)
    -> write_heads (selfspec heads format, model card; the main process only)

One process or several (``accelerate launch``, ``torchrun``): only the heads are wrapped for data parallelism
(DDP, or FSDP2 sharding their gradients and optimizer state; the frozen target sits on every process outside
it), the processes split each step's examples without overlap, and N processes of batch b train exactly what
one process of batch N x b does. Resuming restores the heads, optimizer, schedule and RNG states
(``accelerator.load_state``) and starts at the next step of the same order, so a resumed run ends with the
weights of an uninterrupted one; it must use the same number of processes.
"""

from __future__ import annotations

import copy
import json
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from itertools import islice
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..checkpoint import check_heads_folder, load_heads, save_heads
from ..data import load_chat_dataset
from ..data.load import iter_examples
from ..errors import SelfspecError
from ..heads import init_heads
from ..zoo import load_model
from .batches import epoch_order, rank_micro_batches, step_examples, steps_per_epoch
from .card import model_card
from ..objectives.common import settings_at
from .config import MOVED, TrainConfig, config_dict
from .features import TokenDataset, build_feature_cache, pad_batch, tokenize_all
from .objectives import depth_accuracy, feature_keys, feature_settings, head_loss, prepare_heads, target_features
from .warm_start import WarmStart, copy_fitting, draft_vocabulary, same_vocabulary_size, vocabulary_example


def load_examples(cfg: TrainConfig, tokenizer, split: str, limit: int) -> list[dict[str, torch.Tensor]]:
    """Tokenised conversations of one split (assistant-token loss masks).

    ``cfg.data`` may list several sources separated by commas (e.g. a self-distillation file, then
    ``sharegpt``): they fill ``limit`` in order, or by ``cfg.data_ratio``'s shares (a source short of its share
    leaves the rest to the ones after it), and an id already taken from an earlier source is skipped.
    """
    conversations, seen = [], set()
    quotas = cfg.quotas(limit)
    for i, source in enumerate(cfg.sources):
        if len(conversations) >= limit:
            break
        want = limit - len(conversations) if quotas is None else sum(quotas[:i + 1]) - len(conversations)
        if want <= 0:
            continue
        ds = load_chat_dataset(source, split=split, heldout_fraction=cfg.heldout_fraction, limit=want + len(seen))
        taken = 0
        for ex_id, messages in zip(ds["id"], ds["messages"]):
            if ex_id not in seen and taken < want:
                seen.add(ex_id)
                conversations.append(messages)
                taken += 1
    return tokenize_all(tokenizer, conversations, cfg.max_length)


def check_data(cfg: TrainConfig, look: int = 200) -> None:
    """Refuse, before any model loads, data that has nothing to train on: no source of ``cfg.data`` whose first
    ``look`` training conversations hold an assistant reply (HumanEval's prompts, a prompts-only file)."""
    sources = cfg.sources
    for source in sources:
        for ex in islice(iter_examples(source, "train", cfg.heldout_fraction), look):
            if any(m.get("role") == "assistant" and m.get("content") for m in ex["messages"]):
                return
    raise SelfspecError(f"--data {cfg.data}: no conversation with an assistant reply to train on (prompts only); "
                        "write replies first, e.g. python training/generate_data.py --data "
                        f"{sources[0] if sources else 'SOURCE'} --out replies.jsonl, then --data replies.jsonl")


def with_features(batch: dict[str, torch.Tensor], target, heads) -> dict[str, torch.Tensor]:
    """Add the target's states to a batch unless they came from the feature cache (float32, as the cache gives them)."""
    if all(k in batch for k in feature_keys(heads)):
        return batch
    states = target_features(target, heads, batch["input_ids"], batch["attention_mask"])
    return {**batch, **{k: v.float() for k, v in states.items()}}


EVAL_DEPTH = 4


def evaluate(cfg: TrainConfig, accelerator, heads, target, examples: list[dict[str, torch.Tensor]]) -> list[float]:
    """Held-out top-1 accuracy per draft depth (1 .. EVAL_DEPTH): each process scores every N-th example, the
    counts are summed over the processes. Every process runs as many batches (a short share ends on a weightless
    one: under FSDP each forward gathers the weights from all processes)."""
    heads.eval()
    counts = torch.zeros(2, EVAL_DEPTH, dtype=torch.long, device=accelerator.device)
    for batch in micro_batches(cfg, accelerator, examples, list(range(len(examples)))):
        c, t = depth_accuracy(heads, target, with_features(batch, target, heads), EVAL_DEPTH)
        counts += torch.tensor([c, t], device=accelerator.device)
    heads.train()
    correct, total = accelerator.reduce(counts, "sum").tolist()
    return [c / t for c, t in zip(correct, total) if t]


def micro_batches(cfg: TrainConfig, accelerator, dataset, examples: list[int]) -> list[dict[str, torch.Tensor]]:
    """This process's share of ``examples`` (indices into ``dataset``), padded batches on its device, as many as
    every other process has (``batches.rank_micro_batches``); an empty one is a copy of the first example that
    counts for nothing (loss mask 0)."""
    batches = []
    for ids in rank_micro_batches(examples, cfg.batch_size, accelerator.process_index, accelerator.num_processes):
        if ids:
            items = [dataset[i] for i in ids]
        else:
            first = dataset[examples[0]]
            items = [{**first, "loss_mask": torch.zeros_like(first["loss_mask"])}]
        batches.append({k: v.to(accelerator.device) for k, v in pad_batch(items).items()})
    return batches


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


def run_settings(cfg: TrainConfig, accelerator) -> dict:
    """What ``train_config.json`` records: the config, the loss settings in effect, the number of processes (steps
    depend on it) and how they share the heads (NO; MULTI_CPU, MULTI_GPU: DDP; FSDP: the checkpoints' layout)."""
    return {**config_dict(cfg), "loss": asdict(cfg.loss), "num_processes": accelerator.num_processes,
            "distribution": accelerator.distributed_type.value}


def check_resumable(cfg: TrainConfig, accelerator, out: Path) -> None:
    """Resuming is exact only with the settings, the number of processes and the distribution the run started with
    (checked before any model loads)."""
    saved = out / "train_config.json"
    if not cfg.resume or not saved.is_file():
        return
    before, now = json.loads(saved.read_text()), run_settings(cfg, accelerator)
    if before.get("num_processes", 1) != now["num_processes"]:
        raise SelfspecError(f"cannot resume {out}: it ran with {before.get('num_processes', 1)} processes, this launch "
                            f"has {now['num_processes']}; launch as many (e.g. torchrun --nproc_per_node "
                            f"{before.get('num_processes', 1)}) or use a new --output-dir")
    if set(before) & set(MOVED):
        raise SelfspecError(f"cannot resume {out}: an older selfspec started it (its loss settings are named "
                            f"{', '.join(sorted(set(before) & set(MOVED)))}); use a new --output-dir")
    default = run_settings(TrainConfig(family=cfg.family), accelerator)  # fields the run predates: their defaults
    differ = sorted(k for k in now if k not in ("resume", "max_steps", "loss_args")
                    and before.get(k, default[k]) != now[k])
    if differ:
        raise SelfspecError(f"cannot resume {out}: settings changed since it started ({', '.join(differ)}); "
                            "use the original settings or a new --output-dir")


@dataclass
class Prepared:
    """What the loop steps: accelerate's prepared heads and optimizer, the schedule, the data and its steps."""

    heads: torch.nn.Module
    unwrapped: torch.nn.Module  # a plain copy on the CPU, made before accelerate wrapped or sharded them: what is saved
    optimizer: torch.optim.Optimizer
    scheduler: object
    train_set: torch.utils.data.Dataset
    eval_examples: list[dict[str, torch.Tensor]]
    global_batch: int  # examples per optimizer step, over every process
    steps_per_epoch: int
    total_steps: int


def frozen_target(cfg: TrainConfig, accelerator, target=None, tokenizer=None):
    """The target (``cfg.base_model`` unless given) with gradients off: no optimizer state, never trained.
    Every process loads it in the same dtype: ``auto`` is measured by the main process alone."""
    if target is None:
        dtype = cfg.dtype
        if dtype == "auto":
            from accelerate.utils import broadcast_object_list

            from ..dtypes import choose_dtype, dtype_name
            from ..zoo import load_config

            chosen = [None]
            if accelerator.is_main_process:  # the machine's cached verdict, the same one generate and serve read
                choice = choose_dtype("auto", accelerator.device, load_config(cfg.base_model).get_text_config())
                accelerator.print(f"target {cfg.base_model} in {choice}")
                chosen = [dtype_name(choice.dtype)]
            dtype = broadcast_object_list(chosen)[0]
        target, tokenizer = load_model(cfg.base_model, dtype=dtype, device=accelerator.device)
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


def warm_started(cfg: TrainConfig, heads: torch.nn.Module, target, tokenizer,
                 examples: list[dict[str, torch.Tensor]]) -> WarmStart:
    """Prepare fresh ``heads`` (with ``cfg.warm_start``'s draft vocabulary where it has one of the same size, unless
    ``--recount-draft-vocab``) and copy every tensor of those heads that fits (``selfspec/train/warm_start.py``)."""
    source, _ = load_heads(target, cfg.warm_start, tokenizer=tokenizer)
    vocabulary = same_vocabulary_size(heads, source) and not cfg.recount_draft_vocab
    prepare_heads(heads, target, [vocabulary_example(draft_vocabulary(source))] if vocabulary else examples)
    return copy_fitting(heads, source, vocabulary, cfg.warm_start)


def training_set(cfg: TrainConfig, accelerator, target, heads, examples: list[dict[str, torch.Tensor]], out: Path):
    """The training examples with the target's states cached on disk (``cfg.cache_features``), or tokens only.
    Every process computes its share of the cache's shards."""
    if not cfg.cache_features:
        return TokenDataset(examples)
    # what the states depend on (not the family: medusa and eagle read the same ones)
    signature = {"base": cfg.base_model, "data": cfg.data, "max_examples": cfg.max_examples,
                 "max_length": cfg.max_length, "heldout_fraction": cfg.heldout_fraction, **feature_settings(heads)}

    def features(ids: torch.Tensor) -> dict[str, torch.Tensor]:
        with accelerator.autocast():  # the uncached path's precision (bf16 on AMX: 1.7x faster)
            return target_features(target, heads, ids)

    return build_feature_cache(features, examples, feature_keys(heads), Path(cfg.feature_dir or out / "features"),
                               accelerator.device, signature, rank=accelerator.process_index,
                               world=accelerator.num_processes, wait=accelerator.wait_for_everyone)


def prepare(cfg: TrainConfig, accelerator, heads, train_set, eval_examples: list[dict[str, torch.Tensor]]) -> Prepared:
    """AdamW and the heads through ``accelerator.prepare`` (DDP over the heads alone when there are several
    processes), and a warmup + cosine schedule counted in optimizer steps (saved with the checkpoints)."""
    from transformers import get_cosine_schedule_with_warmup

    optimizer = torch.optim.AdamW(heads.parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    global_batch = cfg.batch_size * cfg.gradient_accumulation_steps * accelerator.num_processes
    per_epoch = steps_per_epoch(len(train_set), global_batch)
    total_steps = per_epoch * cfg.epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, cfg.warmup_steps, total_steps)
    unwrapped = copy.deepcopy(heads).cpu()  # what is saved at the end; off the device meanwhile
    heads, optimizer = accelerator.prepare(heads, optimizer)
    accelerator.register_for_checkpointing(scheduler)  # stepped here once per optimizer step, not by accelerate
    return Prepared(heads, unwrapped, optimizer, scheduler, train_set, eval_examples, global_batch, per_epoch,
                    total_steps)


def resume(cfg: TrainConfig, accelerator, out: Path) -> int:
    """The optimizer step to start from: 0, or the latest checkpoint's after restoring its states (``--resume``)."""
    ckpt = latest_checkpoint(out) if cfg.resume else None
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


def step_batches(cfg: TrainConfig, accelerator, run: Prepared, epoch: int, step: int) -> list[dict[str, torch.Tensor]]:
    """This process's micro-batches of optimizer step ``step`` of ``epoch``."""
    examples = step_examples(epoch_order(len(run.train_set), cfg.seed, epoch), step, run.global_batch)
    return micro_batches(cfg, accelerator, run.train_set, examples)


def train_step(cfg: TrainConfig, accelerator, run: Prepared, target, batches: list[dict[str, torch.Tensor]],
               step: int = 0) -> dict[str, float]:
    """One optimizer step over this process's micro-batches: each loss is a sum over its tokens, scaled by the
    number of loss tokens of the whole step (every micro-batch of every process), so each token weighs the same
    wherever it lands; backward (gradients exchanged at the last micro-batch only), clip, step. Returns the step's
    loss and its parts over the loss-mask tokens of the whole step (the same on every process; a family may skip
    some of those positions, eagle3 the undraftable ones, unrolled steps the first ones, but the divisor is this
    count whatever the split). ``step``: the optimizer step's index, for loss settings on a schedule."""
    args = settings_at(cfg.loss, step)
    tokens = accelerator.reduce(sum(b["loss_mask"].sum() for b in batches).to(accelerator.device), "sum")
    scale = accelerator.num_processes / tokens.clamp(min=1)  # DDP averages the processes' gradients: undo it
    sums = None
    for i, batch in enumerate(batches):
        last = i == len(batches) - 1
        with nullcontext() if last else accelerator.no_sync(run.heads):
            with accelerator.autocast():  # mixed precision covers the whole loss, the frozen LM head included
                loss, parts = head_loss(run.heads, target, with_features(batch, target, run.heads), args)
            accelerator.backward(loss * scale)
        values = torch.stack([loss.detach().float(), *(v.float() for v in parts.values())])
        sums = values if sums is None else sums + values
    accelerator.clip_grad_norm_(run.heads.parameters(), cfg.max_grad_norm)
    run.optimizer.step()
    if not accelerator.optimizer_step_was_skipped:  # fp16: a step the loss scaler skipped does not count
        run.scheduler.step()
    run.optimizer.zero_grad()
    means = (accelerator.reduce(sums, "sum") / tokens.clamp(min=1)).tolist()  # the one host sync of a step
    return {"loss": means[0], **dict(zip(parts, means[1:])), "tokens": int(tokens)}


def run_epochs(cfg: TrainConfig, accelerator, run: Prepared, target, out: Path, step: int) -> None:
    """The loop, from optimizer step ``step``: log every step, evaluate at each epoch's end, then checkpoint (every
    ``save_every`` steps and at the last: a resumed run never skips an epoch's held-out row)."""
    log_path = out / "log.jsonl"
    stop_at = min(run.total_steps, cfg.max_steps) if cfg.max_steps else run.total_steps
    bar = tqdm(total=stop_at, initial=step, desc=f"train {cfg.family}", disable=not accelerator.is_main_process)
    start = time.perf_counter()
    run.heads.train()
    while step < stop_at:
        epoch, in_epoch = divmod(step, run.steps_per_epoch)
        row = train_step(cfg, accelerator, run, target, step_batches(cfg, accelerator, run, epoch, in_epoch), step)
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{row['loss']:.4f}")
        append_log(accelerator, log_path, {"step": step, "epoch": epoch, **row, "lr": run.scheduler.get_last_lr()[0],
                                           "elapsed_s": time.perf_counter() - start})
        if step % run.steps_per_epoch == 0 and run.eval_examples:  # a whole epoch is done
            acc = evaluate(cfg, accelerator, accelerator.unwrap_model(run.heads), target, run.eval_examples)
            accelerator.print(f"epoch {epoch}: held-out top-1 by depth {[round(a, 3) for a in acc]}")
            append_log(accelerator, log_path, {"step": step, "epoch": epoch, "heldout_top1_by_depth": acc})
        if step % cfg.save_every == 0 or step == stop_at:
            save_checkpoint(accelerator, out, step)
    bar.close()


def write_heads(cfg: TrainConfig, accelerator, run: Prepared, target, tokenizer, out: Path, examples: int) -> Path:
    """``OUT/heads``: the trained heads in the selfspec format, with a model card and the run's settings. The
    weights are gathered whole (sharded under FSDP) into an unwrapped copy of the heads, saved by the main process."""
    state = accelerator.get_state_dict(run.heads)  # every process takes part; the main one gets it all
    final = out / "heads"
    if accelerator.is_main_process:
        heads = run.unwrapped
        heads.load_state_dict(state)
        save_heads(heads, target, final, tokenizer=tokenizer, base_name=cfg.base_model)
        (final / "README.md").write_text(model_card(cfg, out / "log.jsonl", examples, heads, accelerator.num_processes))
        (final / "train_config.json").write_text(json.dumps(run_settings(cfg, accelerator), indent=2))
    accelerator.wait_for_everyone()
    return final


def check_distribution(accelerator) -> None:
    """One process, DDP, or FSDP2 (``training/accelerate/fsdp.yaml``). FSDP1 and DeepSpeed are refused: their
    full sharding splits the weights again after each forward, and the eagle3 loss calls the head's LM head
    outside its forward."""
    kind = accelerator.distributed_type.value
    if kind == "FSDP" and getattr(accelerator, "is_fsdp2", False):
        return
    if kind in ("FSDP", "DEEPSPEED", "MEGATRON_LM"):
        raise SelfspecError(f"training heads runs in one process, with DDP or with FSDP2, not {kind}"
                            f"{' version 1' if kind == 'FSDP' else ''}: launch with training/accelerate/multi_gpu.yaml "
                            "or fsdp.yaml")


def train(cfg: TrainConfig, target: torch.nn.Module | None = None, tokenizer=None) -> Path:
    """Run (or resume) one training run; returns the folder of the trained heads checkpoint.

    ``target``/``tokenizer`` may be passed already loaded (frozen here); else ``cfg.base_model`` is loaded.
    """
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    out = Path(cfg.output_dir)
    check_data(cfg)  # before the model loads
    if cfg.warm_start:
        check_heads_folder(cfg.warm_start)  # a wrong folder is one line before the model loads
    # gradient accumulation is the loop's own (train_step): every micro-batch of a step is known before its first
    # cpu: torchrun's processes on a machine without an accelerator form a gloo group (else each trains alone)
    accelerator = Accelerator(mixed_precision=cfg.mixed_precision, cpu=not torch.accelerator.is_available())
    check_distribution(accelerator)
    check_resumable(cfg, accelerator, out)  # before the model loads or the feature cache changes
    if tokenizer is None:  # the data is tokenized before the weights load: data with nothing to train on is one line
        from ..zoo import load_tokenizer

        tokenizer = load_tokenizer(cfg.base_model)
    train_ex = load_examples(cfg, tokenizer, "train", cfg.max_examples)
    if not train_ex:
        raise SelfspecError(f"--data {cfg.data}: no training conversation left after tokenizing (max_length "
                            f"{cfg.max_length}, {cfg.max_examples} examples at most)")
    eval_ex = load_examples(cfg, tokenizer, "heldout", cfg.eval_examples)
    target, _ = frozen_target(cfg, accelerator, target, tokenizer)
    set_seed(cfg.seed)  # after loading: the heads start the same however the target was loaded (or passed in)
    heads = starting_heads(cfg, target, tokenizer)
    warm = None
    if cfg.warm_start:
        warm = warm_started(cfg, heads, target, tokenizer, train_ex)
        accelerator.print(warm.summary())
    elif not cfg.init_from or cfg.recount_draft_vocab:  # a continued run keeps its draft vocabulary unless told
        prepare_heads(heads, target, train_ex)
    run = prepare(cfg, accelerator, heads, training_set(cfg, accelerator, target, heads, train_ex, out), eval_ex)
    step = resume(cfg, accelerator, out)
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        settings = run_settings(cfg, accelerator)
        if warm is not None:  # recorded, not compared on resume
            settings["warm_start_report"] = asdict(warm)
        (out / "train_config.json").write_text(json.dumps(settings, indent=2))
    run_epochs(cfg, accelerator, run, target, out, step)
    return write_heads(cfg, accelerator, run, target, tokenizer, out, len(train_ex))
