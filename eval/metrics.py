"""The arithmetic of a benchmark report, on rows of runs (plain dicts, as stored in ``runs.jsonl``).

Each row: ``prompt`` (id, with ``#turn`` for later turns), ``category``, ``method``, ``tokens``,
``seconds``, ``tau``, ``reached_depth``, ``accepted_at_depth``. For each method x category:

* tokens/s: per-question throughput (new tokens / wall seconds), then the mean over questions;
* speedup: that mean over the baseline's mean on the same questions;
* tau: mean over questions of tokens committed per target pass;
* acceptance per depth: accepted / reached counts pooled over all questions (a ratio of sums, so
  a question with many steps weighs more than one with few);
* identical: how many questions gave exactly the baseline's tokens.
* divergence (when the outputs were checked, ``eval/divergences.py``): ``{identical, near-tie, real}``
  counts against the reference method, from each output's verdict at its first differing token.

Only questions every method finished are compared, so a partial (resumed) run stays fair.
"""

from __future__ import annotations

import statistics

from selfspec.divergence import IDENTICAL, count_verdicts

OVERALL = "overall"


def complete_prompts(rows: list[dict], methods: list[str]) -> list[str]:
    """Prompt ids that every method has a row for, in first-seen order."""
    have: dict[str, set[str]] = {}
    for r in rows:
        have.setdefault(r["prompt"], set()).add(r["method"])
    return [p for p, ms in have.items() if set(methods) <= ms]


def pooled_acceptance(rows: list[dict]) -> list[float]:
    """P(accepted at depth d | reached depth d), counts summed over rows."""
    depth = max((len(r.get("reached_depth") or []) for r in rows), default=0)
    reached, accepted = [0] * depth, [0] * depth
    for r in rows:
        for d, (n, a) in enumerate(zip(r.get("reached_depth") or [], r.get("accepted_at_depth") or [])):
            reached[d] += n
            accepted[d] += a
    return [a / n if n else 0.0 for a, n in zip(accepted, reached)]


def method_stats(rows: list[dict], baseline_rows: dict[str, dict] | None,
                 verdicts: dict[tuple[str, str], str] | None = None) -> dict:
    """Metrics of one method's rows (one per question); ``baseline_rows`` (prompt -> row) for identical counts;
    ``verdicts`` ((prompt, method) -> verdict, absent = identical) for the divergence counts."""
    tps = [len(r["tokens"]) / r["seconds"] for r in rows if r["seconds"] > 0]
    taus = [r["tau"] for r in rows if r.get("tau") is not None]
    out = {"questions": len(rows), "tokens_per_s": statistics.mean(tps) if tps else 0.0,
           "tau": statistics.mean(taus) if taus else None, "acceptance_by_depth": pooled_acceptance(rows),
           "new_tokens": sum(len(r["tokens"]) for r in rows)}
    if baseline_rows is not None:
        out["identical"] = sum(r["tokens"] == baseline_rows[r["prompt"]]["tokens"] for r in rows)
    if verdicts is not None:
        out["divergence"] = count_verdicts(verdicts.get((r["prompt"], r["method"]), IDENTICAL) for r in rows)
    return out


def summarize(rows: list[dict], methods: list[str], baseline: str = "hf",
              verdicts: dict[tuple[str, str], str] | None = None, identical_to: str | None = None) -> dict:
    """``{category: {method: metrics + speedup}}`` with an ``overall`` category; baseline = ``hf`` if present.

    ``verdicts``: the divergence check's verdicts of the outputs that are not identical to the reference's;
    ``identical_to``: the method whose outputs the identical counts compare with (default: the baseline).
    """
    base = baseline if baseline in methods else methods[0]
    prompts = set(complete_prompts(rows, methods))
    rows = [r for r in rows if r["prompt"] in prompts and r["method"] in methods]
    categories = sorted({r["category"] for r in rows})
    out = {"baseline": base, "questions": len(prompts), "categories": {}}
    for cat in [*categories, OVERALL]:
        in_cat = [r for r in rows if cat == OVERALL or r["category"] == cat]
        base_rows = {r["prompt"]: r for r in in_cat if r["method"] == base}
        same_rows = {r["prompt"]: r for r in in_cat if r["method"] == (identical_to or base)}
        table = {m: method_stats([r for r in in_cat if r["method"] == m], same_rows, verdicts) for m in methods}
        base_tps = table[base]["tokens_per_s"]
        for v in table.values():
            v["speedup"] = v["tokens_per_s"] / base_tps if base_tps else None
        out["categories"][cat] = table
    return out
