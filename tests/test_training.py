"""Training heads on a tiny in-process model: the loss falls, the base stays bit-identical, a resumed
run ends with the uninterrupted run's weights, and the produced checkpoint drafts losslessly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from conftest import hf_greedy, load_script, make_tokenizer, perturb, tiny_model
from selfspec.checkpoint import load_heads
from selfspec.engine import DecodeConfig, SpeculativeEngine
from selfspec.errors import SelfspecError
from selfspec.train.config import TrainConfig, parse_config
from selfspec.train.loop import train

VOCAB = 272  # the byte-level test tokenizer has 259 tokens


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "chats.jsonl"
    rows = []
    for i in range(40):
        reply = " ".join(["abc def ghi"] * (3 + i % 4))
        rows.append({"id": f"c{i}", "messages": [{"role": "user", "content": f"say it {i % 7}"},
                                                 {"role": "assistant", "content": reply}]})
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def _cfg(family: str, data: Path, out: Path, **kw) -> TrainConfig:
    head_args = {"num_heads": 2} if family == "medusa" else {"exit_layer": 1} if family == "early-exit" else {}
    base = dict(base_model="tiny", family=family, head_args=head_args, data=str(data), max_examples=24,
                max_length=96, heldout_fraction=0.1, output_dir=str(out), epochs=2, batch_size=4,
                learning_rate=1e-2, warmup_steps=1, save_every=3, eval_examples=8, seed=0)
    base.update(kw)
    return TrainConfig(**base)


def _losses(out: Path) -> list[float]:
    rows = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


@pytest.mark.parametrize("family", ["eagle3", "eagle", "medusa", "early-exit"])
def test_training_lowers_loss_and_freezes_the_base(family: str, chat_file: Path, tmp_path: Path) -> None:
    model, tok = tiny_model(0, vocab=VOCAB, layers=2), make_tokenizer()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    folder = train(_cfg(family, chat_file, tmp_path, epochs=4), model, tok)
    losses = _losses(tmp_path)
    assert sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # bit-identical
    assert not any(p.requires_grad for p in model.parameters())
    log = (tmp_path / "log.jsonl").read_text()
    assert "heldout_top1_by_depth" in log
    heads, drafter = load_heads(model, folder, tokenizer=tok)
    prompt = tok.encode("say it 3 abc def")
    got = SpeculativeEngine(model, drafter).generate(prompt, DecodeConfig(max_new_tokens=24, adaptive=False))
    assert got.tokens == hf_greedy(model, prompt, 24)


def test_bf16_mixed_precision_runs_the_whole_loss_in_bf16(chat_file: Path, tmp_path: Path, monkeypatch) -> None:
    """``--mixed-precision bf16`` puts the frozen LM head (most of an EAGLE step's cost) and the target's pass
    that fills the feature cache in bf16 too; the loss still falls."""
    from accelerate.state import AcceleratorState

    import selfspec.objectives.eagle as eagle
    import selfspec.train.loop as loop

    seen, lm, features, autocast_in_features = [], eagle.lm_logits, loop.target_features, []

    def spy(*args, **kwargs):
        logits = lm(*args, **kwargs)
        seen.append(logits.dtype)
        return logits

    def features_spy(*args, **kwargs):
        autocast_in_features.append(torch.is_autocast_enabled("cpu"))
        return features(*args, **kwargs)

    monkeypatch.setattr(eagle, "lm_logits", spy)
    monkeypatch.setattr(loop, "target_features", features_spy)
    AcceleratorState._reset_state(True)  # a process trains with one precision; this test switches it
    try:
        train(_cfg("eagle", chat_file, tmp_path, mixed_precision="bf16", epochs=4), tiny_model(0, vocab=VOCAB),
              make_tokenizer())
    finally:
        AcceleratorState._reset_state(True)
    assert torch.bfloat16 in seen
    assert True in autocast_in_features  # the feature cache was filled under autocast
    losses_ = _losses(tmp_path)
    assert sum(losses_[-3:]) / 3 < 0.8 * sum(losses_[:3]) / 3


@pytest.mark.parametrize("family", ["eagle", "eagle3"])
def test_resume_reproduces_the_uninterrupted_run(family: str, chat_file: Path, tmp_path: Path) -> None:
    tok = make_tokenizer()
    full = train(_cfg(family, chat_file, tmp_path / "full"), tiny_model(0, vocab=VOCAB), tok)
    train(_cfg(family, chat_file, tmp_path / "cut", max_steps=4), tiny_model(0, vocab=VOCAB), tok)  # "killed" at 4
    resumed = train(_cfg(family, chat_file, tmp_path / "cut", resume=True), tiny_model(0, vocab=VOCAB), tok)
    a, b = load_file(str(full / "heads.safetensors")), load_file(str(resumed / "heads.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert _losses(tmp_path / "full")[4:] == _losses(tmp_path / "cut")[4:]


@pytest.mark.parametrize("adapter", ["layer", "lora"])
def test_an_exit_adapter_trains_and_resumes_exactly(chat_file: Path, tmp_path: Path, adapter: str) -> None:
    """Kangaroo-style early exit and LoRA on the first layer: the loss falls with the base frozen, a resumed run
    ends where the uninterrupted one does, and the checkpoint drafts losslessly."""
    tok, args = make_tokenizer(), {"exit_layer": 1, "adapter": adapter}
    if adapter == "lora":
        args["draft_vocab_size"] = 100  # chosen from the data's assistant tokens before the first step
    model = tiny_model(0, vocab=VOCAB, layers=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    full = train(_cfg("early-exit", chat_file, tmp_path / "full", head_args=args, epochs=4), model, tok)
    losses = _losses(tmp_path / "full")
    assert sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    train(_cfg("early-exit", chat_file, tmp_path / "cut", head_args=args, epochs=4, max_steps=4),
          tiny_model(0, vocab=VOCAB, layers=2), tok)
    resumed = train(_cfg("early-exit", chat_file, tmp_path / "cut", head_args=args, epochs=4, resume=True),
                    tiny_model(0, vocab=VOCAB, layers=2), tok)
    a, b = load_file(str(full / "heads.safetensors")), load_file(str(resumed / "heads.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(k.startswith("decoder.layers.0." if adapter == "layer" else "lora.0.q_proj.lora_B") for k in a)
    assert (full / "peft" / "adapter_config.json").is_file() == (adapter == "lora")
    if adapter == "lora":
        assert a["draft_ids"].tolist() != list(range(100))  # the byte tokenizer's frequent ids are not 0..99
    _, drafter = load_heads(model, full, tokenizer=tok)
    prompt = tok.encode("say it 3 abc def")
    got = SpeculativeEngine(model, drafter).generate(prompt, DecodeConfig(max_new_tokens=24, adaptive=False))
    assert got.tokens == hf_greedy(model, prompt, 24)


@pytest.mark.parametrize("family", ["eagle", "eagle3"])
def test_init_from_continues_from_a_heads_folder(family: str, chat_file: Path, tmp_path: Path) -> None:
    """A continued run starts at the given heads (lr 0 leaves them exactly there) and keeps their draft vocabulary;
    in bf16 too (the loaded heads' drafter packs their linears)."""
    tok = make_tokenizer()
    first = train(_cfg(family, chat_file, tmp_path / "a", head_args={"draft_vocab_size": 200}),
                  tiny_model(0, vocab=VOCAB), tok)
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)  # a process trains with one precision; this continued run uses bf16
    try:
        again = train(_cfg(family, chat_file, tmp_path / "b", head_args={"draft_vocab_size": 200},
                           init_from=str(first), learning_rate=0.0, epochs=1, mixed_precision="bf16"),
                      tiny_model(0, vocab=VOCAB).to(torch.bfloat16), tok)
    finally:
        AcceleratorState._reset_state(True)
    a, b = load_file(str(first / "heads.safetensors")), load_file(str(again / "heads.safetensors"))
    bf16 = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in a.items()}  # loaded onto a bf16 base
    assert a.keys() == b.keys() and all(torch.equal(bf16[k], b[k].to(bf16[k].dtype)) for k in a)
    with pytest.raises(SelfspecError, match="does not fit"):
        train(_cfg(family, chat_file, tmp_path / "c", init_from=str(first)), tiny_model(0, vocab=VOCAB), tok)


def test_a_continued_run_keeps_or_recounts_its_draft_vocabulary(chat_file: Path, tmp_path: Path) -> None:
    """--init-from keeps the heads' draft vocabulary; --recount-draft-vocab chooses it again from the run's data."""
    tok, args = make_tokenizer(), {"draft_vocab_size": 8}
    first = train(_cfg("eagle", chat_file, tmp_path / "a", head_args=args, epochs=1), tiny_model(0, vocab=VOCAB), tok)
    weights = first / "heads.safetensors"
    with safe_open(str(weights), framework="pt") as f:
        tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    counted = tensors["d2t"].clone()
    tensors["d2t"] = torch.arange(8)  # as if the first run had drafted over other tokens
    save_file(tensors, str(weights), metadata=meta)
    assert not torch.equal(counted, tensors["d2t"])
    runs = {}
    for name, recount in (("kept", False), ("recounted", True)):
        folder = train(_cfg("eagle", chat_file, tmp_path / name, head_args=args, init_from=str(first),
                            recount_draft_vocab=recount, learning_rate=0.0, epochs=1), tiny_model(0, vocab=VOCAB), tok)
        runs[name] = load_file(str(folder / "heads.safetensors"))["d2t"]
    assert torch.equal(runs["kept"], torch.arange(8))
    assert torch.equal(runs["recounted"], counted)


def test_flags_map_onto_the_config(tmp_path: Path) -> None:
    cfg_file = tmp_path / "run.json"
    cfg_file.write_text(json.dumps({"family": "medusa", "epochs": 5, "head_args": {"num_heads": 3}}))
    cfg = parse_config(["--config", str(cfg_file), "--epochs", "2", "--head-arg", "num_layers=2", "--no-cache-features"])
    assert (cfg.family, cfg.epochs, cfg.cache_features) == ("medusa", 2, False)
    assert cfg.head_args == {"num_heads": 3, "num_layers": 2}


ROOT = Path(__file__).parents[1]


@pytest.mark.parametrize("path", sorted([*(ROOT / "training" / "configs").glob("*.json"),
                                         *(ROOT / "checkpoints").rglob("train_config.json")]),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_committed_training_configs_parse(path: Path) -> None:
    """Every recipe under training/configs, and every committed checkpoint's record of its run (its card's
    "Reproduce" line runs it), names only real TrainConfig fields and its family's own hyperparameters."""
    from selfspec.heads.config import make_config

    cfg = parse_config(["--config", str(path)])
    assert make_config(cfg.family, **cfg.head_args).family == cfg.family


def test_eagle_unroll_sees_what_drafting_sees():
    """Unrolled step k, row t equals drafting k steps from root t+1 with the head's own cache (real pairs 0..t)."""
    from selfspec.heads import init_heads
    from selfspec.objectives.eagle import eagle_step, eagle_unroll

    target = tiny_model(3, vocab=VOCAB)
    head = init_heads("eagle", target).eval()
    torch.manual_seed(0)
    x = torch.randint(0, VOCAB, (2, 12))
    f = torch.randn(2, 12, target.config.hidden_size)
    with torch.no_grad():
        steps = eagle_unroll(head, target, f, x, 3)
        for b in range(2):
            for t in (0, 4, 8):
                cache = head.new_cache()
                feat = eagle_step(head, target, f[b:b + 1, :t + 1], x[b:b + 1, 1:t + 2], 0, None, cache)[:, -1:]
                for k in range(1, 4):
                    torch.testing.assert_close(feat[0, 0], steps[k - 1][b, t], atol=1e-5, rtol=1e-5)
                    if k < 3:
                        feat = eagle_step(head, target, feat, x[b:b + 1, t + k + 1:t + k + 2], t + k, None, cache)


def test_feature_cache_resumes_grows_and_rebuilds(tmp_path: Path, monkeypatch) -> None:
    """Shards already on disk are reused when they hold the right examples; new examples cost only new shards;
    another model gets a cache of its own beside the first, which stays whole (runs may share the folder)."""
    from selfspec.train import features

    monkeypatch.setattr(features, "SHARD", 4)
    calls = []

    def fn(ids):
        calls.append(ids.shape[1])
        return {"f": ids[..., None].float().expand(-1, -1, 3) + 0.5}

    examples = [{"input_ids": torch.arange(1, 3 + i % 5) * (i + 1), "loss_mask": torch.ones(2 + i % 5, dtype=torch.long)}
                for i in range(14)]
    sig = {"base": "tiny", "data": "x", "max_examples": 10}
    cache = features.build_feature_cache(fn, examples[:10], ("f",), tmp_path, signature=sig)
    assert len(calls) == 10 and len(cache) == 10 and cache.folder.parent == tmp_path
    assert torch.equal(cache[7]["f"], fn(examples[7]["input_ids"][None])["f"][0].to(torch.bfloat16).float())
    calls.clear()
    assert len(features.build_feature_cache(fn, examples[:10], ("f",), tmp_path, signature=sig)) == 10
    assert calls == []  # complete: nothing runs again
    (cache.folder / "index.json").unlink()
    (cache.folder / "shard-00001.safetensors").unlink()  # as if killed while writing shard 1
    features.build_feature_cache(fn, examples[:10], ("f",), tmp_path, signature=sig)
    assert len(calls) == 4  # only shard 1 again
    calls.clear()
    grown = features.build_feature_cache(fn, examples, ("f",), tmp_path, signature={**sig, "max_examples": 14})
    assert len(calls) == 6 and len(grown) == 14  # the old partial shard 2 (8, 9) is redone with 10, 11; then 12, 13
    assert grown.folder == cache.folder and all(torch.equal(grown[i]["input_ids"], examples[i]["input_ids"])
                                                for i in range(14))
    calls.clear()
    more = [*examples, {"input_ids": torch.tensor([5, 6, 7]), "loss_mask": torch.ones(3, dtype=torch.long)}]
    features.build_feature_cache(fn, more, ("f",), tmp_path, signature={**sig, "data": "x,y", "max_examples": 15})
    assert len(calls) == 3  # a source appended to the data list: only the last shard (12, 13, new) is redone
    calls.clear()
    smaller = features.build_feature_cache(fn, examples, ("f",), tmp_path, signature={**sig, "max_examples": 14})
    assert len(smaller) == 14 and calls == []  # the larger run's last shard (12, 13, new) holds 12, 13: kept
    larger = features.build_feature_cache(fn, more, ("f",), tmp_path, signature={**sig, "data": "x,y"})
    assert calls == [] and torch.equal(larger[14]["input_ids"], more[14]["input_ids"])  # the larger run reads it
    other = features.build_feature_cache(fn, examples, ("f",), tmp_path, signature={**sig, "base": "other"})
    assert len(calls) == 14 and other.folder != cache.folder  # another model: a cache of its own
    assert len(list(cache.folder.glob("shard-*.safetensors"))) == 4  # the first one untouched


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_target_features_are_the_full_models_last_hidden_states(arch: str) -> None:
    """The cache runs the decoder without the LM head; its states must be the full model's ``hidden_states[-1]``."""
    from selfspec.heads import init_heads
    from selfspec.train.objectives import target_features

    model = tiny_model(0, vocab=VOCAB, arch=arch)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0  # right padding, as pad_batch makes it
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1]
    got = target_features(model, init_heads("eagle", model), ids, mask)["f"]
    assert torch.equal(got, want)


def test_generate_data_head_fix_keeps_batched_output() -> None:
    """The self-distillation script's contiguous-input hook on the LM head changes no generated token."""
    gen = load_script("training/generate_data.py")
    model, tok = tiny_model(0, vocab=VOCAB), make_tokenizer()
    prompts = [tok.encode("say it 1"), tok.encode("a longer prompt here")]
    seen = []
    spy = model.get_output_embeddings().register_forward_pre_hook(lambda _, args: seen.append(args[0].is_contiguous()))
    before = gen.generate_batch(model, tok, prompts, 12, 0.0)
    assert False in seen  # generate passes the head a non-contiguous slice (the case the fix is for)
    spy.remove()
    gen.contiguous_head_input(model)
    seen.clear()
    model.get_output_embeddings().register_forward_pre_hook(lambda _, args: seen.append(args[0].is_contiguous()))
    after = gen.generate_batch(model, tok, prompts, 12, 0.0)
    assert all(seen) and after == before and len(after) == 2


def test_generate_data_through_the_batch_engine_gives_each_prompts_greedy_reply() -> None:
    """Self-distillation replies from selfspec's batch engine (more prompts than rows, of different lengths) are each
    prompt's greedy reply decoded alone."""
    import argparse

    gen = load_script("training/generate_data.py")
    model, tok = tiny_model(0, vocab=VOCAB), make_tokenizer()
    texts = ["say it 1", "a longer prompt here", "x", "one two one two one two", "abc"]
    todo = [({"id": str(i)}, None, tok.encode(t)) for i, t in enumerate(texts)]
    args = argparse.Namespace(batch_size=2, max_new_tokens=12, temperature=0.0, seed=0, heads=None)
    got = {item[0]["id"]: reply for item, reply in gen.selfspec_replies(model, tok, todo, args)}
    alone = {str(i): tok.decode(SpeculativeEngine(model, None).generate(ids, DecodeConfig(max_new_tokens=12)).tokens,
                                skip_special_tokens=True).strip() for i, (_, _, ids) in enumerate(todo)}
    assert got == alone


@pytest.mark.parametrize("drafter", ["lookup", "eagle"])
def test_generate_data_replies_are_transformers_greedy_in_fp32(drafter: str, tmp_path) -> None:
    """Self-distillation through the batch engine, drafted by prompt lookup or by heads, more prompts than rows:
    every reply is transformers' own greedy reply (fp32)."""
    import argparse

    from selfspec.checkpoint import save_heads
    from selfspec.heads import init_heads

    gen = load_script("training/generate_data.py")
    model, tok = tiny_model(0, vocab=VOCAB), make_tokenizer()
    heads = None
    if drafter == "eagle":
        save_heads(perturb(init_heads("eagle", model), 0), model, tmp_path / "heads", base_name="tiny")
        heads = str(tmp_path / "heads")
    texts = ["say it 1", "a longer prompt here", "x", "one two one two one two", "abc"]
    todo = [({"id": str(i)}, None, tok.encode(t)) for i, t in enumerate(texts)]
    args = argparse.Namespace(batch_size=2, max_new_tokens=12, temperature=0.0, seed=0, heads=heads)
    got = {item[0]["id"]: reply for item, reply in gen.selfspec_replies(model, tok, todo, args)}
    want = {str(i): tok.decode(hf_greedy(model, ids, 12), skip_special_tokens=True).strip()
            for i, (_, _, ids) in enumerate(todo)}
    assert got == want


def test_generate_data_resumes_past_a_torn_line_without_duplicates(tmp_path) -> None:
    gen = load_script("training/generate_data.py")
    out = tmp_path / "sd.jsonl"
    rows = [json.dumps({"id": f"c{i}", "messages": [{"role": "user", "content": "q"},
                                                   {"role": "assistant", "content": "a"}]}) for i in range(3)]
    out.write_text(rows[0] + "\n" + rows[1] + "\n" + rows[2][:25])  # killed while writing the third
    gen.repair_tail(out)
    assert gen.done_ids(out) == {"c0", "c1"} and out.read_text() == rows[0] + "\n" + rows[1] + "\n"
    with out.open("a") as f:  # the resumed run writes the third again, on a line of its own
        f.write(rows[2] + "\n")
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert ids == ["c0", "c1", "c2"]
    gen.repair_tail(out)  # a whole file is left alone
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ids


def test_generate_data_interrupted_leaves_whole_lines(tmp_path) -> None:
    """Ctrl-C mid-run: the replies that arrived are whole lines, and the run says so instead of a traceback."""
    gen = load_script("training/generate_data.py")
    out = tmp_path / "sd.jsonl"

    def replies():
        for i in range(2):
            yield ({"id": f"c{i}", "category": "chat"}, [{"role": "user", "content": "q"}], None), f"a{i}"
        raise KeyboardInterrupt

    assert gen.write_replies(out, replies(), 5) == (2, True)
    assert gen.done_ids(out) == {"c0", "c1"} and out.read_text().endswith("\n")
    assert gen.write_replies(out, iter([]), 0) == (0, False)


def test_generate_data_workers_split_the_prompts_whatever_the_others_wrote() -> None:
    """--workers N: worker k owns examples k, k + N, ... by position, so a worker that reads the file after another
    has appended still takes exactly its own share: the shares are disjoint and cover every pending prompt."""
    import argparse

    gen = load_script("training/generate_data.py")
    tok = make_tokenizer()
    ds = [{"id": f"c{i}", "category": "chat", "messages": [{"role": "user", "content": f"question {i}"}]}
          for i in range(11)]
    ids = lambda todo: {ex["id"] for ex, _, _ in todo}  # noqa: E731
    first = gen.pending(ds, {"c0"}, tok, 512, (0, 2))
    second = gen.pending(ds, {"c0"} | ids(first), tok, 512, (1, 2))  # started after worker 0 wrote its share
    assert ids(first) == {f"c{i}" for i in (2, 4, 6, 8, 10)} and ids(second) == {f"c{i}" for i in (1, 3, 5, 7, 9)}
    assert ids(gen.pending(ds, set(), tok, 512)) == {f"c{i}" for i in range(11)}
    assert gen.shard("1/3") == (1, 3)
    for bad in ("3/3", "x", "1/0", "-1/2"):
        with pytest.raises(argparse.ArgumentTypeError):
            gen.shard(bad)


@pytest.mark.integration
def test_generate_data_workers_write_each_reply_once(tmp_path) -> None:
    """Two worker processes on the real small model share the prompts and the file: every line whole, no id twice,
    and only the data's first examples."""
    import subprocess
    import sys

    from selfspec.data import load_chat_dataset

    out = tmp_path / "sd.jsonl"
    script = Path(__file__).resolve().parent.parent / "training" / "generate_data.py"
    cmd = [sys.executable, str(script), "--model", "smollm2-135m-instruct", "--data", "sharegpt",
           "--max-examples", "4", "--max-new-tokens", "6", "--dtype", "float32", "--workers", "2", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert 2 <= len(ids) == len(set(ids)) <= 4
    assert set(ids) <= {ex["id"] for ex in load_chat_dataset("sharegpt", split="train", limit=4)}


def test_data_ratio_mixes_sources_by_share(tmp_path) -> None:
    """Recorded traffic mixed with the original data by a ratio (``--data-ratio``): each source gives its share of the
    examples; a source short of its share leaves the rest to the next; a bad ratio is refused when the config is
    made."""
    from selfspec.errors import SelfspecError
    from selfspec.train.loop import load_examples

    tok = make_tokenizer()
    for name, n in (("traffic", 30), ("original", 30), ("short", 2)):
        rows = [{"id": f"{name}{i}", "messages": [{"role": "user", "content": f"{name} {i}"},
                                                   {"role": "assistant", "content": "ok"}]} for i in range(n)]
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    source = lambda *names: ",".join(str(tmp_path / f"{n}.jsonl") for n in names)  # noqa: E731

    def firsts(cfg, limit):
        texts = [tok.decode(ex["input_ids"].tolist()) for ex in load_examples(cfg, tok, "all", limit)]
        return [next(n for n in ("traffic", "original", "short") if n in t) for t in texts]

    cfg = _cfg("medusa", source("traffic", "original"), tmp_path / "out", data_ratio="0.3,0.7")
    got = firsts(cfg, 10)
    assert got.count("traffic") == 3 and got.count("original") == 7
    assert firsts(_cfg("medusa", source("traffic", "original"), tmp_path / "o"), 10).count("traffic") == 10  # in order
    got = firsts(_cfg("medusa", source("short", "original"), tmp_path / "o", data_ratio="1,1"), 10)
    assert got.count("short") == 2 and got.count("original") == 8
    for bad in ("0.5", "a,b", "0,0", "-1,2"):
        with pytest.raises(SelfspecError, match="--data-ratio"):
            _cfg("medusa", source("traffic", "original"), tmp_path / "o", data_ratio=bad)


def test_data_with_nothing_to_train_on_is_refused_before_any_model_loads(tmp_path) -> None:
    """Prompts without replies (HumanEval's kind) are one line, before the model (here: none that exists) loads."""
    from selfspec.errors import SelfspecError
    from selfspec.train.loop import train

    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": f"q {i}"}]})
                              for i in range(8)) + "\n")
    cfg = _cfg("medusa", data, tmp_path / "out", base_model=str(tmp_path / "no-such-model"))
    with pytest.raises(SelfspecError, match="no conversation with an assistant reply"):
        train(cfg)
    assert not (tmp_path / "out").exists()


def test_data_cut_away_by_max_length_is_refused_before_the_weights_load(tmp_path) -> None:
    """Replies that --max-length cuts off entirely leave nothing to train on: one line, after the tokenizer (all the
    folder holds: loading weights would fail) and before any model loads."""
    from selfspec.errors import SelfspecError
    from selfspec.train.loop import train

    folder = tmp_path / "tokenizer-only"
    make_tokenizer().save_pretrained(folder)
    data = tmp_path / "long-questions.jsonl"
    data.write_text("\n".join(json.dumps({"id": f"p{i}", "messages": [
        {"role": "user", "content": "a long question " * 20}, {"role": "assistant", "content": "a reply"}]})
        for i in range(8)) + "\n")
    cfg = _cfg("medusa", data, tmp_path / "out", base_model=str(folder), max_length=16)
    with pytest.raises(SelfspecError, match="no training conversation left after tokenizing") as refused:
        train(cfg)
    assert "\n" not in str(refused.value)


def test_a_frozen_eagle3_lm_head_keeps_the_targets_rows(chat_file: Path, tmp_path: Path) -> None:
    """``--head-arg train_lm_head=false``: the LM head starts as the target's rows for the draft vocabulary and stays
    them bit for bit through training (no gradient, no weight decay), while the rest of the head trains."""
    from selfspec.frozen import lm_head_rows
    from selfspec.heads import init_heads

    model, tok = tiny_model(0, vocab=VOCAB, layers=2), make_tokenizer()
    start = init_heads("eagle3", model, draft_vocab_size=100)
    folder = train(_cfg("eagle3", chat_file, tmp_path, head_args={"draft_vocab_size": 100, "train_lm_head": False},
                        weight_decay=0.1), model, tok)
    heads, _ = load_heads(model, folder, tokenizer=tok)
    saved = {k: v for k, v in load_file(str(folder / "heads.safetensors")).items()}
    lm, fc = (next(v for k, v in saved.items() if k.endswith(name)) for name in ("lm_head.weight", "fc.weight"))
    assert heads.config.train_lm_head is False
    assert torch.equal(lm, lm_head_rows(model, heads.draft_ids())[0].to(lm))
    assert not torch.equal(fc, start.fc.weight.to(fc))  # the rest trained


def test_an_unroll_curriculum_scores_more_steps_as_training_goes_on(chat_file: Path, tmp_path: Path) -> None:
    """The loop hands the loss its settings at each optimizer step: the log's parts show one unrolled step for the
    first ``curriculum_steps`` steps, then two."""
    model, tok = tiny_model(0, vocab=VOCAB, layers=2), make_tokenizer()
    train(_cfg("eagle3", chat_file, tmp_path, head_args={"draft_vocab_size": 100},
               loss_args={"unroll": 2, "curriculum_steps": 3}, max_steps=5), model, tok)
    rows = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r and "step" in r]
    assert [("kl2" in r) for r in steps] == [False, False, False, True, True]
    assert all("kl1" in r for r in steps)


def test_warm_start_copies_every_tensor_that_fits_and_reports_the_rest() -> None:
    """eagle -> eagle3: the one decoder layer's MLP, output projection and norms and the final norm are copied under
    their eagle3 names; the attention's inputs (twice as wide) and fc (three layers) are another shape; eagle3's
    hidden norm and LM head are not in an eagle checkpoint. Vocabulary rows are copied only with the vocabulary."""
    from selfspec.heads import init_heads
    from selfspec.train.warm_start import copy_fitting, draft_vocabulary, part_name, same_vocabulary_size

    model = tiny_model(0, vocab=VOCAB, layers=3)
    eagle = init_heads("eagle", model, draft_vocab_size=100)
    with torch.no_grad():
        for p in eagle.parameters():
            p.add_(torch.randn_like(p))
    eagle3 = init_heads("eagle3", model, draft_vocab_size=100)
    assert same_vocabulary_size(eagle3, eagle) and draft_vocabulary(eagle).numel() == 100
    report = copy_fitting(eagle3, eagle, vocabulary=True, name="eagle")
    theirs = {part_name(k): v for k, v in eagle.state_dict().items()}
    mine = eagle3.state_dict()
    assert sorted(report.loaded) == sorted(
        [f"midlayer.{n}.weight" for n in ("self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                                          "input_layernorm", "post_attention_layernorm")] + ["norm.weight"])
    assert all(torch.equal(mine[k], theirs[part_name(k)]) for k in report.loaded)
    assert sorted(report.reshaped) == ["fc.weight", "midlayer.self_attn.k_proj.weight",
                                       "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.v_proj.weight"]
    assert sorted(report.missing) == ["lm_head.weight", "midlayer.hidden_norm.weight"]
    assert report.parameters == sum(mine[k].numel() for k in report.loaded)
    source3 = init_heads("eagle3", model, draft_vocab_size=100)
    assert "lm_head.weight" in copy_fitting(eagle3, source3, vocabulary=True, name="e3").loaded
    assert "lm_head.weight" in copy_fitting(eagle3, source3, vocabulary=False, name="e3").reshaped  # other rows


def test_a_warm_started_run_takes_the_sources_vocabulary_and_records_what_it_copied(chat_file: Path,
                                                                                  tmp_path: Path) -> None:
    from selfspec.train.warm_start import draft_vocabulary

    model, tok = tiny_model(0, vocab=VOCAB, layers=2), make_tokenizer()
    eagle_folder = train(_cfg("eagle", chat_file, tmp_path / "eagle", head_args={"draft_vocab_size": 60},
                              max_steps=2), model, tok)
    eagle, _ = load_heads(model, eagle_folder, tokenizer=tok)
    with pytest.raises(SelfspecError, match="give one"):
        _cfg("eagle3", chat_file, tmp_path / "x", warm_start=str(eagle_folder), init_from=str(eagle_folder))
    folder = train(_cfg("eagle3", chat_file, tmp_path / "eagle3", head_args={"draft_vocab_size": 60},
                        warm_start=str(eagle_folder), max_steps=1), model, tok)
    heads, _ = load_heads(model, folder, tokenizer=tok)
    assert torch.equal(draft_vocabulary(heads).sort().values, draft_vocabulary(eagle).sort().values)
    report = json.loads((tmp_path / "eagle3" / "train_config.json").read_text())["warm_start_report"]
    assert report["vocabulary"] and "midlayer.mlp.down_proj.weight" in report["loaded"]
    assert "lm_head.weight" in report["missing"]


def test_eagle1_layout_trains_from_normed_eagle_heads_and_exports_for_vllm(chat_file: Path, tmp_path: Path) -> None:
    """--head-arg norms=false warm-started from eagle heads with their norms: fc and the layer's attention, MLP and
    post-attention norm are copied, the norms have nowhere to go; the trained heads reload and export."""
    from selfspec.export import export_for_serving

    model, tok = tiny_model(0, vocab=VOCAB, layers=2), make_tokenizer()
    model.save_pretrained(tmp_path / "base")
    normed = train(_cfg("eagle", chat_file, tmp_path / "normed", head_args={"draft_vocab_size": 60}, max_steps=2),
                   model, tok)
    folder = train(_cfg("eagle", chat_file, tmp_path / "eagle1", head_args={"draft_vocab_size": 60, "norms": False},
                        warm_start=str(normed), max_steps=2), model, tok)
    report = json.loads((tmp_path / "eagle1" / "train_config.json").read_text())["warm_start_report"]
    assert sorted(report["loaded"]) == sorted(
        ["fc.weight"] + [f"decoder.layers.0.{n}.weight" for n in (
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
            "mlp.up_proj", "mlp.down_proj", "post_attention_layernorm")])
    assert report["reshaped"] == report["missing"] == []
    heads, _ = load_heads(model, folder, tokenizer=tok)
    assert heads.config.norms is False and not hasattr(heads.feature_norm, "weight")
    out = export_for_serving(folder, tmp_path / "vllm", "vllm", base=str(tmp_path / "base"))
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_folded_norms_compute_what_the_normed_heads_compute_where_every_rms_is_its_constant(arch: str) -> None:
    """The fold's algebra: the normed heads with each norm's per-token RMS replaced by its calibrated constant (the
    post-attention norm over s * r, as the folded layer sees it) compute what the folded EAGLE-1-layout heads do."""
    from selfspec.heads import init_heads
    from selfspec.train.fold_norms import calibrate, fold_norms

    model = tiny_model(0, vocab=VOCAB, layers=2, arch=arch)
    heads = perturb(init_heads("eagle", model, draft_vocab_size=60), 1, 0.3).float()
    with torch.no_grad():
        for norm in (heads.feature_norm, heads.embed_norm, heads.decoder.norm):
            norm.weight.uniform_(0.5, 2.0)  # per-channel scales the fold has to carry
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    f = model.get_decoder()(input_ids=ids).last_hidden_state.detach()
    scales = calibrate(heads, model, [{"input_ids": ids, "loss_mask": torch.ones_like(ids), "f": f}])
    folded = fold_norms(heads, model, scales)
    assert not folded.config.norms and torch.equal(folded.d2t, heads.d2t)
    pairs = (f[:, :-1], model.get_input_embeddings()(ids[:, 1:]).detach(), torch.arange(11)[None].expand(2, -1))
    with torch.no_grad():
        normed, want = heads(*pairs), folded(*pairs)
        assert (normed - want).abs().max() > 1e-3  # the negative control: per-token RMS is not constant here
        inv, layer = scales.inv, heads.decoder.layers[0]
        s = heads.decoder.norm.weight * inv["y"]
        eps = layer.post_attention_layernorm.variance_epsilon
        heads.feature_norm.forward = lambda u: u * heads.feature_norm.weight * inv["f"]
        heads.embed_norm.forward = lambda u: u * heads.embed_norm.weight * inv["e"]
        layer.input_layernorm.forward = lambda u: u * layer.input_layernorm.weight * inv["x"]
        layer.post_attention_layernorm.forward = lambda u: (u * layer.post_attention_layernorm.weight * scales.kappa
                                                            * torch.rsqrt((s * u).pow(2).mean(-1, keepdim=True) + eps))
        heads.decoder.norm.forward = lambda u: u * s
        torch.testing.assert_close(heads(*pairs), want, rtol=1e-4, atol=1e-4)


def test_a_warm_start_folder_that_holds_no_heads_is_one_line_before_the_model_loads(chat_file: Path,
                                                                                    tmp_path: Path) -> None:
    with pytest.raises(SelfspecError) as refused:
        train(_cfg("eagle3", chat_file, tmp_path / "out", base_model="no-such-model", warm_start=str(tmp_path)))
    assert str(tmp_path) in str(refused.value) and "\n" not in str(refused.value)
