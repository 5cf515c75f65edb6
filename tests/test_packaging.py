"""What gets installed: every package listed in pyproject.toml."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_is_installed():
    """pyproject lists packages by hand (eval/ is mapped to selfspec_eval): none may be forgotten."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "selfspec").rglob("__init__.py")}
    assert found | {"selfspec_eval"} == listed
