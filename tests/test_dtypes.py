"""``--dtype auto``: decided by the CPU's flags where they settle it, else measured once and cached on disk, so a
busy machine never flips a later process to another dtype; deleting the cache measures again."""

from __future__ import annotations

import pytest
import torch

import selfspec.cpu as cpu
import selfspec.dtypes as dt
from selfspec.dtypes import choose_dtype, resolve_dtype
from selfspec.errors import SelfspecError


class FakeClock:
    """A timer whose linears cost what ``cost`` says per dtype (ms): no real timing in a test."""

    def __init__(self, bf16_ms: float, fp32_ms: float) -> None:
        self.t, self.calls = 0.0, 0
        self.cost = {torch.bfloat16: bf16_ms / 1e3, torch.float32: fp32_ms / 1e3}

    def __call__(self) -> float:
        return self.t

    def linear(self, x, w):
        self.calls += 1
        self.t += self.cost[x.dtype]


@pytest.fixture
def avx512_bf16(monkeypatch, tmp_path):
    """A CPU with avx512_bf16 and no AMX (the measured case), and a cache root of the test's own."""
    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path))
    monkeypatch.setattr(dt, "cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    monkeypatch.setattr(cpu, "_cpuinfo", lambda: "model name : Test CPU\nflags : avx512f avx512_bf16\n")  # the key's machine
    return tmp_path


def measure(monkeypatch, clock: FakeClock):
    monkeypatch.setattr(dt, "linear", clock.linear)
    return dt.measured_cpu_dtype(576, 1536, timer=clock)


def test_a_cached_decision_survives_a_slow_timer(monkeypatch, avx512_bf16) -> None:
    first = measure(monkeypatch, FakeClock(bf16_ms=1.0, fp32_ms=2.0))
    assert first.dtype is torch.bfloat16 and "measured" in first.why and "cached" not in first.why
    busy = FakeClock(bf16_ms=9.0, fp32_ms=1.0)  # load on the cores: float32 now looks 9x faster
    again = measure(monkeypatch, busy)
    assert again.dtype is torch.bfloat16 and again.why.endswith(", cached") and busy.calls == 0
    assert str(again).startswith("bfloat16 (auto: native bf16, measured ")
    for entry in (avx512_bf16 / "dtype").glob("*.json"):  # deleting the cache measures again
        entry.unlink()
    fresh = measure(monkeypatch, busy)
    assert fresh.dtype is torch.float32 and busy.calls > 0 and "cached" not in fresh.why


def test_the_margin_favours_bf16_and_a_corrupt_cache_is_measured_again(monkeypatch, avx512_bf16) -> None:
    assert measure(monkeypatch, FakeClock(bf16_ms=1.2, fp32_ms=1.0)).dtype is torch.bfloat16  # within 1.25x
    for entry in (avx512_bf16 / "dtype").glob("*.json"):
        entry.write_text("{half a line")  # a torn file: measured again
    assert measure(monkeypatch, FakeClock(bf16_ms=1.3, fp32_ms=1.0)).dtype is torch.float32


def test_shape_classes_and_torch_versions_are_cached_apart(monkeypatch, avx512_bf16) -> None:
    monkeypatch.setattr(dt, "linear", FakeClock(1.0, 2.0).linear)
    assert dt.shape_class(576, 1536) == dt.shape_class(1000, 2048) == "1024x2048"
    assert dt.shape_class(1536, 8960) == "2048x16384" and dt.shape_class(8192, 28672) == "4096x16384"
    dt.measured_cpu_dtype(576, 1536, timer=FakeClock(1.0, 2.0))
    dt.measured_cpu_dtype(1536, 8960, timer=FakeClock(1.0, 2.0))
    monkeypatch.setattr(torch, "__version__", "0.0.1")
    dt.measured_cpu_dtype(576, 1536, timer=FakeClock(1.0, 2.0))
    assert len(list((avx512_bf16 / "dtype").glob("*.json"))) == 3


def test_dtype_auto_per_device_and_flags(monkeypatch, avx512_bf16) -> None:
    assert resolve_dtype("float32") is torch.float32 and resolve_dtype(torch.float16) is torch.float16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_dtype("auto", "cuda") is torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert resolve_dtype("auto", "cuda") is torch.float16
    monkeypatch.setattr(dt, "cpu_flags", lambda: {"avx2"})
    assert choose_dtype("auto", "cpu").why == "auto: no native bf16 on this CPU"
    monkeypatch.setattr(dt, "cpu_flags", lambda: {"avx512_bf16", "amx_bf16"})
    monkeypatch.setattr(dt, "measure_linear_ms", lambda *a, **k: pytest.fail("AMX settles it: nothing to time"))
    assert str(choose_dtype("auto", "cpu")) == "bfloat16 (auto: native bf16 (amx_bf16))"
    with pytest.raises(SelfspecError, match="unknown dtype"):
        resolve_dtype("float8")


def test_the_real_measurement_names_every_case() -> None:
    ms = dt.measure_linear_ms(64, 128, reps=1)
    assert set(ms) == {f"{d}@{r}" for d in ("bfloat16", "float32") for r in dt.ROWS}
    assert all(v >= 0 for v in ms.values())
