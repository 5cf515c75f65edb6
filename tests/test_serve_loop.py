"""The loop #55 promises, end to end at smoke size on a tiny in-process server: serve with heads and ``--record``,
train the heads further on the recording (``--init-from`` the serving heads), reload them without a restart; the
server keeps answering, every answer is the target's greedy answer before and after, and /metrics names the new
heads with a mean accepted length above the old heads' on the same prompts."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import Live, hf_greedy, perturb, tiny_model

from selfspec.checkpoint import load_heads, save_heads
from selfspec.data import apply_chat_template
from selfspec.heads import init_heads
from selfspec.serve.record import Recorder
from selfspec.train.config import TrainConfig
from selfspec.train.loop import train

pytest.importorskip("uvicorn")
pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = "tiny"
PROMPTS = [f"Item {i}: the list goes" for i in range(6)] + ["Count with me", "abc abc", "Hello there"]


def ascii_only(model, tokenizer):
    """Give the tiny target an LM head whose bias rules out every token but printable ASCII and EOS, so its answers
    are text that tokenizes back to the same ids (recorded traffic is text; a random byte model's would not be)."""
    text = [i for i in range(len(tokenizer)) if (s := tokenizer.decode([i])).isascii() and s.isprintable() and s]
    old = model.lm_head
    head = torch.nn.Linear(old.in_features, old.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(old.weight)
        head.bias.fill_(-1e4)
        head.bias[text + [tokenizer.eos_token_id]] = 0.0
    model.lm_head = head
    return model


def mean_accepted(metrics: str, folder) -> float:
    found = re.search(rf'selfspec_heads_mean_accepted_tokens{{heads="{re.escape(str(folder))}"}} ([0-9.]+)', metrics)
    assert found, metrics
    return float(found.group(1))


def test_record_train_reload_serves_the_same_answers_with_longer_acceptance(tmp_path) -> None:
    traffic, first, second = tmp_path / "traffic", tmp_path / "heads-0", tmp_path / "round-1"

    def serving_heads(model, tokenizer):
        ascii_only(model, tokenizer)
        save_heads(perturb(init_heads("eagle", model), 1), model, first, tokenizer=tokenizer, base_name=MODEL)
        return load_heads(model, first, tokenizer)[1]

    server = Live(MODEL, smooth=False, drafter=serving_heads, heads=str(first), recorder=Recorder(traffic))
    server.app.state.server.config.load_heads = lambda folder: load_heads(server.model, folder, server.tokenizer)[1]
    try:
        def answers() -> list[str]:
            out = []
            for prompt in PROMPTS:
                status, raw = server.call("/v1/chat/completions", {
                    "model": MODEL, "max_tokens": 24, "temperature": 0,
                    "messages": [{"role": "user", "content": prompt}]})
                assert status == 200, raw
                out.append(json.loads(raw)["choices"][0]["message"]["content"])
            return out

        before = answers()
        recorded = [json.loads(line) for path in sorted(traffic.glob("*.jsonl")) for line in path.read_text().splitlines()]
        assert len(recorded) == len(PROMPTS)

        # the round a user runs beside the server: train_heads.py --data traffic/ --init-from heads-0 (another process,
        # so another copy of the same target)
        target = ascii_only(tiny_model(3, vocab=len(server.tokenizer), hidden=32), server.tokenizer)
        config = TrainConfig(base_model=MODEL, family="eagle", data=str(traffic), init_from=str(first),
                             max_length=96, heldout_fraction=0.0, output_dir=str(second), epochs=40,
                             batch_size=3, learning_rate=1e-2, warmup_steps=1, save_every=1000, eval_examples=0, seed=0)
        trained = train(config, target, server.tokenizer)

        status, raw = server.call("/v1/heads/reload", {"path": str(trained)})
        assert status == 200, raw
        after = answers()
        metrics = server.call("/metrics")[1]
    finally:
        server.close()
    assert after == before  # lossless with either heads
    tok = server.tokenizer
    plain = [tok.decode(hf_greedy(server.model, apply_chat_template(tok, [{"role": "user", "content": p}]), 24,
                                  tok.eos_token_id), skip_special_tokens=True) for p in PROMPTS]
    assert before == plain
    assert f'selfspec_heads_info{{heads="{trained}"}} 1.0' in metrics
    assert mean_accepted(metrics, trained) > mean_accepted(metrics, first)
