"""The README's main command: every drafter it shows gives the plain text, and it says so."""

from pathlib import Path

import pytest

from selfspec.checkpoint import find_heads
from selfspec_cli.main import main

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_thread")]

COMMITTED = Path(__file__).resolve().parent.parent / "checkpoints"


def test_demo_shows_identical_text(capsys):
    from selfspec_cli.demo import SAME_WIDTH

    assert main(["demo", "--prompt", "Name three colours.", "--max-new-tokens", "24", "--dtype", "bfloat16",
                 "--heads-path", str(COMMITTED)]) == 0
    out = capsys.readouterr().out
    heads = len(find_heads("smollm2-135m-instruct", [COMMITTED]))
    assert heads == 3
    shown = heads + 1 + 1  # each committed head family, the first (EAGLE-style) behind lookup, prompt lookup
    assert out.count("identical".ljust(SAME_WIDTH)) == shown  # the exact pass (the default): bit for bit
    assert "exact target pass" in out and "differs" not in out and "DIFFERS" not in out
    assert "heads: smollm2-135m-instruct-eagle + lookup" in out
    assert "next: selfspec generate --model smollm2-135m-instruct --heads " in out


def test_demo_without_exact_diagnoses_each_difference(capsys):
    assert main(["demo", "--prompt", "Name three colours.", "--max-new-tokens", "24", "--no-exact",
                 "--heads-path", str(COMMITTED)]) == 0
    out = capsys.readouterr().out
    assert "not exact (off (--no-exact))" in out and "exact target pass:" not in out
    assert "DIFFERS" not in out  # identical, or "differs by <dtype> rounding at token N": never a bare "no"
