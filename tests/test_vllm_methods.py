"""vLLM as bench methods, without vLLM: the client against a fake worker speaking the same JSON lines."""

from __future__ import annotations

import ast
import json
import stat
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import tiny_model
from selfspec.errors import SelfspecError
from selfspec_eval.methods import VLLM_METHODS, build_methods
from selfspec_eval.vllm_client import PYTHON_ENV, WORKER, VllmClient, WorkerConfig, missing_environment

# Stands in for the vLLM environment's python: run as `fake eval/vllm_worker.py --model M ...`, it
# behaves as the model name says: echo (reversed ids), dies, garbled, silent (never ready).
FAKE = """#!{python}
import json, sys, time
argv = sys.argv[2:]
model = argv[argv.index("--model") + 1]
if model == "silent":
    time.sleep(60)
print(json.dumps({{"ready": True, "argv": argv}}), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    if model == "dies":
        print("Traceback (most recent call last):", file=sys.stderr)
        sys.exit("RuntimeError: out of KV cache blocks")
    if model == "garbled":
        print("INFO 12-02 vLLM is ready", flush=True)
        continue
    if "batch" in req:
        reply = {{"outputs": [ids[::-1][:req["max_new_tokens"]] for ids in req["batch"]], "seconds": 0.5}}
    else:
        reply = {{"tokens": req["ids"][::-1][:req["max_new_tokens"]], "seconds": 0.25}}
    if "--speculative-config" in argv and "eagle3" in argv[argv.index("--speculative-config") + 1]:
        reply.update(drafts=4, accepted_per_pos=[3, 2, 1])
    print(json.dumps(reply), flush=True)
"""


@pytest.fixture
def fake_python(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the workers' stderr logs, without log_dir
    path = tmp_path / "python"
    path.write_text(FAKE.format(python=sys.executable))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_client_round_trips_ids_and_tokens(fake_python):
    spec = VLLM_METHODS["vllm-ngram"]
    with VllmClient(WorkerConfig("echo", "float32", spec), python=fake_python) as client:
        run = client.run([5, 6, 7, 8], 3)
        assert run.tokens == [8, 7, 6] and run.seconds == 0.25 and run.tau is None
        assert client.run([1], 4).tokens == [1]  # the same worker serves the next request
        proc = client.proc
    assert client.proc is None and proc.returncode == 0  # EOF on stdin: it exited by itself
    argv = WorkerConfig("m", "bfloat16", spec, threads=2).argv()
    assert argv[argv.index("--dtype") + 1] == "bfloat16" and argv[argv.index("--threads") + 1] == "2"
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == spec
    assert "--speculative-config" not in WorkerConfig("m").argv()
    overrides = {"num_nextn_predict_layers": 1}  # an MTP drafter's (vllm_target_overrides)
    argv = WorkerConfig("m", hf_overrides=overrides).argv()
    assert json.loads(argv[argv.index("--hf-overrides") + 1]) == overrides
    assert "--hf-overrides" not in WorkerConfig("m").argv()
    from selfspec_eval.vllm_worker import build_parser

    assert json.loads(build_parser().parse_args(argv).hf_overrides) == overrides


def test_a_batch_goes_to_the_worker_as_one_request(fake_python):
    with VllmClient(WorkerConfig("echo", "float32"), python=fake_python) as client:
        outputs, run = client.run_batch([[1, 2, 3], [4, 5], [6]], 2)
    assert outputs == [[3, 2], [5, 4], [6]] and run.seconds == 0.5
    assert run.tokens == [3, 2, 5, 4, 6] and run.tau is None


def test_dead_worker_is_one_line_with_its_stderr(fake_python, tmp_path):
    client = VllmClient(WorkerConfig("dies", log_dir=str(tmp_path)), name="vllm-ngram", python=fake_python)
    with pytest.raises(SelfspecError, match=r"vllm-ngram: .*exited \(code 1\) while generating: "
                                            r"Traceback .* \| RuntimeError: out of KV cache blocks") as err:
        client.run([1, 2], 4)
    assert "\n" not in str(err.value) and client.proc is None
    assert f"(log: {tmp_path / 'vllm-ngram.log'})" in str(err.value)


@pytest.mark.parametrize("model,message", [("garbled", "not a JSON object"),
                                           ("silent", "did not finish starting within 0.5 s")])
def test_misbehaving_worker_is_a_clear_error(fake_python, model, message):
    client = VllmClient(WorkerConfig(model, start_timeout_s=0.5), python=fake_python)
    with pytest.raises(SelfspecError, match=message):
        client.run([1, 2], 4)
    assert client.proc is None  # killed, not left behind


def test_bench_method_runs_through_the_worker(fake_python, monkeypatch):
    monkeypatch.setenv(PYTHON_ENV, str(fake_python))
    assert missing_environment() is None
    target = tiny_model(0, vocab=64)
    plain, vllm = build_methods(["plain", "vllm"], target, None, None, {}, vllm=WorkerConfig("echo"))
    assert vllm.kind == "vllm" and vllm.client.python == fake_python
    assert vllm.run(target, [3, 4, 5], 2, 4, 8).tokens == [5, 4]
    vllm.close()
    assert vllm.client.proc is None
    with pytest.raises(SelfspecError, match="vllm-ngram needs the model folder"):
        build_methods(["vllm-ngram"], target, None, None, {})
    with pytest.raises(SelfspecError, match="cannot start the vLLM worker with .*nowhere"):
        VllmClient(WorkerConfig("echo"), python=fake_python.parent / "nowhere").run([1], 1)


def test_bench_skips_vllm_without_its_environment(tmp_path, monkeypatch, capsys):
    from selfspec_eval.bench import without_missing_vllm

    monkeypatch.setenv(PYTHON_ENV, str(tmp_path / "no-venv" / "bin" / "python"))
    assert without_missing_vllm(["plain", "vllm", "eagle", "vllm-ngram"]) == ["plain", "eagle"]
    out = capsys.readouterr().out
    assert out.startswith("skipping vllm, vllm-ngram: no vLLM environment at ") and out.count("\n") == 1
    assert "make vllm-env" in out
    assert without_missing_vllm(["plain"]) == ["plain"] and capsys.readouterr().out == ""


def test_worker_imports_nothing_from_selfspec():
    """The worker runs in vLLM's environment, where selfspec is not installed."""
    tree = ast.parse(WORKER.read_text())
    modules = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    modules |= {n.module or "." for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0}
    assert not any(isinstance(n, ast.ImportFrom) and n.level for n in ast.walk(tree))
    assert not {m for m in modules if m.split(".")[0] in ("selfspec", "selfspec_eval", "torch", "transformers")}


@pytest.mark.parametrize("family", ["eagle3", "eagle"])
def test_vllm_with_exported_heads(fake_python, monkeypatch, tmp_path, family):
    """``vllm+eagle3``: the heads exported beside the logs, the worker drafting with them, vLLM's per-position
    counters read as selfspec's per-depth acceptance. Normed eagle heads go as vLLM's EAGLE-3 drafter too (two
    layers)."""
    from selfspec.checkpoint import save_heads
    from selfspec.heads import init_heads

    monkeypatch.setenv(PYTHON_ENV, str(fake_python))
    target = tiny_model(0, vocab=64, layers=4)
    target.save_pretrained(tmp_path / "base")
    save_heads(init_heads(family, target), target, tmp_path / "heads", base_name=str(tmp_path / "base"))
    config = WorkerConfig(str(tmp_path / "base"), log_dir=str(tmp_path / "logs"))
    (method,) = build_methods(["vllm+eagle3"], target, None, None, {"eagle3": str(tmp_path / "heads")},
                              vllm=config, vllm_spec_tokens=4)
    spec = method.client.config.speculative
    assert spec == {"method": "eagle3", "model": str(tmp_path / "logs" / "export-eagle3"), "num_speculative_tokens": 4}
    assert (tmp_path / "logs" / "export-eagle3" / "model.safetensors").is_file()
    run = method.run(target, [3, 4, 5], 2, 4, 8)
    method.close()
    assert run.tokens == [5, 4] and run.reached_depth == [4, 3, 2] and run.accepted_at_depth == [3, 2, 1]
    assert run.tau == 2.5  # 1 + 6 accepted tokens / 4 drafts
    with pytest.raises(SelfspecError, match="vllm\\+eagle3"):
        build_methods(["vllm+medusa"], target, None, None, {"eagle3": str(tmp_path / "heads")}, vllm=config)


def test_batch_sizes_are_timed_for_both_workers(fake_python):
    """``vllm_batches``: each batch size decoded by vLLM plain and with heads; tokens summed, acceptance read."""
    from selfspec_eval.vllm_batches import measure, table

    spec = {"method": "eagle3", "model": "exported", "num_speculative_tokens": 3}
    with VllmClient(WorkerConfig("echo"), python=fake_python) as plain, \
            VllmClient(WorkerConfig("echo", speculative=spec), "vllm+eagle3", python=fake_python) as heads:
        rows = measure(plain, heads, [[1, 2, 3], [4, 5]], [1, 4], max_new=2, rounds=2)
    assert [r["batch"] for r in rows] == [1, 4]
    assert rows[1]["tokens"] == [16, 16] and rows[1]["seconds"] == [1.0, 1.0]  # 4 prompts x 2 tokens x 2 rounds
    lines = table(rows, "vllm+eagle3").splitlines()
    assert lines[0].startswith("| batch | vllm tok/s | vllm+eagle3 tok/s") and lines[3].startswith("| 4 | 16.00 | 16.00 | 1.00x")


def test_bench_skips_vllm_suffix_without_arctic_inference(tmp_path, monkeypatch, capsys):
    """A vLLM environment whose python finds no ``arctic_inference``: vllm-suffix alone is skipped, in one line."""
    from selfspec_eval.bench import without_missing_vllm

    bare = tmp_path / "python"
    bare.write_text(f"#!/bin/sh\nexec {sys.executable} -I \"$@\"\n")  # isolated: no site-packages of ours
    bare.chmod(bare.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv(PYTHON_ENV, str(bare))
    assert without_missing_vllm(["plain", "vllm", "vllm-suffix"]) == ["plain", "vllm"]
    out = capsys.readouterr().out
    assert out.startswith("skipping vllm-suffix: ") and "make vllm-suffix" in out and out.count("\n") == 1
    (tmp_path / "site" / "arctic_inference").mkdir(parents=True)
    (tmp_path / "site" / "arctic_inference" / "__init__.py").write_text("")
    bare.write_text(f"#!/bin/sh\nPYTHONPATH={tmp_path / 'site'} exec {sys.executable} \"$@\"\n")  # now it is there
    assert without_missing_vllm(["plain", "vllm-suffix"]) == ["plain", "vllm-suffix"]
