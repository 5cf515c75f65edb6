"""Verdicts measured once per machine and kept on disk (``selfspec/disk_cache.py``): the exact pass's self-test
read back by a later process instead of measured again, keyed so that another CPU, torch or shape measures anew;
a torn file measured again; the row kernel's build named by the CPU it was built for."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import selfspec.cpu as cpu
from selfspec.target import exact, row_attention
from selfspec.disk_cache import cached


def test_a_verdict_is_computed_once_and_read_back(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path))
    calls = []

    def compute():
        calls.append(1)
        return [1, 64], {"note": "measured"}

    value, details, was_cached = cached("selftest", {"a": 1}, compute)
    assert value == [1, 64] and not was_cached and details["note"] == "measured" and details["measured"]
    value, details, was_cached = cached("selftest", {"a": 1}, compute)
    assert value == [1, 64] and was_cached and details["note"] == "measured" and calls == [1]
    assert cached("selftest", {"a": 2}, compute)[2] is False and len(calls) == 2  # another key: measured
    for entry in (tmp_path / "selftest").glob("*.json"):
        entry.write_text('{"key": ')  # torn
    assert cached("selftest", {"a": 1}, compute)[:1] == ([1, 64],) and len(calls) == 3


def test_the_self_test_is_read_back_by_a_later_process(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path))
    monkeypatch.setattr(exact, "_ROWS", {})
    linear = nn.Linear(64, 48, bias=False, dtype=torch.bfloat16)
    cpu_dev, buckets = torch.device("cpu"), (1, 4, 8, 16)
    first = exact.row_range(linear, 64, buckets, cpu_dev, torch.bfloat16)
    assert list((tmp_path / "selftest").glob("*.json"))
    monkeypatch.setattr(exact, "_ROWS", {})  # a new process: nothing in memory
    monkeypatch.setattr(exact, "_row_range", lambda *a: pytest.fail("measured again"))
    assert exact.row_range(linear, 64, buckets, cpu_dev, torch.bfloat16) == first
    monkeypatch.setattr(exact, "_ROWS", {})
    monkeypatch.setattr(cpu, "_cpuinfo", lambda: "model name : Another CPU\nflags : avx2\n")  # another host
    monkeypatch.setattr(exact, "_row_range", lambda *a: (2, 8))
    assert exact.row_range(linear, 64, buckets, cpu_dev, torch.bfloat16) == (2, 8)


def test_the_row_kernel_build_is_named_by_its_cpu(monkeypatch) -> None:
    here = row_attention.build_name()
    assert here.startswith(row_attention.NAME + "_") and here.endswith(cpu.flags_digest())
    monkeypatch.setattr(cpu, "_cpuinfo", lambda: "model name : Another CPU\nflags : avx512f avx512_bf16\n")
    assert row_attention.build_name() != here
