"""Hot-swapped heads (``POST /v1/heads/reload``) on a tiny in-process server: newer heads for the same target swap in
between engine steps while streams are in flight, none dropped and no output changed; heads for another base, a
truncated folder, another family or no path are refused in one line and the old heads keep serving; the route is
behind the API key; /metrics names the serving heads and each one's tau."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import Live, perturb, tiny_model
from selfspec.checkpoint import load_heads, save_heads
from selfspec.heads import init_heads

pytest.importorskip("uvicorn")
pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = "tiny"
PROMPTS = ["The days of the week:", "one two one two one", "Count: 1 2 3", "abc abc abc", "Hello"]


def heads_folder(model, tokenizer, folder, seed: int, family: str = "eagle"):
    save_heads(perturb(init_heads(family, model), seed), model, folder, tokenizer=tokenizer, base_name="tiny")
    return folder


@pytest.fixture
def served(tmp_path):
    folders = {}

    def first(model, tokenizer):
        folders["a"] = heads_folder(model, tokenizer, tmp_path / "heads-a", 1)
        folders["b"] = heads_folder(model, tokenizer, tmp_path / "heads-b", 2)
        folders["eagle3"] = heads_folder(model, tokenizer, tmp_path / "heads-eagle3", 3, "eagle3")
        return load_heads(model, folders["a"], tokenizer)[1]

    server = Live(MODEL, smooth=False, drafter=first, heads=str(tmp_path / "heads-a"), api_keys=("k",))
    config = server.app.state.server.config
    config.load_heads = lambda folder: load_heads(server.model, folder, server.tokenizer)[1]
    server.auth = {"Authorization": "Bearer k"}
    yield server, folders
    server.close()


def reload(server, path, auth=True) -> tuple[int, dict]:
    status, raw = server.call("/v1/heads/reload", {"path": str(path)}, server.auth if auth else None)
    return status, json.loads(raw)


def test_a_reload_during_streams_drops_none_and_changes_no_output(served, monkeypatch) -> None:
    server, folders = served
    before = [server.complete(p, headers=server.auth) for p in PROMPTS]
    assert all(status == 200 for status, _, _ in before)
    real = server.engine.step

    def slow():
        time.sleep(0.02)  # streams still in flight when the reload lands
        return real()

    monkeypatch.setattr(server.engine, "step", slow)
    old = server.engine.drafter
    with ThreadPoolExecutor(len(PROMPTS) + 1) as pool:
        streams = [pool.submit(server.complete, p, True, server.auth) for p in PROMPTS]
        time.sleep(0.1)
        swapped = pool.submit(reload, server, folders["b"])
        during = [s.result() for s in streams]
        status, body = swapped.result()
    assert status == 200 and body["heads"] == str(folders["b"])
    assert server.engine.drafter is not old and server.engine.drafter.name == old.name
    assert [(s, text) for s, text, _ in during] == [(s, text) for s, text, _ in before]  # lossless either way
    after = [server.complete(p, headers=server.auth) for p in PROMPTS]
    assert [text for _, text, _ in after] == [text for _, text, _ in before]
    metrics = server.call("/metrics", headers=server.auth)[1]
    assert f'selfspec_heads_info{{heads="{folders["b"]}"}} 1.0' in metrics
    assert f'selfspec_heads_info{{heads="{folders["a"]}"}} 0.0' in metrics
    assert f'selfspec_heads_mean_accepted_tokens{{heads="{folders["a"]}"}}' in metrics
    assert f'selfspec_heads_mean_accepted_tokens{{heads="{folders["b"]}"}}' in metrics


def test_heads_that_cannot_serve_are_refused_and_the_old_ones_keep_serving(served, tmp_path) -> None:
    server, folders = served
    serving = server.engine.drafter
    other = tiny_model(9, vocab=len(server.tokenizer), hidden=48)  # another base
    foreign = heads_folder(other, server.tokenizer, tmp_path / "foreign", 4)
    truncated = heads_folder(server.model, server.tokenizer, tmp_path / "truncated", 5)
    weights = next(truncated.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:100])
    for path, why in ((foreign, "cannot serve here"), (truncated, "cannot serve here"),
                      (folders["eagle3"], "layers"), (tmp_path / "missing", "cannot serve here")):
        status, body = reload(server, path)
        assert status == 400 and why in body["error"]["message"], (path, body)
        assert server.engine.drafter is serving
        assert server.complete("Hello", headers=server.auth)[0] == 200
    assert server.call("/v1/heads/reload", {"nope": 1}, server.auth)[0] == 400
    assert reload(server, folders["b"], auth=False)[0] == 401  # behind the API key


def test_a_server_without_heads_has_none_to_reload() -> None:
    server = Live(MODEL, smooth=False)
    try:
        status, raw = server.call("/v1/heads/reload", {"path": "x"})
        assert status == 400 and "without --heads" in json.loads(raw)["error"]["message"]
    finally:
        server.close()


def test_newer_heads_keep_the_suffix_drafters_indexes(tmp_path) -> None:
    """serve --heads --drafter suffix: a reload's drafter drafts from everything served before, every scope's."""
    import argparse

    from conftest import make_tokenizer
    from selfspec_cli.generate import build_drafter
    from selfspec_cli.serve import heads_loader

    model, tokenizer = tiny_model(3, vocab=len(make_tokenizer()), hidden=32), make_tokenizer()
    a = heads_folder(model, tokenizer, tmp_path / "heads-a", 1)
    b = heads_folder(model, tokenizer, tmp_path / "heads-b", 2)
    args = argparse.Namespace(heads=str(a), drafter="suffix", suffix_max_mib=1.0, no_lookup=False)
    first = build_drafter(args, model, tokenizer, suffix_scopes=2)
    assert first.name == "eagle+suffix" and first.lookup.scoped_bytes == 2**19  # 1 MiB, two keys
    newer = heads_loader(args, model, tokenizer, first)(str(b))
    assert newer.lookup is first.lookup and newer.name == "eagle+suffix" and newer.inner is not first.inner
