"""The serve path's own defects, on a tiny in-process model (uvicorn in a thread, seconds): stop strings cut out of
the answer as OpenAI does (streamed or not, checked incrementally), a fault while decoding answered 500 with the
server serving on, a dead engine thread turning /health to 503 and failing what waits, and settings that cannot
work refused before a request needs them."""

from __future__ import annotations

import json

import pytest

from conftest import Live, make_tokenizer, tiny_model
from selfspec.engine import DecodeConfig, SpeculativeEngine
from selfspec.errors import SelfspecError
from selfspec.stopping import StopText, StopTokens

uvicorn = pytest.importorskip("uvicorn")
pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = "tiny"


# --- the pieces ------------------------------------------------------------------------------------

@pytest.mark.parametrize("split", [1, 2, 3, 7])
def test_stop_text_never_shows_a_stop_string(split: int) -> None:
    text = "Monday, then Tuesday, then Wednesday"
    for stops, expected in (((" Tues",), "Monday, then"), (("Wednesday", ","), "Monday"), (("Friday",), text),
                            (("day, t",), "Mon")):
        shown = StopText(stops)
        out = "".join(shown.add(text[i:i + split]) for i in range(0, len(text), split)) + shown.finish()
        assert out == expected == StopText(stops).cut(text)
        assert shown.stopped == (expected != text)


def test_stop_tokens_count_the_tokens_that_complete_a_stop_string() -> None:
    tok = make_tokenizer()
    ids = tok.encode("abc Tuesday xyz")  # one token per byte
    stops = StopTokens(tok, ("Tues",))
    assert stops.add(ids[:5]) is None and stops.add(ids[5:7]) is None
    assert stops.add(ids[7:12]) == 8  # "abc Tues" is 8 tokens
    assert StopTokens(tok, ()).add(ids) is None


# --- a live in-process server ----------------------------------------------------------------------

@pytest.fixture
def live():
    server = Live(MODEL, smooth=False)
    yield server
    server.close()


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_never_appears_in_the_answer(live, stream: bool) -> None:
    status, full, _ = live.complete("The days of the week:", stream)
    assert status == 200 and len(full) > 12
    stop = full[6:9]  # a piece from the middle of the answer: it ends there, before it
    status, text, finish = live.complete("The days of the week:", stream, stop=[stop, "\x00never"])
    assert status == 200 and stop not in text and text == full[:full.index(stop)] and finish == "stop"


def test_a_fault_while_decoding_is_a_500_and_the_server_serves_on(live, monkeypatch) -> None:
    real = live.engine.step
    calls = []

    def failing():  # the fault comes at the request's first step
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a fault of the server's")
        return real()

    monkeypatch.setattr(live.engine, "step", failing)
    status, body, _ = live.complete("Hello")
    assert status == 500 and json.loads(body)["error"]["type"] == "server_error"
    assert live.complete("Hello")[0] == 200
    assert live.call("/health")[0] == 200


class Dying(BaseException):
    """What no request handler catches: it kills the engine thread."""


def test_a_dead_engine_thread_turns_health_to_503(live, monkeypatch) -> None:
    def dying():
        raise Dying("the engine thread is gone")

    monkeypatch.setattr(live.engine, "step", dying)
    status, body, _ = live.complete("Hello")
    assert status == 503 and "the engine failed" in json.loads(body)["error"]["message"]
    status, body = live.call("/health")
    assert status == 503 and json.loads(body)["status"] == "failed" and "Dying" in json.loads(body)["error"]
    assert live.complete("Hello again")[0] == 503  # refused at once, not left waiting


def test_settings_that_cannot_work_are_refused_before_any_request() -> None:
    engine = SpeculativeEngine(tiny_model(0), None, backend="static")
    with pytest.raises(SelfspecError, match="--max-nodes"):
        engine.check_config(DecodeConfig(max_nodes=128, adaptive=False))
    engine.check_config(DecodeConfig(max_nodes=64))
    with pytest.raises(SelfspecError, match="--max-nodes"):  # and a request would say the same, before prefill
        engine.generate([1, 2, 3], DecodeConfig(max_nodes=65))


def test_a_request_longer_than_a_row_is_one_400_and_the_server_goes_on() -> None:
    """The engine's one length check (``BatchEngine.check_request``) answers for the server: 400
    context_length_exceeded with its line (a row of the tiny server holds 256 positions), nothing queued."""
    server = Live("tiny", smooth=False)
    try:
        status, raw = server.call("/v1/completions", {"model": "tiny", "prompt": "Hello", "max_tokens": 400})
        error = json.loads(raw)["error"]
        assert status == 400 and error["code"] == "context_length_exceeded" and error["param"] == "prompt"
        assert "new tokens exceed the 256 positions per request this engine holds (--max-context)" in error["message"]
        assert "ask for at most" in error["message"] and server.engine.waiting == []
        assert server.call("/v1/completions", {"model": "tiny", "prompt": "Hello", "max_tokens": 8})[0] == 200
    finally:
        server.close()
