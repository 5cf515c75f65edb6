"""Which dtype the target runs in: ``auto`` picks the fastest one the hardware computes natively, once per machine.

    CUDA   bfloat16 where the GPU supports it, else float16
    CPU    no native bf16 instructions: float32 (bf16 would be emulated, slower)
           amx_bf16 (Intel AMX): bfloat16, settled by the flags
           avx512_bf16 or Arm bf16 alone: measured once (a linear of the model's shape class, bf16 vs float32,
           interleaved, one thread, fastest of several) with a margin in bf16's favour, the verdict cached on disk

The measured verdict lives under the cache root (``$SELFSPEC_HOME/dtype/``, ``selfspec/disk_cache.py``), keyed by the CPU model, its bf16
flags, the torch version and the shape class, so every later process on this machine (``generate``, ``bench``,
``serve``, ``demo``, training) reads the same answer whatever else is running then: a timing taken while
another job used the cores could otherwise flip a server to float32 for its life. Delete the folder to measure
again. Measured on this project's 2-core AMD EPYC (avx512_bf16): a 1536 -> 8960 ``nn.Linear`` costs 9.5 ms for
1 row and 12 ms for 64 in bf16, 7 ms for 1 row and 26 ms for 2 in fp32, so bf16 wins from 2 rows on (every
speculative pass).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import torch

from .cpu import cpu_flags
from .errors import SelfspecError
from .disk_cache import cached, machine
from .target.packed_linear import linear, pack_weight

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # names on the command line
DTYPE_CHOICES = ("auto", *DTYPES)
BF16_FLAGS = ("amx_bf16", "avx512_bf16", "bf16")  # x86 AMX, x86 AVX-512, Arm
MARGIN = 1.25  # measured: float32 only when bf16 is slower than this many times float32's time
ROWS = (1, 16, 64)  # one plain step, one draft tree, a batched server's pass
RULE = f"bfloat16 unless slower than {MARGIN}x float32 over rows {ROWS}"  # part of the cache key


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class DtypeChoice:
    """A dtype and where the decision came from (``bfloat16 (auto: native bf16, measured 2026-12-06, cached)``)."""

    dtype: torch.dtype
    why: str

    def __str__(self) -> str:
        return f"{dtype_name(self.dtype)} ({self.why})"


# --- the measurement ------------------------------------------------------------------------------------

def shape_class(hidden: int, out: int) -> str:
    """The measured linear's shape, rounded up to powers of two and capped: models alike share one verdict."""
    up = lambda n, cap: min(cap, 2 ** math.ceil(math.log2(max(n, 1))))  # noqa: E731
    return f"{up(hidden, 4096)}x{up(out, 16384)}"


def measure_linear_ms(hidden: int, out: int, timer: Callable[[], float] = time.perf_counter,
                      reps: int = 15) -> dict[str, float]:
    """Fastest ms of a linear of this shape, packed as the static pass packs it, per dtype and rows
    (``{"bfloat16@1": ..., "float32@16": ...}``), on one thread. The two dtypes alternate, so a busy neighbour
    slows both alike, and the fastest of ``reps`` is the one least disturbed. One thread: what is compared is
    the instructions' speed, and a lone thread's sub-millisecond call fits between a neighbour's time slices,
    where threads that meet at a barrier each wait for theirs (2 threads beside two busy processes, AMD EPYC:
    5-12 ms a call either dtype, the verdict a coin toss; 1 thread: bf16 0.27-0.29 ms, fp32 0.54-0.60 ms)."""
    pack = torch.backends.mkldnn.is_available()
    cases = {}
    for dtype in (torch.bfloat16, torch.float32):
        w = torch.randn(out, hidden).to(dtype)
        for rows in ROWS:
            cases[f"{dtype_name(dtype)}@{rows}"] = (torch.randn(rows, hidden).to(dtype), pack_weight(w) if pack else w)
    best = {name: math.inf for name in cases}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for rep in range(reps + 1):
            for name, (x, w) in cases.items():
                start = timer()
                linear(x, w)
                if rep:  # the first round warms up
                    best[name] = min(best[name], (timer() - start) * 1e3)
    finally:
        torch.set_num_threads(threads)
    return best


def bf16_wins(ms: dict[str, float]) -> bool:
    """bf16 unless its time over ``ROWS`` exceeds float32's by more than ``MARGIN`` (bf16 halves the bytes read,
    which a batched server and long contexts gain from beyond what one linear shows)."""
    bf16 = sum(ms[f"bfloat16@{r}"] for r in ROWS)
    fp32 = sum(ms[f"float32@{r}"] for r in ROWS)
    return bf16 <= MARGIN * fp32


# --- the cached verdict ---------------------------------------------------------------------------------

def measured_cpu_dtype(hidden: int, out: int, timer: Callable[[], float] = time.perf_counter) -> DtypeChoice:
    """The cached verdict for this CPU, torch and shape class; measured (and cached) when there is none."""
    shape = shape_class(hidden, out)
    key = {**machine(), "shape": shape, "rule": RULE}

    def measure() -> tuple[str, dict]:
        ms = measure_linear_ms(*map(int, shape.split("x")), timer=timer)
        return ("bfloat16" if bf16_wins(ms) else "float32"), {"ms": {k: round(v, 4) for k, v in ms.items()}}

    name, details, was_cached = cached("dtype", key, measure)
    what = "native bf16" if name == "bfloat16" else "bf16 measured slower"
    return DtypeChoice(DTYPES[name], f"auto: {what}, measured {details['measured']}" + (", cached" if was_cached else ""))


# --- the decision ---------------------------------------------------------------------------------------

def choose_dtype(name: str | torch.dtype, device: torch.device | str = "cpu", config=None) -> DtypeChoice:
    """The dtype ``name`` means on ``device`` and why; ``"auto"`` decides as the module docstring says.

    ``config`` (the model's, optional) picks the measured linear's shape class from its MLP.
    """
    if isinstance(name, torch.dtype):
        return DtypeChoice(name, "given")
    if name != "auto":
        if name not in DTYPES:
            raise SelfspecError(f"unknown dtype '{name}'; choose one of {', '.join(DTYPE_CHOICES)}")
        return DtypeChoice(DTYPES[name], f"--dtype {name}")
    device = torch.device(device)
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return DtypeChoice(torch.bfloat16, "auto: the GPU computes bf16")
        return DtypeChoice(torch.float16, "auto: no bf16 on this GPU")
    if device.type != "cpu":
        return DtypeChoice(torch.float32, f"auto: {device.type}")
    flags = cpu_flags()
    if not flags & set(BF16_FLAGS):
        return DtypeChoice(torch.float32, "auto: no native bf16 on this CPU")
    if "amx_bf16" in flags:
        return DtypeChoice(torch.bfloat16, "auto: native bf16 (amx_bf16)")
    hidden = getattr(config, "hidden_size", 1024)
    return measured_cpu_dtype(hidden, getattr(config, "intermediate_size", None) or 4 * hidden)


def resolve_dtype(name: str | torch.dtype, device: torch.device | str = "cpu", config=None) -> torch.dtype:
    """The dtype ``name`` means on ``device`` (:func:`choose_dtype` without the reason)."""
    return choose_dtype(name, device, config).dtype
