"""Verdicts measured once per machine and kept on disk: ``--dtype auto``'s timing, the exact pass's self-test.

Each verdict is a JSON file under ``$SELFSPEC_HOME/<kind>/`` named by a hash of its key, and holds that key, so a
file is only ever read back for the question it answers; callers put the machine in the key (``machine()``: CPU
model and flags, torch version). A file is written whole or not at all (a temporary file renamed over it), and
computing and writing happen under a lock file, so processes starting together measure once and agree. A file that
does not parse, or answers another key, is measured again. Delete the folder to measure everything again.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .cpu import cpu_model, flags_digest
from .paths import selfspec_home


def machine() -> dict[str, str]:
    """The part of every key that names the machine: CPU model, its flags' digest, torch's version."""
    return {"cpu": cpu_model(), "cpu_flags": flags_digest(), "torch": torch.__version__}


@contextlib.contextmanager
def locked(path: Path):
    """An exclusive lock on ``path`` (POSIX; elsewhere none, and the later writer wins)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        try:
            import fcntl
        except ImportError:
            yield
            return
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _read(path: Path, key: dict) -> dict | None:
    try:
        entry = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return entry if isinstance(entry, dict) and entry.get("key") == key and "value" in entry else None


def _write(path: Path, entry: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(entry, indent=1) + "\n")
    os.replace(tmp, path)  # atomic: a reader sees the old verdict or the new one, never half a file


def cached(kind: str, key: dict, compute: Callable[[], tuple[Any, dict]]) -> tuple[Any, dict, bool]:
    """(value, details, was cached) of the verdict ``key`` asks for: read from ``$SELFSPEC_HOME/<kind>/``, else
    ``compute()`` -> (value, details: what was measured, kept beside it) and written there. Values are JSON."""
    key = json.loads(json.dumps(key))  # the key as it reads back (tuples become lists)
    name = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = selfspec_home() / kind / f"{name}.json"
    with locked(path.with_suffix(".lock")):
        entry = _read(path, key)
        if entry is not None:
            return entry["value"], entry.get("details", {}), True
        value, details = compute()
        details = {"measured": datetime.date.today().isoformat(), **details}
        _write(path, {"key": key, "value": value, "details": details})
        return value, details, False
