"""Bad input to the ``selfspec`` command, as a new user would type it: one clear line on stderr, exit status 2,
no traceback, nothing written, and no model loaded where the input could be checked before."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import make_tokenizer, tiny_model
from selfspec.checkpoint import WEIGHTS_FILE, save_heads
from selfspec.engine import DecodeConfig, SpeculativeEngine
from selfspec.errors import SelfspecError
from selfspec.heads import init_heads
from selfspec.options import non_negative_float, positive_int, probability
from selfspec_cli.main import main


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty current folder and cache root, and no model loading: what a command writes or loads shows."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("SELFSPEC_HOME", str(work / "home"))

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was looked up before the bad input was refused")

    monkeypatch.setattr("selfspec.zoo.resolve", no_loading)
    return work


def refused(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    """The one line ``selfspec argv`` printed on stderr, after checking exit status 2 and an empty stdout."""
    try:
        status = main(argv)
    except SystemExit as exc:  # argparse: a bad value while parsing
        status = exc.code
    out, err = capsys.readouterr()
    assert status == 2 and out == ""
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


@pytest.mark.parametrize("command", ["generate --prompt hi", "demo", "bench"])
@pytest.mark.parametrize(("flag", "value", "needle"), [
    ("--max-new-tokens", "-3", "argument --max-new-tokens: expected an integer >= 1, got '-3'"),
    ("--max-new-tokens", "many", "argument --max-new-tokens: expected an integer >= 1, got 'many'"),
    ("--max-nodes", "0", "argument --max-nodes: expected an integer >= 1, got '0'"),
    ("--device", "gpu7", "argument --device: unknown device 'gpu7'"),
])
def test_shared_option_errors_before_any_model(command: str, flag: str, value: str, needle: str, workdir: Path,
                                               capsys) -> None:
    line = refused([*command.split(), flag, value, "--out", "o"] if command == "bench"
                   else [*command.split(), flag, value], capsys)
    assert line.startswith(f"selfspec {command.split()[0]}: error: {needle}")
    assert not any(workdir.iterdir())


@pytest.mark.parametrize(("flag", "value", "needle"), [
    ("--top-p", "2", "argument --top-p: expected a number in (0, 1], got '2'"),
    ("--top-p", "0", "argument --top-p: expected a number in (0, 1], got '0'"),
    ("--temperature", "-1", "argument --temperature: expected a number >= 0, got '-1'"),
    ("--temperature", "nan", "argument --temperature: expected a number >= 0, got 'nan'"),
    ("--top-k", "-5", "argument --top-k: expected an integer >= 0, got '-5'"),
    ("--stop", "", "argument --stop: expected a non-empty string"),
])
def test_sampling_errors_before_any_model(flag: str, value: str, needle: str, workdir: Path, capsys) -> None:
    line = refused(["generate", "--prompt", "hi", flag, value], capsys)
    assert line.startswith(f"selfspec generate: error: {needle}")
    assert not any(workdir.iterdir())


def test_types_accept_good_values() -> None:
    assert positive_int("3") == 3 and probability("1") == 1.0 and probability("0.9") == 0.9
    assert non_negative_float("0") == 0.0
    for parse, bad in ((positive_int, "0"), (positive_int, "1.5"), (probability, "1.01"), (non_negative_float, "inf")):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(bad)


@pytest.fixture
def cut_short(tmp_path: Path) -> Path:
    """A heads folder whose weight file lost its second half (an interrupted copy)."""
    model = tiny_model(0)
    folder = save_heads(init_heads("eagle", model), model, tmp_path / "heads")
    weights = folder / WEIGHTS_FILE
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return folder


@pytest.mark.parametrize("argv", [["generate", "--prompt", "hi", "--heads"], ["demo", "--heads"],
                                  ["bench", "--out", "o", "--heads"], ["info"]])
def test_cut_short_heads_file_is_one_line_before_any_model(argv: list[str], cut_short: Path, workdir: Path,
                                                           capsys) -> None:
    line = refused([*argv, str(cut_short)], capsys)
    assert f"{cut_short / WEIGHTS_FILE} is not a complete safetensors file" in line
    assert not any(workdir.iterdir())


def test_heads_path_default_is_decided_in_one_place(monkeypatch) -> None:
    """--heads-path: $SELFSPEC_HEADS_PATH if set, else ./checkpoints, which from a clone's root holds the
    committed heads (what `make demo` finds); bench and demo read the same default."""
    from selfspec.checkpoint import find_heads
    from selfspec_cli.main import build_parser

    root = Path(__file__).resolve().parent.parent
    monkeypatch.chdir(root)
    monkeypatch.delenv("SELFSPEC_HEADS_PATH", raising=False)
    for command in ("demo", "bench"):
        assert build_parser().parse_args([command]).heads_path == [str(root / "checkpoints")]
    assert [f.name for f in find_heads("smollm2-135m-instruct", [root / "checkpoints"])] == [
        "smollm2-135m-instruct-eagle", "smollm2-135m-instruct-medusa", "smollm2-135m-instruct-early-exit"]
    monkeypatch.setenv("SELFSPEC_HEADS_PATH", f"/a{os.pathsep}b")
    assert build_parser().parse_args(["demo"]).heads_path == ["/a", str(root / "b")]


@pytest.fixture
def tiny_folder(tmp_path: Path) -> Path:
    """A tiny model (1024 positions) and a byte-level tokenizer saved as an ordinary Hugging Face folder."""
    folder = tmp_path / "tiny-model"
    tiny_model(0, vocab=272).save_pretrained(folder)
    make_tokenizer().save_pretrained(folder)
    return folder


def test_prompt_longer_than_the_context_is_refused_before_the_weights_load(tiny_folder: Path, monkeypatch,
                                                                           capsys) -> None:
    def no_weights(*args, **kwargs):
        raise AssertionError("the weights were loaded before the prompt was checked")

    monkeypatch.setattr("selfspec_cli.generate.load_target", no_weights)
    line = refused(["generate", "--model", str(tiny_folder), "--prompt", "word " * 300], capsys)
    assert line == ("selfspec generate: error: the prompt is 1,519 tokens long, but the model reads at most 1,024 "
                    "positions (max_position_embeddings): shorten the prompt")
    line = refused(["generate", "--model", str(tiny_folder), "--prompt", "word " * 190], capsys)
    assert "and up to 128 new tokens would run past the 1,024 positions" in line
    assert "ask for at most 55 new tokens" in line


def test_engine_refuses_a_request_past_the_context() -> None:
    model = tiny_model(0)  # 1024 positions
    engine = SpeculativeEngine(model)
    with pytest.raises(SelfspecError, match="the prompt is 1,030 tokens long, but the model reads at most 1,024"):
        engine.generate([1] * 1030, DecodeConfig(max_new_tokens=4))
    with pytest.raises(SelfspecError, match="ask for at most 4 new tokens"):
        engine.generate([1] * 1020, DecodeConfig(max_new_tokens=5))
    assert len(engine.generate([1] * 1020, DecodeConfig(max_new_tokens=4)).tokens) <= 4  # exactly fits


@pytest.mark.integration
def test_nine_thousand_words_into_smollm2(capsys) -> None:
    """The issue's case: SmolLM2 reads 8,192 positions; 9,000 words are refused without loading its weights."""
    line = refused(["generate", "--model", "smollm2-135m-instruct", "--prompt", "word " * 9000], capsys)
    assert line.startswith("selfspec generate: error: the prompt is 9,0") and "at most 8,192 positions" in line


def test_a_fresh_process_prints_one_line_and_no_traceback(cut_short: Path, tmp_path: Path) -> None:
    """The installed command end to end, in its own interpreter: exit status 2, one line, stdout empty."""
    for argv in (["generate", "--prompt", "hi", "--max-new-tokens", "-3"], ["info", str(cut_short)]):
        proc = subprocess.run([sys.executable, "-m", "selfspec_cli", *argv], capture_output=True, text=True,
                              cwd=tmp_path, timeout=120)
        assert proc.returncode == 2 and proc.stdout == ""
        assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stderr.startswith(f"selfspec {argv[0]}: error: argument ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["heads"]  # nothing written beside the heads made here


def test_generate_prompts_file_answers_each_line_as_generate_does(tiny_folder: Path, tmp_path: Path, capsys) -> None:
    """``--prompts``: one JSON line per prompt, in the file's order, each the text ``--prompt`` gives it alone."""
    import json

    prompts = ["Hello there", "Count: 1 2 3", "abc abc abc", "x"]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join([json.dumps(prompts[0]), json.dumps({"prompt": prompts[1], "id": "b"}),
                               json.dumps({"messages": [{"role": "user", "content": prompts[2]}]}),
                               json.dumps(prompts[3])]) + "\n")
    common = ["--model", str(tiny_folder), "--max-new-tokens", "12", "--dtype", "float32"]
    assert main(["generate", "--prompts", str(path), "--max-batch", "3", *common]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["index"] for line in lines] == [0, 1, 2, 3] and lines[1]["id"] == "b"
    for prompt, line in zip(prompts, lines):
        assert main(["generate", "--prompt", prompt, "--json", *common]) == 0
        assert json.loads(capsys.readouterr().out)["text"] == line["text"]
    path.write_text('{"text": "no prompt here"}\n')
    line = refused(["generate", "--prompts", str(path), *common], capsys)
    assert "record 1 is neither a string nor an object" in line


def test_serve_load_fresh_prompts_are_never_sent_twice():
    from selfspec_eval.serve_load import prompts_needed, split_prompts

    n = prompts_needed(3, 16, "off", fresh=True)
    warm, cells = split_prompts(list(range(n)), 3, fresh=True)
    assert n == 49 and [len(c) for c in cells] == [16, 16, 16]
    sent = [warm, *(p for c in cells for p in c)]
    assert len(set(sent)) == len(sent)  # no prompt in two cells, the warm-up's in none
    assert prompts_needed(3, 16, "both", fresh=True) == 25  # pairs: smoothing on and off see the same prompt
    n = prompts_needed(3, 16, "off", fresh=False)
    warm, cells = split_prompts(list(range(n)), 3, fresh=False)
    assert n == 9 and cells == [list(range(8))] * 3 and warm == 8  # every cell the same 8, each sent twice


@pytest.mark.parametrize("argv", [["--drafter", "suffix"], ["--api-key", "k"]])
def test_suffix_scope_key_without_keys_or_a_suffix_drafter_is_refused_before_any_model(argv, workdir: Path, capsys,
                                                                                    monkeypatch) -> None:
    pytest.importorskip("uvicorn")
    monkeypatch.delenv("SELFSPEC_API_KEY", raising=False)
    line = refused(["serve", "--suffix-scope", "key", *argv], capsys)
    assert line.startswith("selfspec serve: error: --suffix-scope key keeps a suffix index per API key")
