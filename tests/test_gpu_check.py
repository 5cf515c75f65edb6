"""``python -m selfspec_eval.gpu_check``: steps stop at their limits, a time-boxed training still writes its heads,
and a smoke run writes one report with every step's status (on a CPU: the CUDA tests skip, Qwen is skipped)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from selfspec_eval import gpu_check
from selfspec_eval.gpu_check import SMOKE, Check, Outcome, pytest_counts, run_command

ROOT = Path(__file__).resolve().parent.parent
SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]


def test_a_command_is_killed_at_its_limit_and_stopped_at_its_budget(tmp_path: Path) -> None:
    start = time.monotonic()
    killed = run_command(SLEEP, tmp_path / "a.log", limit_s=1)
    stopped = run_command(SLEEP, tmp_path / "b.log", limit_s=30, budget_s=1)
    assert (killed.ended, stopped.ended) == ("timeout", "budget")
    assert killed.returncode != 0 and time.monotonic() - start < 20
    done = run_command([sys.executable, "-c", "print('a\\rb')"], tmp_path / "c.log", limit_s=30)
    assert (done.ended, done.returncode) == ("exited", 0) and gpu_check.tail(done.output) == ["b"]


def test_pytest_summary_is_counted() -> None:
    out = "ss.F\n=== short test summary info ===\n1 failed, 1 passed, 2 skipped, 640 deselected, 1 error in 2.2s\n"
    assert pytest_counts(out) == {"failed": 1, "passed": 1, "skipped": 2, "deselected": 640, "error": 1}


def test_a_time_boxed_training_is_finished_from_its_last_checkpoint(tmp_path: Path, monkeypatch) -> None:
    """At the time box the run is stopped; its heads are written by resuming at the last checkpoint's step."""
    commands = []

    def fake_run(argv, log, limit_s, budget_s=None):
        commands.append(argv)
        folder = tmp_path / "train-heads"
        if len(commands) == 1:  # the training: two checkpoints, then the time box
            for step in (100, 200):
                (folder / "checkpoints" / f"step-{step}").mkdir(parents=True)
            (folder / "log.jsonl").write_text(json.dumps({"step": 200, "loss": 1.5, "elapsed_s": 290.0, "tokens": 10})
                                              + "\n")
            return Outcome(argv, -15, budget_s, "", "budget")
        (folder / "heads").mkdir()
        return Outcome(argv, 0, 5.0, "", "exited")

    monkeypatch.setattr(gpu_check, "run_command", fake_run)
    size = replace(gpu_check.FULL, train_budget_s=300)
    res = gpu_check.train_heads(Check(tmp_path, size, "cuda"))
    assert res.status == "passed" and "step 200" in res.note
    assert commands[1] == [*commands[0], "--resume", "--max-steps", "200"]
    assert res.figures["steps"] == 200 and res.figures["heads"].endswith("heads")


@pytest.mark.integration
def test_smoke_run_writes_one_report_with_every_steps_status(tmp_path: Path) -> None:
    """The cheap steps at smoke size (about 30 s on 2 cores): the CUDA tests, SmolLM2's bench and Qwen's."""
    proc = subprocess.run([sys.executable, "-m", "selfspec_eval.gpu_check", "--smoke", "--out", str(tmp_path),
                           "--steps", "cuda-tests,bench-smollm2,bench-qwen"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    steps = {s["name"]: s for s in report["steps"]}
    assert list(steps) == ["cuda-tests", "bench-smollm2", "bench-qwen"] and report["ok"]
    assert report["size"] == "smoke" and report["torch"] and report["git_commit"] and report["device"]
    assert steps["cuda-tests"]["status"] == ("passed" if torch.cuda.is_available() else "skipped")
    assert steps["bench-qwen"]["status"] == "skipped" and "small model" in steps["bench-qwen"]["note"]
    bench = steps["bench-smollm2"]
    assert bench["status"] == "passed" and bench["returncode"] == 0 and bench["seconds"] > 0
    assert set(bench["figures"]["methods"]) == set(gpu_check.BENCH_METHODS.split(","))
    assert bench["figures"]["questions"] == 2 * SMOKE.questions
    markdown = (tmp_path / "report.md").read_text()
    assert all(f"| {name} | **{s['status']}** |" in markdown for name, s in steps.items())
