"""The README's main command: every drafter it shows gives the plain text, and it says so."""

import pytest

from selfspec.demo import committed_heads, run_demo

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_thread")]


def test_demo_shows_identical_text(capsys):
    assert run_demo("smollm2-135m-instruct", "Name three colours.", 24) == 0
    out = capsys.readouterr().out
    heads = len(committed_heads("smollm2-135m-instruct"))
    shown = heads + (heads > 0) + 1  # each committed head family, the first behind lookup, prompt lookup
    assert out.count("identical to plain: yes") == shown
    assert "NO" not in out
