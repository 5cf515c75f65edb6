"""The README's main command: every drafter it shows gives the plain text, and it says so."""

from pathlib import Path

import pytest

from selfspec.checkpoint import find_heads
from selfspec_cli.main import main

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_thread")]

COMMITTED = Path(__file__).resolve().parent.parent / "checkpoints"


def test_demo_shows_identical_text(capsys):
    assert main(["demo", "--prompt", "Name three colours.", "--max-new-tokens", "24",
                 "--heads-path", str(COMMITTED)]) == 0
    out = capsys.readouterr().out
    heads = len(find_heads("smollm2-135m-instruct", [COMMITTED]))
    assert heads == 3
    shown = heads + 1 + 1  # each committed head family, the first (EAGLE-style) behind lookup, prompt lookup
    same = out.count("identical to plain: yes") + out.count("near-tie (rounding, not an error)")
    assert same == shown  # identical, or a rounding near-tie of the run's dtype at the first differing token
    assert "heads: smollm2-135m-instruct-eagle + lookup" in out
    assert "NO" not in out and "real divergence" not in out
