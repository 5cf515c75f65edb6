"""selfspec_eval.heldout: held-out top-1 by depth of several checkpoints on the same conversations."""

from __future__ import annotations

import pytest

from selfspec_eval.heldout import main

SMOL = "checkpoints/smollm2-135m-instruct"


def rows(out: str) -> dict[str, list[str]]:
    """The table's rows: family -> depth cells."""
    table = [line.strip("|").split("|") for line in out.splitlines() if line.startswith(f"| {SMOL}")]
    return {cells[1].strip(): [c.strip() for c in cells[2:]] for cells in table}


@pytest.mark.integration
def test_each_family_gets_its_depths_on_the_same_conversations(capsys):
    code = main(["--model", "smollm2-135m-instruct", "--dtype", "float32", "--data", "sharegpt", "--examples", "3",
                 "--heads", f"{SMOL}-eagle", f"{SMOL}-medusa", f"{SMOL}-early-exit"])
    out = capsys.readouterr().out
    assert code == 0
    assert "held-out conversations of sharegpt" in out
    got = rows(out)
    assert set(got) == {"eagle", "medusa", "early-exit"}
    assert [c == "-" for c in got["eagle"]] == [False] * 4
    assert [c == "-" for c in got["medusa"]] == [False, False, False, True]  # three heads
    assert [c == "-" for c in got["early-exit"]] == [False, True, True, True]  # drafts one token a pass
    eagle = [float(c) for c in got["eagle"]]
    assert all(0.0 <= a <= 1.0 for a in eagle)
    assert eagle[0] > 0.2  # trained heads loaded as trained: untrained ones guess the target's token ~never


def test_a_bad_heads_folder_is_one_line(capsys, tmp_path):
    code = main(["--model", "smollm2-135m-instruct", "--examples", "1", "--heads", str(tmp_path / "none")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("heldout: error:") and err.count("\n") == 1
