"""The server's gate and operations on a tiny in-process model (uvicorn in a thread, seconds): API keys on /v1/*
and /metrics (401 in OpenAI's shape, through the official client too), /health open, one access-log line per
request without prompt text, a per-request deadline that frees the row, and 413 for an oversized body."""

from __future__ import annotations

import hashlib
import http.client
import json
import logging
import subprocess
import time

import pytest

from conftest import Live, selfspec_command
from selfspec_cli.serve import is_loopback

pytest.importorskip("uvicorn")
pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = "tiny"
KEYS = ("sk-first", "sk-second")


@pytest.fixture
def keyed():
    server = Live(MODEL, smooth=False, api_keys=KEYS)
    yield server
    server.close()


def error(raw: str) -> dict:
    return json.loads(raw)["error"]


def test_v1_needs_a_key_and_health_stays_open(keyed) -> None:
    status, raw = keyed.complete("Hello")[:2]
    assert status == 401 and error(raw)["code"] == "missing_api_key" and "Bearer" in error(raw)["message"]
    for header in ("Bearer sk-wrong", "Bearer sk-first-and-more", "Bearer sk-firs"):
        status, raw = keyed.complete("Hello", headers={"Authorization": header})[:2]
        assert status == 401 and error(raw)["code"] == "invalid_api_key", header
    for header in ("sk-first", "Token sk-first", "Bearer", "Bearer   "):
        status, raw = keyed.complete("Hello", headers={"Authorization": header})[:2]
        assert status == 401 and error(raw)["code"] == "invalid_api_key" and "Bearer" in error(raw)["message"]
    for key in KEYS:
        assert keyed.complete("Hello", headers={"Authorization": f"Bearer {key}"})[0] == 200
    assert keyed.complete("Hello", headers={"Authorization": "bearer sk-second"})[0] == 200  # the scheme's case
    assert keyed.call("/v1/models")[0] == 401
    assert keyed.call("/v1/models", headers={"Authorization": "Bearer sk-first"})[0] == 200
    assert keyed.call("/health")[0] == 200
    assert keyed.call("/metrics")[0] == 401
    status, text = keyed.call("/metrics", headers={"Authorization": "Bearer sk-first"})
    assert status == 200 and 'selfspec_requests_total{endpoint="completions",status="ok"} 3.0' in text
    assert 'selfspec_requests_total{endpoint="completions",status="unauthorized"} 8.0' in text  # 1 + 3 + 4 above
    assert 'selfspec_requests_total{endpoint="/metrics",status="unauthorized"} 1.0' in text


def test_the_official_openai_client_sends_the_key(keyed) -> None:
    openai = pytest.importorskip("openai")
    url = f"http://127.0.0.1:{keyed.port}/v1"
    good = openai.OpenAI(base_url=url, api_key=KEYS[1], max_retries=0, timeout=60)
    out = good.completions.create(model=MODEL, prompt="Hello", max_tokens=8, temperature=0)
    assert out.usage.completion_tokens > 0
    bad = openai.OpenAI(base_url=url, api_key="sk-nope", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError) as caught:
        bad.completions.create(model=MODEL, prompt="Hello", max_tokens=8)
    assert caught.value.status_code == 401 and caught.value.code == "invalid_api_key"


def test_metrics_public_opens_metrics_only() -> None:
    server = Live(MODEL, api_keys=KEYS, metrics_public=True)
    try:
        assert server.call("/metrics")[0] == 200
        assert server.complete("Hello")[0] == 401
    finally:
        server.close()


def test_no_key_configured_serves_everyone() -> None:
    server = Live(MODEL, smooth=False)
    try:
        assert server.complete("Hello")[0] == 200 and server.call("/metrics")[0] == 200
    finally:
        server.close()


def test_one_access_log_line_per_request_without_prompt_text(keyed, caplog) -> None:
    caplog.set_level(logging.INFO, logger="selfspec.access")
    auth = {"Authorization": f"Bearer {KEYS[0]}"}
    secret = "The secret plan is"
    assert keyed.complete(secret, headers=auth)[0] == 200
    assert keyed.complete(secret, stream=True, headers=auth)[0] == 200
    assert keyed.complete(secret)[0] == 401
    assert keyed.call("/v1/completions", {"model": MODEL, "prompt": secret, "max_tokens": 0}, auth)[0] == 422
    keyed.call("/health")
    time.sleep(0.2)  # the stream's line is written as its response ends
    lines = [r.getMessage() for r in caplog.records if r.name == "selfspec.access"]
    assert len(lines) == 4, lines
    ok, streamed, refused, invalid = lines
    for line, status in ((ok, 200), (streamed, 200), (refused, 401), (invalid, 422)):
        assert f"POST /v1/completions {status} " in line and "duration_ms=" in line and secret not in line
    for line in (ok, streamed):
        fields = dict(p.split("=", 1) for p in line.split() if "=" in p)
        assert fields["id"].startswith("cmpl-") and fields["outcome"] == "ok"
        assert int(fields["prompt_tokens"]) == len(secret) and int(fields["completion_tokens"]) > 0
        assert float(fields["ttft_ms"]) <= float(fields["duration_ms"])
        assert fields["key"] == hashlib.sha256(KEYS[0].encode()).hexdigest()[:12] and KEYS[0] not in line
    assert "outcome=unauthorized" in refused and "outcome=invalid" in invalid and "key=" not in refused


def test_log_prompts_puts_the_prompt_in_the_line(caplog) -> None:
    caplog.set_level(logging.INFO, logger="selfspec.access")
    server = Live(MODEL, smooth=False, log_prompts=True)
    try:
        assert server.complete("Tell me a story")[0] == 200
    finally:
        server.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "selfspec.access"]
    assert len(lines) == 1 and 'prompt="Tell me a story"' in lines[0]


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_past_its_deadline_ends_and_frees_its_row(monkeypatch, stream: bool) -> None:
    server = Live(MODEL, batch=1, smooth=False, request_timeout=0.5)
    try:
        real, slow = server.engine.step, [True]

        def step():
            if slow[0]:
                time.sleep(0.1)  # 40 tokens would take ~4 s: past the 0.5 s deadline
            return real()

        monkeypatch.setattr(server.engine, "step", step)
        status, raw = server.call("/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 40,
                                                      "temperature": 0, "stream": stream})
        if stream:  # the stream began with 200; its error comes as an event
            assert status == 200
            events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
            raw = json.dumps(events[-1])
        else:
            assert status == 408
        assert error(raw)["type"] == "timeout_error" and "--request-timeout (0.5 s)" in error(raw)["message"]
        slow[0] = False
        server.app.state.server.config.request_timeout = 60.0  # the next one's own deadline must not race a busy CPU
        assert server.complete("Hello again")[0] == 200  # one row: served, so the timed-out one left it
        assert json.loads(server.call("/health")[1])["running"] == 0
    finally:
        server.close()


def test_an_oversized_body_gets_413() -> None:
    server = Live(MODEL, smooth=False, max_body=2048)
    try:
        status, raw, _ = server.complete("x" * 3000)
        assert status == 413 and error(raw)["code"] == "request_too_large" and "2,048 bytes" in error(raw)["message"]
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)  # no Content-Length: counted
        body = json.dumps({"model": MODEL, "prompt": "y" * 3000, "max_tokens": 4}).encode()
        conn.putrequest("POST", "/v1/completions")
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Transfer-Encoding", "chunked")
        conn.endheaders()
        for i in range(0, len(body), 500):
            piece = body[i:i + 500]
            conn.send(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
        conn.send(b"0\r\n\r\n")
        response = conn.getresponse()
        assert response.status == 413 and error(response.read().decode())["code"] == "request_too_large"
        conn.close()
        assert server.complete("x" * 100)[0] == 200  # under the limit
    finally:
        server.close()


def test_loopback_and_the_warning_for_an_open_port_without_a_key(tmp_path) -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("example.com")
    missing = str(tmp_path / "no-model")
    out = subprocess.run([*selfspec_command(), "serve", "--host", "0.0.0.0", "--model", missing],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    warnings = [ln for ln in out.stderr.splitlines() if "without an API key" in ln]
    assert len(warnings) == 1 and "--api-key" in warnings[0]
    keyed = subprocess.run([*selfspec_command(), "serve", "--host", "0.0.0.0", "--model", missing],
                           capture_output=True, text=True, timeout=300, env={**__import__("os").environ,
                                                                             "SELFSPEC_API_KEY": "a,b"})
    assert "without an API key" not in keyed.stderr


def test_pass_seconds_add_up_to_at_most_the_wall_time_under_batching(monkeypatch) -> None:
    """4 concurrent streamed requests share each pass: /metrics counts a pass and its seconds once per step, not once
    per row (which would be ~4x the wall time); τ is per request (tokens / row passes)."""
    from concurrent.futures import ThreadPoolExecutor

    from test_serve import parse_metrics

    server = Live(MODEL, batch=4, smooth=False)
    try:
        real = server.engine.target.verify_batch

        def slow_pass(*args, **kwargs):  # passes dominate the wall time, as on a real model
            time.sleep(0.03)
            return real(*args, **kwargs)

        monkeypatch.setattr(server.engine.target, "verify_batch", slow_pass)
        start = time.monotonic()
        with ThreadPoolExecutor(4) as pool:
            done = list(pool.map(lambda i: server.complete(f"Story {i}:", stream=True), range(4)))
        wall = time.monotonic() - start
        assert all(status == 200 for status, _, _ in done)
        m = parse_metrics(server.call("/metrics")[1])
    finally:
        server.close()
    verify_s = m["selfspec_verify_seconds_total"][()]
    passes, row_passes = m["selfspec_target_passes_total"][()], m["selfspec_row_passes_total"][()]
    assert 0.03 * passes <= verify_s <= wall
    assert passes < row_passes <= 4 * passes  # rows shared passes
    tokens = m["selfspec_generation_tokens_total"][()]
    assert m["selfspec_mean_accepted_tokens"][()] == pytest.approx(tokens / row_passes)
    assert m["selfspec_draft_seconds_total"][()] + verify_s <= wall
    assert m["selfspec_time_to_first_token_seconds_count"][()] == 4
