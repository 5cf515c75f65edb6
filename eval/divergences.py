"""The bench's losslessness check: every output that differs from the reference method's, diagnosed at
its first differing token (:mod:`selfspec.divergence`): identical, a rounding near-tie, or real (a bug).

The reference is ``hf`` when it ran, else ``plain``; with an exact target pass (``selfspec/target/exact.py``), whose
promise is bit-identity to selfspec's own plain decoding, ``plain`` when it ran. Diagnoses are appended to
``OUT/divergence.jsonl``, keyed by a hash of (dtype, safety factor, prompt ids, both outputs), so ``--report-only``
and a resumed run re-read them instead of recomputing. An output is ``unchecked`` when its prompt ids differ from the
reference's (a later turn, after an earlier turn's answers diverged: that turn has its own verdict) or
when its ``runs.jsonl`` row predates stored prompt ids.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from torch import nn

from selfspec.data import read_records
from selfspec.divergence import IDENTICAL, REAL, SAFETY, Divergence, DivergenceChecker, first_difference
from selfspec.memory import model_dtype

REFERENCES = ("hf", "plain")  # the first of these that ran is the reference
UNCHECKED = "unchecked"
STORE = "divergence.jsonl"


def reference_method(methods: list[str], exact: bool = False) -> str | None:
    """``hf`` when it ran, else ``plain``, else None (nothing to check against); ``exact``: ``plain`` first."""
    return next((m for m in (REFERENCES[::-1] if exact else REFERENCES) if m in methods), None)


def diagnosis_key(dtype: str, safety: float, prompt_ids: list[int], reference: list[int], other: list[int]) -> str:
    """What a stored diagnosis is valid for: this dtype, safety factor, prompt and pair of outputs."""
    return hashlib.sha1(json.dumps([dtype, safety, prompt_ids, reference, other]).encode()).hexdigest()


def diagnose_row(row: dict, ref: dict, checker: DivergenceChecker, dtype: str, known: dict[str, dict],
                 store: Path) -> dict:
    """``row``'s verdict against the reference's row for the same question (Divergence fields)."""
    ids, ref_ids = row.get("prompt_ids"), ref.get("prompt_ids")
    if first_difference(ref["tokens"], row["tokens"]) is None:  # equal, or a prefix: no model pass needed
        return checker.diagnose(ids or [], ref["tokens"], row["tokens"]).to_dict()
    if ids is None or ids != ref_ids:
        why = ("runs.jsonl row without prompt_ids (written before they were stored)" if ids is None or ref_ids is None
               else "its prompt differs from the reference's: an earlier turn diverged")
        return Divergence(UNCHECKED, first_difference(ref["tokens"], row["tokens"]), reason=why).to_dict()
    key = diagnosis_key(dtype, checker.safety, ids, ref["tokens"], row["tokens"])
    if key not in known:
        known[key] = {"key": key, **checker.diagnose(ids, ref["tokens"], row["tokens"]).to_dict()}
        with store.open("a") as f:
            f.write(json.dumps(known[key]) + "\n")
    return {k: v for k, v in known[key].items() if k != "key"}


def diagnose_runs(rows: list[dict], reference: str, checker: DivergenceChecker, store: Path) -> list[dict]:
    """One record (prompt, category, method, reference + Divergence fields) per row of another method
    whose question the reference answered."""
    dtype = str(model_dtype(checker.model))
    known = {r["key"]: r for r in read_records(store)} if store.is_file() else {}
    refs = {r["prompt"]: r for r in rows if r["method"] == reference}
    return [{"prompt": r["prompt"], "category": r["category"], "method": r["method"], "reference": reference,
             **diagnose_row(r, refs[r["prompt"]], checker, dtype, known, store)}
            for r in rows if r["method"] != reference and r["prompt"] in refs]


def check_outputs(rows: list[dict], methods: list[str], target: nn.Module, max_new_tokens: int,
                  folder: Path, exact: bool = False) -> dict | None:
    """The report's ``divergence`` section: reference, dtype, safety factor and every output that is not
    identical; None without a reference method. Counts per method: :func:`selfspec_eval.metrics.summarize`
    with :func:`verdicts`. The float32 copy of ``target`` is built only if an output needs it."""
    reference = reference_method(methods, exact)
    if reference is None:
        return None
    checker = DivergenceChecker(target, max_new_tokens=max_new_tokens)
    records = diagnose_runs(rows, reference, checker, folder / STORE)
    return {"reference": reference, "exact": exact, "dtype": str(model_dtype(target)).removeprefix("torch."),
            "safety": SAFETY,
            "diagnoses": [r for r in records if r["verdict"] != IDENTICAL]}


def verdicts(section: dict | None) -> dict[tuple[str, str], str] | None:
    """(prompt, method) -> verdict of each output that is not identical, for :func:`selfspec_eval.metrics.summarize`;
    None without a check."""
    if section is None:
        return None
    return {(d["prompt"], d["method"]): d["verdict"] for d in section["diagnoses"]}


def real_divergences(section: dict | None) -> list[dict]:
    """The diagnoses that are bugs, not rounding."""
    return [] if section is None else [d for d in section["diagnoses"] if d["verdict"] == REAL]


def describe(d: dict) -> str:
    """One line for a diagnosis: where, which tokens, the float32 evidence."""
    where = f"{d['method']} on {d['prompt']} at new token {d['index']}"
    if d.get("gap") is None:
        return f"{where}: {d['verdict']} ({d['reason']})"
    return (f"{where}: {d['reference']} took {d['reference_token']}, {d['method']} took {d['other_token']}; "
            f"{d['verdict']}: {d['reason']}")


def failure_message(section: dict | None) -> str | None:
    """A loud multi-line message when some output diverged beyond rounding; None when none did."""
    real = real_divergences(section)
    if not real:
        return None
    head = (f"LOSSLESSNESS FAILURE: {len(real)} output(s) differ from {section['reference']}'s beyond "
            f"{section['dtype']} rounding (a bug, not a near-tie):")
    return "\n".join([head, *(f"  {describe(d)}" for d in real)])
