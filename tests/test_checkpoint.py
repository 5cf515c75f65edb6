"""The augmented checkpoint: exact files, trained tensors only, strict loading, clear errors, info."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

from conftest import hf_greedy, tiny_model
from selfspec.checkpoint import (CONFIG_FILE, INDEX_FILE, WEIGHTS_FILE, check_heads_folder, export_heads, heads_info,
                                 load_augmented, load_heads, read_tensors, save_heads, save_merged)
from selfspec.engine import DecodeConfig, SpeculativeEngine
from selfspec.errors import SelfspecError
from selfspec.heads import init_heads

HYPER = {"medusa": {"num_layers": 2}, "eagle": {"draft_vocab_size": 40}, "early-exit": {"exit_layer": 1},
         "eagle3": {"draft_vocab_size": 40}}
COMMITTED = Path(__file__).resolve().parents[1] / "checkpoints"


pytestmark = pytest.mark.usefixtures("one_thread")


def trained(family: str, model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Heads with non-initial weights (as if trained)."""
    heads = init_heads(family, model, **HYPER[family])
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return heads


def word_tokenizer(vocab: int = 64, odd_one: int | None = None) -> PreTrainedTokenizerFast:
    """A tiny in-process tokenizer; ``odd_one`` renames one token (same size, different vocabulary)."""
    words = {f"w{i}" if i != odd_one else "other": i for i in range(vocab)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(words, unk_token="w0")))


def distinct_storage(module: torch.nn.Module) -> bool:
    ptrs = [p.data_ptr() for p in module.parameters()]
    return len(ptrs) == len(set(ptrs))


@pytest.mark.parametrize("family", list(HYPER))
def test_round_trip(family: str, tmp_path: Path) -> None:
    model = tiny_model(0, layers=3)
    heads = trained(family, model)
    save_heads(heads, model, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [WEIGHTS_FILE, CONFIG_FILE]
    stored = load_file(str(tmp_path / WEIGHTS_FILE))
    assert set(stored) == set(heads.state_dict())  # trained weights only, never the base
    n_stored = sum(t.numel() for t in stored.values() if t.is_floating_point())
    assert n_stored == sum(p.numel() for p in heads.parameters())
    loaded, drafter = load_heads(model, tmp_path)
    for key, value in heads.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    assert distinct_storage(heads) and distinct_storage(loaded)
    copied = drafter.lm_weight.numel() if getattr(drafter, "reduced", False) else 0  # EAGLE's gathered LM-head rows
    assert drafter.extra_parameters() == sum(p.numel() for p in heads.parameters()) + copied
    prompt = [3, 9, 4, 3, 9, 4, 3, 9]
    got = SpeculativeEngine(model, drafter).generate(prompt, DecodeConfig(max_new_tokens=20, adaptive=False))
    assert got.tokens == hf_greedy(model, prompt, 20)


def test_medusa_blocks_are_not_shared() -> None:
    heads = init_heads("medusa", tiny_model(0), num_heads=3, num_layers=2)
    blocks = [block for head in heads.heads for block in head]
    assert len(blocks) == 6 and len({id(b) for b in blocks}) == 6  # not [Block()] * n
    assert distinct_storage(heads)


@pytest.mark.parametrize(("saved", "base", "needles"), [
    (dict(hidden=32), dict(hidden=48), ["hidden 32", "hidden 48", "hidden_size"]),
    (dict(vocab=64), dict(vocab=80), ["vocab 64", "vocab 80", "vocab_size"]),
    (dict(layers=3), dict(layers=2), ["3 layers", "2 layers"]),
    (dict(arch="llama"), dict(arch="qwen2"), ["LlamaForCausalLM", "Qwen2ForCausalLM"]),
])
def test_mismatched_base_is_one_clear_error(saved: dict, base: dict, needles: list[str], tmp_path: Path) -> None:
    save_heads(init_heads("medusa", tiny_model(0, **saved)), tiny_model(0, **saved), tmp_path, base_name="tiny-a")
    with pytest.raises(SelfspecError) as err:
        load_heads(tiny_model(1, **base), tmp_path)
    message = str(err.value)
    assert "tiny-a" in message and all(n in message for n in needles), message


def test_tokenizer_fingerprint(tmp_path: Path) -> None:
    model = tiny_model(0)
    save_heads(init_heads("medusa", model), model, tmp_path, tokenizer=word_tokenizer())
    load_heads(model, tmp_path, tokenizer=word_tokenizer())  # same vocabulary: fine
    load_heads(model, tmp_path)  # no tokenizer given: only the embedding fingerprint is compared
    with pytest.raises(SelfspecError, match="tokenizer vocabulary"):
        load_heads(model, tmp_path, tokenizer=word_tokenizer(odd_one=5))


def _edit_json(folder: Path, **changes) -> None:
    meta = json.loads((folder / CONFIG_FILE).read_text())
    for key, value in changes.items():
        if key == "config":
            meta["config"].update(value)
        else:
            meta[key] = value
    (folder / CONFIG_FILE).write_text(json.dumps(meta))


def test_unknown_config_keys_warn_and_load(tmp_path: Path) -> None:
    model = tiny_model(0)
    save_heads(init_heads("eagle", model), model, tmp_path)
    _edit_json(tmp_path, config={"future_option": 3}, trained_on="chat-v2")
    with pytest.warns(UserWarning, match="unknown"):
        heads, _ = load_heads(model, tmp_path)
    assert heads.config.top_k == 4


def test_newer_format_is_a_clear_error(tmp_path: Path) -> None:
    model = tiny_model(0)
    save_heads(init_heads("medusa", model), model, tmp_path)
    _edit_json(tmp_path, format_version=99)
    with pytest.raises(SelfspecError, match="format 99.*upgrade"):
        load_heads(model, tmp_path)


@pytest.mark.parametrize(("edit", "needle"), [
    (lambda t: t.pop("heads.0.0.linear.bias"), "missing"),
    (lambda t: t.update({"lm_head.weight": torch.zeros(64, 32)}), "unexpected"),
    (lambda t: t.update({"heads.1.0.linear.weight": torch.zeros(32, 31)}), "wrong shapes"),
])
def test_bad_tensors_are_errors(edit, needle: str, tmp_path: Path) -> None:
    model = tiny_model(0)
    save_heads(init_heads("medusa", model), model, tmp_path)
    tensors = load_file(str(tmp_path / WEIGHTS_FILE))
    edit(tensors)
    save_file(tensors, str(tmp_path / WEIGHTS_FILE))
    with pytest.raises(SelfspecError, match=needle):
        load_heads(model, tmp_path)


@pytest.mark.parametrize("keep", [0.0, 0.5, 0.99])
def test_cut_short_weights_are_one_clear_error(keep: float, tmp_path: Path) -> None:
    """A weight file cut short (header or data) is a SelfspecError from every reader, not safetensors' own."""
    model = tiny_model(0)
    save_heads(trained("eagle", model), model, tmp_path)
    path = tmp_path / WEIGHTS_FILE
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep)])
    for read in (lambda: load_heads(model, tmp_path), lambda: heads_info(tmp_path), lambda: read_tensors(tmp_path),
                 lambda: check_heads_folder(tmp_path)):
        with pytest.raises(SelfspecError, match=f"{WEIGHTS_FILE} is not a complete safetensors file"):
            read()


def test_not_a_heads_folder(tmp_path: Path) -> None:
    with pytest.raises(SelfspecError, match="not a selfspec heads folder"):
        load_heads(tiny_model(0), tmp_path)


def test_bad_hyperparameters() -> None:
    model = tiny_model(0, layers=2)
    with pytest.raises(SelfspecError, match="unknown head family"):
        init_heads("hydra", model)
    with pytest.raises(SelfspecError, match="unknown medusa hyperparameters"):
        init_heads("medusa", model, heads=3)
    with pytest.raises(SelfspecError, match="exit_layer"):
        init_heads("early-exit", model, exit_layer=3)


def test_merged_folder_loads_in_one_call(tmp_path: Path) -> None:
    model, tokenizer = tiny_model(3, layers=3), word_tokenizer()
    heads = trained("eagle", model)
    save_merged(heads, model, tmp_path, tokenizer, base_name="tiny-llama")
    loaded, tok, drafter = load_augmented(tmp_path)
    for (k, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), k
    assert tok.get_vocab() == tokenizer.get_vocab()
    prompt = [5, 1, 8, 5, 1, 8]
    got = SpeculativeEngine(loaded, drafter).generate(prompt, DecodeConfig(max_new_tokens=16, adaptive=False))
    assert got.tokens == hf_greedy(model, prompt, 16)
    _, drafter = load_heads(str(tmp_path), tmp_path)  # a base given by folder name loads through the zoo loader
    assert drafter.target.config.hidden_size == 32


def test_heads_info(tmp_path: Path) -> None:
    model = tiny_model(0, layers=3).to(torch.bfloat16)
    heads = init_heads("early-exit", model, exit_layer=2)
    save_heads(heads, model, tmp_path / "heads")
    save_merged(heads, model, tmp_path / "merged")
    base_params = sum(p.numel() for p in model.parameters())
    for folder in ("heads", "merged"):  # from the JSON, and from the merged config on the meta device
        info = heads_info(tmp_path / folder)
        assert info["family"] == "early-exit" and info["heads_dtype"] == "bfloat16"
        assert info["heads_parameters"] == 32 * 32 and info["heads_bytes"] == 2 * 32 * 32
        assert info["base_parameters"] == base_params
        assert info["heads_to_base_ratio"] == pytest.approx(1024 / base_params, rel=1e-3)


def test_sharded_weights_round_trip_and_draft_losslessly(tmp_path: Path) -> None:
    model = tiny_model(1, layers=3)
    heads = trained("eagle", model)
    total = sum(t.numel() * t.element_size() for t in heads.state_dict().values())
    save_heads(heads, model, tmp_path, max_shard_size=total // 3)
    shards = sorted(p.name for p in tmp_path.glob("heads-*.safetensors"))
    assert len(shards) >= 3 and not (tmp_path / WEIGHTS_FILE).exists() and (tmp_path / INDEX_FILE).is_file()
    assert all((tmp_path / s).stat().st_size < total for s in shards)
    loaded, drafter = load_heads(model, tmp_path)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in heads.state_dict().items())
    assert heads_info(tmp_path)["heads_parameters"] == sum(p.numel() for p in heads.parameters())
    prompt = [5, 2, 7, 5, 2, 7, 5]
    got = SpeculativeEngine(model, drafter).generate(prompt, DecodeConfig(max_new_tokens=16, adaptive=False))
    assert got.tokens == hf_greedy(model, prompt, 16)
    save_heads(heads, model, tmp_path)  # back to one file: the shards and index go
    assert sorted(p.name for p in tmp_path.iterdir()) == [WEIGHTS_FILE, CONFIG_FILE]


def test_broken_shards_are_clear_errors(tmp_path: Path) -> None:
    model = tiny_model(0)
    heads = trained("medusa", model)
    save_heads(heads, model, tmp_path, max_shard_size=1)
    shards = sorted(tmp_path.glob("heads-*.safetensors"))
    save_file({}, str(tmp_path / WEIGHTS_FILE))
    with pytest.raises(SelfspecError, match="both"):
        load_heads(model, tmp_path)
    (tmp_path / WEIGHTS_FILE).unlink()
    shards[-1].unlink()
    with pytest.raises(SelfspecError, match="names shards that are not in"):
        load_heads(model, tmp_path)
    (tmp_path / INDEX_FILE).unlink()
    with pytest.raises(SelfspecError, match="incomplete heads checkpoint"):
        load_heads(model, tmp_path)


def test_export_casts_and_shards_without_the_base(tmp_path: Path) -> None:
    model = tiny_model(2, layers=3)
    heads = trained("eagle", model)
    save_heads(heads, model, tmp_path / "run")
    (tmp_path / "run" / "README.md").write_text("card")
    export_heads(tmp_path / "run", tmp_path / "out", dtype=torch.bfloat16, max_shard_size=4096)
    assert (tmp_path / "out" / "README.md").read_text() == "card" and (tmp_path / "out" / INDEX_FILE).is_file()
    info = heads_info(tmp_path / "out")
    assert info["heads_dtype"] == "bfloat16" and info["heads_bytes"] < heads_info(tmp_path / "run")["heads_bytes"]
    loaded, _ = load_heads(model, tmp_path / "out")  # cast back to the base's dtype
    for key, value in heads.state_dict().items():
        want = value.to(torch.bfloat16).to(value.dtype) if value.is_floating_point() else value
        assert torch.equal(loaded.state_dict()[key], want), key


@pytest.fixture(scope="module")
def smollm2():
    from selfspec.zoo import load_model

    return load_model("smollm2-135m-instruct", dtype="float32")


@pytest.mark.integration
@pytest.mark.parametrize("folder", [*sorted(COMMITTED.glob("smollm2-135m-instruct-*")),
                                    *sorted((COMMITTED / "experimental").glob("smollm2-135m-instruct-*"))],
                         ids=lambda p: p.name)
def test_committed_heads_load_and_draft_plain_greedy(folder: Path, smollm2) -> None:
    """Every committed SmolLM2 checkpoint (each older family, the experimental eagle3 one) still loads strictly
    and drafts losslessly."""
    model, tokenizer = smollm2
    heads, drafter = load_heads(model, folder, tokenizer=tokenizer)
    assert heads.config.family == json.loads((folder / CONFIG_FILE).read_text())["family"]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Name three colours."}],
                                           add_generation_prompt=True, tokenize=True, return_dict=False)
    cfg = DecodeConfig(max_new_tokens=16)
    got = SpeculativeEngine(model, drafter, tokenizer).generate(prompt, cfg)
    assert got.tokens == SpeculativeEngine(model, None, tokenizer).generate(prompt, cfg).tokens
