"""What this CPU is: its model name and feature flags, read once from /proc/cpuinfo (Linux; elsewhere empty).

Verdicts measured on one CPU (``--dtype auto``, the exact pass's self-test, the row attention kernel's build) are
keyed by these, so a cache folder shared between hosts (a shared home, a built image) never hands one host's answer
to another.
"""

from __future__ import annotations

import functools
import hashlib
import platform
from pathlib import Path


@functools.cache
def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: no cheap way to tell
        return ""


def cpu_flags() -> set[str]:
    """The CPU's feature flags (x86 ``flags``, Arm ``Features``); empty where /proc/cpuinfo is missing."""
    flags: set[str] = set()
    for line in _cpuinfo().splitlines():
        if line.startswith(("flags", "Features")):
            flags.update(line.split(":", 1)[1].split())
    return flags


def cpu_model() -> str:
    """The CPU's model name as lscpu prints it (``AMD EPYC``), else the platform's processor string."""
    for line in _cpuinfo().splitlines():
        if line.startswith(("model name", "Model Name", "Hardware")):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def flags_digest() -> str:
    """12 hex digits naming this CPU's model and flag set (for file names and cache keys)."""
    text = cpu_model() + "|" + " ".join(sorted(cpu_flags()))
    return hashlib.sha1(text.encode()).hexdigest()[:12]
