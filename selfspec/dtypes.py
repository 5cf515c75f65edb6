"""Which dtype the target runs in: ``auto`` picks the fastest one the hardware computes natively.

    CUDA   bfloat16 where the GPU supports it, else float16
    CPU    bfloat16 where the CPU has native bf16 instructions (avx512_bf16, amx_bf16; bf16 on Arm)
           *and* a measured matmul of the model's shape is faster in bf16 than in float32; else float32

Measured on this project's 2-core AMD EPYC (avx512_bf16): a 1536 -> 8960 ``nn.Linear`` costs 9.5 ms for
1 row and 12 ms for 64 in bf16, 7 ms for 1 row and 26 ms for 2 in fp32, so bf16 wins from 2 rows on
(every speculative pass). On a CPU without native bf16 the same call is emulated and slower: fp32.
"""

from __future__ import annotations

import time
from functools import lru_cache
from pathlib import Path

import torch

from .errors import SelfspecError
from .packed_linear import linear, pack_weight

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # names on the command line
DTYPE_CHOICES = ("auto", *DTYPES)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def cpu_has_native_bf16() -> bool:
    """True when the CPU advertises bf16 arithmetic (x86 avx512_bf16 / amx_bf16, Arm bf16)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: no cheap way to tell, so stay with fp32
        return False
    flags = set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            flags.update(line.split(":", 1)[1].split())
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def _linear_ms(dtype: torch.dtype, rows: int, hidden: int, out: int, reps: int = 5) -> float:
    """Median ms of one linear of this shape, the weight packed as the static target pass packs it."""
    w = torch.randn(out, hidden, dtype=dtype)
    x = torch.randn(rows, hidden, dtype=dtype)
    w = pack_weight(w) if torch.backends.mkldnn.is_available() else w
    times = []
    for _ in range(reps + 1):
        start = time.perf_counter()
        linear(x, w)
        times.append(time.perf_counter() - start)
    return sorted(times[1:])[reps // 2] * 1e3


@lru_cache(maxsize=None)
def bf16_is_faster_on_cpu(hidden: int = 1024, out: int = 4096) -> bool:
    """A bf16 matmul of this shape beats fp32 at 1 and at 16 rows (one plain step, one draft tree) on this CPU."""
    return all(_linear_ms(torch.bfloat16, rows, hidden, out) < _linear_ms(torch.float32, rows, hidden, out)
               for rows in (1, 16))


def resolve_dtype(name: str | torch.dtype, device: torch.device | str = "cpu", config=None) -> torch.dtype:
    """The dtype ``name`` means on ``device``; ``"auto"`` decides as the module docstring says.

    ``config`` (the model's, optional) sizes the CPU measurement like the model's MLP.
    """
    if isinstance(name, torch.dtype):
        return name
    if name != "auto":
        if name not in DTYPES:
            raise SelfspecError(f"unknown dtype '{name}'; choose one of {', '.join(DTYPE_CHOICES)}")
        return DTYPES[name]
    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type != "cpu" or not cpu_has_native_bf16():
        return torch.float32
    hidden = getattr(config, "hidden_size", 1024)
    out = getattr(config, "intermediate_size", 4 * hidden)
    return torch.bfloat16 if bf16_is_faster_on_cpu(min(hidden, 4096), min(out, 16384)) else torch.float32
