"""Deterministic train / held-out splits by example id.

An example is held out when the SHA-1 of its split key, read as a fraction of 2**64, is below
``heldout_fraction``; so the split does not depend on order, run or machine. The split key is the
id itself, except for ShareGPT, where it is the id without its ``_N`` chunk suffix, so that all
chunks of one long conversation land on the same side.
"""

from __future__ import annotations

import hashlib
import re

from ..errors import SelfspecError

SPLITS = ("train", "heldout", "all")


def heldout_score(key: str) -> float:
    """A number in [0, 1) fixed by ``key``: the first 8 bytes of its SHA-1 over 2**64."""
    digest = hashlib.sha1(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def in_split(key: str, split: str, heldout_fraction: float) -> bool:
    """Whether the example with split key ``key`` belongs to ``split`` (train / heldout / all)."""
    if split == "all":
        return True
    held = heldout_score(key) < heldout_fraction
    return held if split == "heldout" else not held


def sharegpt_split_key(example_id: str) -> str:
    """The split key of a ShareGPT id: the id without its ``_N`` chunk suffix."""
    return re.sub(r"_\d+$", "", example_id)


def check_split_args(split: str, heldout_fraction: float) -> None:
    """Raise a one-line :class:`SelfspecError` for an unknown split or a fraction outside [0, 1]."""
    if split not in SPLITS:
        raise SelfspecError(f"unknown split '{split}'; use one of: {', '.join(SPLITS)}")
    if not 0.0 <= heldout_fraction <= 1.0:
        raise SelfspecError(f"heldout_fraction must be between 0 and 1, got {heldout_fraction}")
