"""Recorded traffic (``selfspec serve --record DIR``), on a tiny in-process server: finished requests become chat
data that training reads; ``"store": false``, failed and cancelled requests are not kept; files rotate by size; a
torn last line (a server killed mid-write) does not stop training from reading the rest."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import Live
from selfspec.data import load_chat_dataset
from selfspec.serve.record import Recorder

pytest.importorskip("uvicorn")
pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = "tiny"


def lines(folder) -> list[dict]:
    return [json.loads(line) for path in sorted(folder.glob("*.jsonl")) for line in path.read_text().splitlines()]


def chat(server: Live, text: str, **extra) -> tuple[int, str]:
    return server.call("/v1/chat/completions", {"model": MODEL, "max_tokens": 12, "temperature": 0,
                                                "messages": [{"role": "user", "content": text}], **extra})


def test_finished_requests_are_recorded_as_chat_data_training_reads(tmp_path, monkeypatch) -> None:
    folder = tmp_path / "traffic"
    server = Live(MODEL, smooth=False, recorder=Recorder(folder), request_timeout=30)
    try:
        status, raw = chat(server, "Hello there")
        assert status == 200
        answer = json.loads(raw)["choices"][0]["message"]["content"]
        status, raw = chat(server, "Streamed one", stream=True)
        assert status == 200
        streamed = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                           for line in raw.splitlines() if line.startswith("data: {") and json.loads(line[6:])["choices"])
        assert chat(server, "Do not keep this", store=False)[0] == 200
        assert server.complete("A raw prompt")[0] == 200
        assert chat(server, "x", max_tokens=0)[0] == 422  # never decoded: nothing to record
        monkeypatch.setattr(server.engine, "step", lambda: (_ for _ in ()).throw(RuntimeError("a fault")))
        assert chat(server, "This one fails")[0] == 500
    finally:
        server.close()
    got = lines(folder)
    assert [r["endpoint"] for r in got] == ["chat", "chat", "completions"]
    first, second, raw_prompt = got
    assert first["messages"] == [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": answer}]
    assert second["messages"][-1] == {"role": "assistant", "content": streamed}
    assert first["id"].startswith("chatcmpl-") and first["finish_reason"] in ("stop", "length")
    assert first["usage"]["completion_tokens"] > 0 and first["sampling"]["temperature"] == 0.0
    assert raw_prompt["prompt"] == "A raw prompt" and "messages" not in raw_prompt
    assert "Do not keep this" not in json.dumps(got) and "This one fails" not in json.dumps(got)
    data = load_chat_dataset(str(folder), split="all")  # what `train_heads.py --data DIR` loads
    assert [m["content"] for m in data[0]["messages"]][-1] == answer and len(data) == 2


def test_recordings_rotate_and_a_torn_last_line_is_dropped(tmp_path) -> None:
    rec = Recorder(tmp_path, max_bytes=300)
    for i in range(6):
        rec.append({"id": f"r{i}", "messages": [{"role": "user", "content": f"question {i} " + "x" * 100},
                                                {"role": "assistant", "content": f"answer {i}"}]})
    rec.close()
    files = sorted(tmp_path.glob("traffic-*.jsonl"))
    assert len(files) >= 3 and all(f.stat().st_size <= 300 + 200 for f in files)
    assert oct(files[0].stat().st_mode & 0o777) == "0o600"  # users' words: the owner's only
    with open(files[-1], "a") as fh:
        fh.write('{"id": "r6", "messages": [{"role": "user", "con')  # killed mid-write
    data = load_chat_dataset(str(tmp_path), split="all")
    assert sorted(data["id"]) == [f"r{i}" for i in range(6)]


def test_a_killed_recorder_leaves_files_training_reads(tmp_path) -> None:
    """A process appending as fast as it can, SIGKILLed mid-stream: every complete line still reads."""
    script = textwrap.dedent(f"""
        from selfspec.serve.record import Recorder
        rec = Recorder({str(tmp_path)!r}, max_bytes=4096)
        i = 0
        while True:
            rec.append({{"id": f"r{{i}}", "messages": [{{"role": "user", "content": "q" * 500}},
                                                      {{"role": "assistant", "content": f"a{{i}}"}}]}})
            i += 1
    """)
    proc = subprocess.Popen([sys.executable, "-c", script])
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("*.jsonl"))) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    data = load_chat_dataset(str(tmp_path), split="all")
    assert len(data) >= 10 and len(set(data["id"])) == len(data)
