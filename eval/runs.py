"""What one prompt through one bench method measured: the row ``runs.jsonl`` stores."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Run:
    """One prompt through one method."""

    tokens: list[int]
    seconds: float
    tau: float | None = None  # None for transformers' methods (they do not report it)
    target_forwards: int | None = None
    reached_depth: list[int] = field(default_factory=list)
    accepted_at_depth: list[int] = field(default_factory=list)
    draft_state_bytes: int = 0
    max_tree_nodes: int = 0
    cuda_peak_bytes: int | None = None
