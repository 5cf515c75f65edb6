"""Memory each method adds over the target alone, predicted and measured, and what fits a memory budget.

Predicted (before anything runs, from configs and counts; see ``selfspec.memory``):
  weights the method keeps resident beside the target + its own KV cache per context token
  + the transient tree (drafted tokens in the target's cache during verification, and their logits).
Measured after the runs: on CUDA the peak allocated bytes over the plain run of the same question;
on the CPU the tensors actually held (drafter weights not shared with the target, the peak bytes of
its per-request state, the largest verified tree).

A budget holds the target's weights, its KV cache for the context, and what the method adds. The
longest context that fits follows from the prediction; on CUDA the bench then enforces the budget
(``torch.cuda.set_per_process_memory_fraction``) while measuring there, and records an out-of-memory.
"""

from __future__ import annotations

from torch import nn

from selfspec.memory import (MemoryEstimate, counted_added, kv_bytes_per_token, max_context, model_dtype,
                             predict_added, predict_target)

from .methods import Method

ASSISTED_MAX_TOKENS = 20  # transformers' assistant drafts up to this many tokens per pass (its default cap)


def predicted_added(method: Method, target: nn.Module, max_nodes: int) -> MemoryEstimate:
    """What ``method`` adds over the target alone (transformers' methods predicted the same way)."""
    if method.kind == "hf":
        if method.assistant is None:
            return MemoryEstimate()
        a = method.assistant
        size = next(a.parameters()).element_size()
        vocab = target.get_output_embeddings().out_features
        tree = ASSISTED_MAX_TOKENS * (kv_bytes_per_token(target.config, model_dtype(target)) + vocab * 4)
        return MemoryEstimate(sum(p.numel() for p in a.parameters()) * size,
                              kv_bytes_per_token(a.config, model_dtype(a)), tree)
    return predict_added(target, method.drafter, max_nodes)


def measured_added(method: Method, target: nn.Module, rows: list[dict], plain_rows: dict[str, dict]) -> dict:
    """Bytes ``method`` added in its runs: CUDA peak over the plain run of each question, else counted tensors."""
    if method.kind == "vllm":  # another process, with its own copy of the weights and a preallocated KV cache
        return {"source": "not measured (vLLM's own process)", "total": 0}
    peaks = [r["cuda_peak_bytes"] - plain_rows[r["prompt"]]["cuda_peak_bytes"] for r in rows
             if r.get("cuda_peak_bytes") is not None and r["prompt"] in plain_rows]
    if peaks:
        return {"source": "cuda max_memory_allocated over the plain run", "total": max(0, max(peaks))}
    if method.kind == "hf":
        if method.assistant is None:
            return {"source": "counted", "total": 0}
        # transformers keeps the assistant's cache internally: its weights are counted, its cache predicted
        a = method.assistant
        weights = sum(p.numel() * p.element_size() for p in a.parameters())
        ctx = max((r["prompt_tokens"] + len(r["tokens"]) for r in rows), default=0)
        kv = kv_bytes_per_token(a.config, model_dtype(a)) * ctx
        return {"source": "counted weights, predicted cache", "weights": weights, "kv_cache": kv,
                "total": weights + kv}
    state = max((r.get("draft_state_bytes", 0) for r in rows), default=0)
    nodes = max((r.get("max_tree_nodes", 0) for r in rows), default=0)
    return {"source": "counted tensors", **counted_added(target, method.drafter, state, nodes)}


def budget_table(names: list[str], target: nn.Module, added: dict[str, MemoryEstimate], budgets: list[int],
                 context: int, limit: int | None) -> list[dict]:
    """For each budget x method: bytes needed at ``context``, whether that fits, the longest context that fits."""
    base = predict_target(target)
    rows = []
    for budget in budgets:
        for name in names:
            total = base + added[name]
            rows.append({"budget": budget, "method": name, "needed": total.at(context), "context": context,
                         "fits": total.at(context) <= budget, "max_context": max_context(budget, total, limit)})
    return rows
