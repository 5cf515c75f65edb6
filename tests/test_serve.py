"""``selfspec serve`` against a live server on 127.0.0.1 (SmolLM2 with its committed EAGLE-style heads), through
the official ``openai`` client: greedy text equal to ``selfspec generate``'s, a bounded queue under 20 clients,
disconnects freeing the engine, every bad request answered with its error, /metrics that add up, and a graceful
shutdown. Plus the pieces on their own: the pacer, the Prometheus format, incremental text."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import free_port, selfspec_command
from selfspec.serve.metrics import Counter, Gauge, Histogram, Registry
from selfspec.serve.pacing import Pacer

openai = pytest.importorskip("openai")

MODEL = "smollm2-135m-instruct"
HEADS = Path(__file__).parents[1] / "checkpoints" / "smollm2-135m-instruct-eagle"
PROMPTS = ["Name three colours.", "What is 2 + 2? Answer briefly.", "Give one tip for writing clear code.",
           "Say hello in French.", "What is the capital of Italy?"]


# --- the pieces ------------------------------------------------------------------------------------

def test_pacer_spreads_a_burst_within_one_step():
    pacer = Pacer()
    pacer.commit(3, 0.0, 3)
    assert pacer.interval() == 0.0  # nothing measured yet: send at once
    t = 0.0
    for n in (1, 4, 2, 3, 3):
        t += 0.2
        pacer.commit(n, t, n)
    step = pacer.step_s
    assert step == pytest.approx(0.2)
    assert pacer.interval() == pytest.approx(step / max(pacer.per_step, 3))  # 3 waiting: T / max(m, 3)
    t += 0.2
    pacer.commit(1, t, 1)
    assert pacer.interval() == pytest.approx(pacer.step_s / pacer.per_step)  # few waiting: one every T / m
    for waiting in (1, 2, 3, 8, 20):  # whatever a commit leaves waiting goes out within one step
        t += 0.2
        pacer.commit(waiting, t, waiting)
        assert (waiting - 1) * pacer.interval() <= pacer.step_s + 1e-9
    off = Pacer(enabled=False)
    off.commit(2, 0.0, 2), off.commit(2, 0.2, 2)
    assert off.interval() == 0.0


def test_prometheus_text_format():
    r = Registry()
    c = r.add(Counter("x_total", "things"))
    g = r.add(Gauge("y", "level"))
    h = r.add(Histogram("z_seconds", "time", buckets=(0.1, 1.0)))
    c.inc(2, kind='a"b')
    g.set(3)
    for v in (0.05, 0.5, 5.0):
        h.observe(v)
    text = r.render()
    assert '# TYPE x_total counter\nx_total{kind="a\\"b"} 2.0' in text
    assert 'z_seconds_bucket{le="0.1"} 1\nz_seconds_bucket{le="1.0"} 2\nz_seconds_bucket{le="+Inf"} 3' in text
    assert "z_seconds_count 3" in text and "z_seconds_sum 5.55" in text
    families = parse_metrics(text)
    assert families["y"][()] == 3.0


# --- a live server ---------------------------------------------------------------------------------

def parse_metrics(text: str) -> dict[str, dict[tuple, float]]:
    """Prometheus text -> {sample name: {sorted label pairs: value}}; fails on a malformed line."""
    declared, out = {}, {}
    sample = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)$')
    for line in text.strip().splitlines():
        if line.startswith("# HELP "):
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            declared[name] = kind
            continue
        m = sample.match(line)
        assert m, f"not a Prometheus sample line: {line!r}"
        name, labels = m.group(1), m.group(3) or ""
        family = re.sub(r"_(bucket|sum|count)$", "", name) if name not in declared else name
        assert family in declared, f"{name} has no # TYPE line"
        pairs = tuple(sorted(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', labels)))
        out.setdefault(name, {})[pairs] = float(m.group(4))
    return out


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def post(url: str, body: bytes) -> tuple[int, dict, dict]:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


def metrics(url: str) -> dict:
    status, text = get(f"{url}/metrics")
    assert status == 200
    return parse_metrics(text)


def value(m: dict, name: str, **labels) -> float:
    return m.get(name, {}).get(tuple(sorted(labels.items())), 0.0)


def wait_idle(url: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        body = json.loads(get(f"{url}/health")[1])
        if not body["running"] and body["waiting"] == 0:
            return
        time.sleep(0.1)
    raise AssertionError("the engine did not become idle")


# float32: greedy output is then exactly the model's, whatever tree sizes the adaptive controller picks from
# timings (in bf16 a k-token pass may round a near-tie either way: selfspec/divergence.py)
DTYPE = ["--dtype", "float32"]


def start(extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([*selfspec_command(), "serve", "--model", MODEL, "--port", str(port), *DTYPE, *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if get(f"{url}/health")[0] == 200:
                return proc, url
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise AssertionError("the server did not start")


@pytest.fixture(scope="module")
def server():
    proc, url = start(["--heads", str(HEADS), "--max-batch", "8", "--queue-size", "4", "--max-new-tokens", "48"])
    yield url
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)


def client(url: str, **kw) -> "openai.OpenAI":
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300, **kw)


def chat(url: str, prompt: str, max_tokens: int = 24, **kw):
    return client(url).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                               temperature=0, max_tokens=max_tokens, **kw)


def generate_cli(prompt: str, max_tokens: int, *extra: str) -> str:
    out = subprocess.run([*selfspec_command(), "generate", "--model", MODEL, "--heads", str(HEADS), "--prompt", prompt,
                          "--max-new-tokens", str(max_tokens), "--json", *DTYPE, *extra],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])["text"]


@pytest.mark.integration
def test_greedy_text_equals_selfspec_generate(server):
    prompt = "Write a haiku about the sea."
    expected = generate_cli(prompt, 40)
    assert chat(server, prompt, 40).choices[0].message.content == expected
    for smooth in (True, False):
        stream = chat(server, prompt, 40, stream=True, extra_body={"smooth": smooth},
                      stream_options={"include_usage": True})
        parts, usage, finish = [], None, None
        for chunk in stream:
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:
                usage = chunk.usage
        assert "".join(parts) == expected and finish in ("stop", "length") and usage.completion_tokens > 0
    raw = "def fibonacci(n):"
    got = client(server).completions.create(model=MODEL, prompt=raw, max_tokens=30, temperature=0)
    assert got.choices[0].text == generate_cli(raw, 30, "--no-chat-template")


@pytest.mark.integration
def test_eight_concurrent_clients_each_get_their_answer_alone(server):
    prompts = PROMPTS + ["Name a fruit.", "Spell 'cat' backwards.", "What is 3 * 7?"]
    alone = {p: chat(server, p, 20).choices[0].message.content for p in prompts}  # one at a time
    wait_idle(server)
    before = metrics(server)
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda p: chat(server, p, 20).choices[0].message.content, prompts, timeout=600))
    assert together == [alone[p] for p in prompts]
    batches = metrics(server)["selfspec_batch_size_sum"][()] - before["selfspec_batch_size_sum"][()]
    passes = metrics(server)["selfspec_batch_size_count"][()] - before["selfspec_batch_size_count"][()]
    assert batches / passes > 1.5  # they were decoded together, not one after another


@pytest.mark.integration
def test_twenty_concurrent_clients_under_a_bounded_queue(server):
    expected = {p: chat(server, p, 12).choices[0].message.content for p in PROMPTS}

    def one(i: int):
        prompt = PROMPTS[i % len(PROMPTS)]
        try:
            return prompt, chat(server, prompt, 12).choices[0].message.content
        except openai.RateLimitError as exc:
            assert int(exc.response.headers["retry-after"]) >= 1
            return prompt, exc

    with ThreadPoolExecutor(20) as pool:
        results = list(pool.map(one, range(20), timeout=600))
    done = [(p, r) for p, r in results if isinstance(r, str)]
    refused = [r for _, r in results if not isinstance(r, str)]
    assert len(done) + len(refused) == 20 and done and refused  # 8 rows + a queue of 4: some are refused
    assert all(text == expected[p] for p, text in done)  # nobody got another client's answer
    wait_idle(server)


@pytest.mark.integration
def test_a_disconnect_mid_stream_frees_the_engine(server):
    wait_idle(server)
    before = metrics(server)
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Count from 1 to 500."}],
                       "max_tokens": 400, "temperature": 0, "stream": True, "smooth": False}).encode()
    req = urllib.request.Request(f"{server}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        chunks = 0
        for line in r:
            chunks += line.startswith(b"data: ")
            if chunks >= 4:
                break
    wait_idle(server)  # the engine stopped this request at its next step: idle long before 400 tokens
    after = metrics(server)
    assert value(after, "selfspec_requests_total", endpoint="chat", status="disconnected") == \
        value(before, "selfspec_requests_total", endpoint="chat", status="disconnected") + 1
    assert after["selfspec_generation_tokens_total"][()] - before["selfspec_generation_tokens_total"][()] < 400
    assert chat(server, PROMPTS[0], 8).choices[0].message.content  # and the next request is served


@pytest.mark.integration
def test_metrics_say_where_the_memory_goes(server):
    m = metrics(server)
    assert m["process_resident_memory_bytes"][()] > 2**20
    parts = {dict(labels)["part"]: v for labels, v in m["selfspec_memory_bytes"].items()}
    assert parts["kv_cache"] > 0 and parts["python_blocks_entries"] > 0
    if "prefix_cache_max" in parts:  # a bounded cache: its bound, its size as accounted and as its tensors hold it
        assert parts["prefix_cache_held"] == parts["prefix_cache"] <= parts["prefix_cache_max"] == 256 * 2**20


@pytest.mark.integration
def test_bad_requests_get_their_errors_and_the_server_keeps_serving(server):
    c = client(server)
    user = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="no-such-model", messages=user)
    with pytest.raises(openai.BadRequestError, match="positions"):
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "word " * 9000}])
    with pytest.raises(openai.BadRequestError, match="n > 1"):
        c.chat.completions.create(model=MODEL, messages=user, n=2)
    for bad in ({"top_p": 2}, {"temperature": -1}, {"max_tokens": 0}):
        with pytest.raises(openai.UnprocessableEntityError):
            c.chat.completions.create(model=MODEL, messages=user, **bad)
    url = f"{server}/v1/chat/completions"
    for body, status in [(b"{not json", 400), (json.dumps({"model": MODEL}).encode(), 422),
                         (json.dumps({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}).encode(), 422),
                         (json.dumps({"model": MODEL, "messages": "hello"}).encode(), 422),
                         (json.dumps({"model": MODEL, "prompt": [10**9]}).encode(), None)]:
        target = url if status else f"{server}/v1/completions"
        code, answer, _ = post(target, body)
        assert code == (status or 400) and set(answer["error"]) >= {"message", "type", "param", "code"}
    assert get(f"{server}/nowhere")[0] == 404
    assert chat(server, PROMPTS[1], 8).choices[0].message.content  # still serving


@pytest.mark.integration
def test_models_health_and_metrics_add_up(server):
    models = client(server).models.list()
    assert [m.id for m in models.data] == [MODEL]
    wait_idle(server)
    before = metrics(server)
    answers = [chat(server, p, 16) for p in [*PROMPTS[:3], PROMPTS[0]]]  # the last one again: from the prefix cache
    after = metrics(server)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("selfspec_requests_total", endpoint="chat", status="ok") == 4
    assert delta("selfspec_generation_tokens_total") == sum(a.usage.completion_tokens for a in answers)
    assert delta("selfspec_prompt_tokens_total") == sum(a.usage.prompt_tokens for a in answers)
    again = answers[-1].usage
    assert again.prompt_tokens_details.cached_tokens == again.prompt_tokens - 1  # all but the first root
    assert answers[-1].choices[0].message.content == answers[0].choices[0].message.content
    assert delta("selfspec_prompt_tokens_cached_total") == sum(a.usage.prompt_tokens_details.cached_tokens
                                                               for a in answers)
    assert delta("selfspec_time_to_first_token_seconds_count") == 4
    assert 0 < delta("selfspec_target_passes_total") <= delta("selfspec_row_passes_total")  # a pass serves 1+ rows
    assert delta("selfspec_row_passes_total") <= delta("selfspec_generation_tokens_total")
    tau = after["selfspec_mean_accepted_tokens"][()]
    assert tau == pytest.approx(after["selfspec_generation_tokens_total"][()] /
                                after["selfspec_row_passes_total"][()])
    for name, series in after.items():  # histograms: cumulative buckets ending in +Inf == count
        if name.endswith("_bucket"):
            counts = [v for _, v in sorted(series.items(), key=lambda kv: float(dict(kv[0])["le"]))]
            assert counts == sorted(counts)
            assert counts[-1] == after[name.replace("_bucket", "_count")][()]
    reached = sum(after.get("selfspec_draft_reached_total", {}).values())
    accepted = sum(after.get("selfspec_draft_accepted_total", {}).values())
    assert 0 <= accepted <= reached


@pytest.mark.integration
def test_graceful_shutdown_finishes_the_stream_in_flight():
    proc, url = start(["--drafter", "none", "--max-new-tokens", "24"])
    got = {}

    def stream():
        chunks = chat(url, "Tell me about rivers.", 24, stream=True)
        got["text"] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    t = threading.Thread(target=stream)
    t.start()
    deadline = time.monotonic() + 60
    while not json.loads(get(f"{url}/health")[1])["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    t.join(120)
    assert got.get("text")  # the stream in flight completed
    assert proc.wait(120) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once it has shut down
