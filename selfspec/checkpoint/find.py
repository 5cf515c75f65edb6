"""Where a model's trained heads are: ``<folder>/<model>-<family>`` in each folder of a search path.

The library takes the search path as given and never guesses one; the commands choose it
(``--heads-path``: see ``selfspec/options.py`` and the README).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..heads import FAMILIES
from .format import CONFIG_FILE


def find_heads(model_name: str, search_path: Sequence[str | Path]) -> list[Path]:
    """The heads folders of ``model_name`` (its last path component) on ``search_path``, folder by folder,
    family by family in :data:`~selfspec.heads.FAMILIES` order (EAGLE-style first)."""
    name = Path(model_name).name
    found = [Path(d).expanduser() / f"{name}-{family}" for d in search_path for family in FAMILIES]
    return [f for f in found if (f / CONFIG_FILE).is_file()]
