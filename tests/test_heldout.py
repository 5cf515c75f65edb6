"""selfspec_eval.heldout: held-out top-1 by depth of several checkpoints on the same conversations."""

from __future__ import annotations

import pytest

from selfspec_eval.heldout import main

SMOL = "checkpoints/smollm2-135m-instruct"


def rows(out: str) -> dict[str, tuple[list[str], list[str]]]:
    """The table's rows: family -> (top-1 by depth, whole chain to depth), four cells each."""
    table = [line.strip("|").split("|") for line in out.splitlines() if line.startswith(f"| {SMOL}")]
    return {cells[1].strip(): (cells[2].split(), cells[3].split()) for cells in table}


@pytest.mark.integration
def test_each_family_gets_its_depths_on_the_same_conversations(capsys):
    code = main(["--model", "smollm2-135m-instruct", "--dtype", "float32", "--data", "sharegpt", "--examples", "3",
                 "--heads", f"{SMOL}-eagle", f"{SMOL}-medusa", f"{SMOL}-early-exit"])
    out = capsys.readouterr().out
    assert code == 0
    assert "held-out conversations of sharegpt" in out
    got = rows(out)
    assert set(got) == {"eagle", "medusa", "early-exit"}
    for family, drafted in (("eagle", 4), ("medusa", 3), ("early-exit", 1)):  # medusa: three heads
        for column in got[family]:
            assert [c == "-" for c in column] == [False] * drafted + [True] * (4 - drafted)
    depth, chain = ([float(c) for c in column] for column in got["eagle"])
    assert all(0.0 <= a <= 1.0 for a in depth + chain)
    assert depth[0] > 0.2  # trained heads loaded as trained: untrained ones guess the target's token ~never
    assert chain[0] == depth[0]  # a chain's first token is the depth-1 guess
    assert chain == sorted(chain, reverse=True) and all(c <= d for c, d in zip(chain, depth))


def test_a_bad_heads_folder_is_one_line(capsys, tmp_path):
    code = main(["--model", "smollm2-135m-instruct", "--examples", "1", "--heads", str(tmp_path / "none")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("heldout: error:") and err.count("\n") == 1


def test_chain_accuracy_counts_roots_right_at_every_depth_so_far():
    import torch

    from selfspec.train.objectives import chain_accuracy

    t, f = True, False
    hits = [(torch.tensor([[t, t, f, t, t]]), torch.tensor([[t, t, t, f, t]])),  # depth 1 (5 roots; root 3 not assistant)
            (torch.tensor([[t, f, t, t]]), torch.tensor([[t, t, t, t]])),        # depth 2 (4 roots reach it)
            (torch.tensor([[t, t, t]]), torch.tensor([[t, t, f]]))]              # depth 3 (3 roots)
    correct, total = chain_accuracy(hits)
    # depth 1: roots 0, 1, 4 right of 0, 1, 2, 4; depth 2: root 0 (root 1 missed it); depth 3: root 0 again
    assert (correct, total) == ([3, 1, 1], [4, 3, 3])
    assert chain_accuracy([]) == ([], [])
