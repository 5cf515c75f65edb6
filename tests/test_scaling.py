"""selfspec_eval.scaling: an earlier run's rows join the table, marked, for the sizes this run does not train."""

from __future__ import annotations

import json

import pytest

from selfspec_eval.scaling import earlier_rows, main, table


def row(n: int, tau: float) -> dict:
    return {"conversations": n, "steps": n // 2, "train_s": 60.0 * n / 1000, "final_loss": 4.0,
            "heldout_top1_by_depth": [0.2, 0.2, 0.2, 0.2], "tau": {"chat": tau, "code": tau, "overall": tau}}


def test_earlier_rows_fill_only_the_sizes_not_trained_again(tmp_path):
    path = tmp_path / "report.json"
    path.write_text(json.dumps({"rows": [row(1000, 1.75), row(2000, 1.95)],
                                "environment": {"commit": "d61ab11e2191", "date": "2026-12-07 01:55 UTC"}}))
    got = earlier_rows(path, [1000, 4000])
    assert [r["conversations"] for r in got] == [2000]  # 1000 is trained again: the new row wins
    assert got[0]["earlier"] == {"report": str(path), "commit": "d61ab11e2191", "date": "2026-12-07 01:55 UTC"}
    lines = table([row(1000, 1.76), *got, row(4000, 2.2)])
    assert lines[2].startswith("| 1,000 |") and lines[3].startswith("| 2,000 (earlier run) |")
    assert lines[4].startswith("| 4,000 |") and "**2.20**" in lines[4]


def test_a_missing_earlier_report_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--config", "c.json", "--data", "d.jsonl", "--out", str(tmp_path), "--earlier", str(tmp_path / "no.json")])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "no such report.json" in err and err.strip().count("\n") == 0
