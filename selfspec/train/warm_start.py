"""Warm start: new heads begin from any heads checkpoint, every tensor that fits copied, the rest reported.

At small data, starting from what already predicts beats starting from noise (speculators, Medusa, Hydra).
``--warm-start FOLDER`` takes heads of any family trained for the same target: the new heads are made and prepared
as a fresh run's are, then

    vocabulary  where both families draft over a reduced vocabulary of the same size, the new heads take the
                source's (the same target ids), so the tensors indexed by it line up; otherwise the new heads
                count theirs from the data, and tensors indexed by a vocabulary (an LM head's rows) are not copied
    tensors     every tensor whose part has the same name and shape in both is copied; the one decoder layer is
                ``decoder.layers.0.`` in the eagle family and ``midlayer.`` in eagle3, its final norm
                ``decoder.norm.`` and ``norm.``: named alike here. From eagle to eagle3 that is the layer's output
                projection and norms, the final norm, and the MLP where both are as wide (``--head-arg
                intermediate_size``; eagle3's attention reads [token; feature], twice eagle's width, and its
                ``fc`` fuses three layers, not two inputs)

and the report (tensors loaded, tensors of another shape, tensors the source lacks) is printed once and kept in
the run's ``train_config.json``. ``--init-from`` differs: it continues heads of the same family and shapes, strictly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..objectives.common import inner

SAME_PART = {"decoder.layers.0.": "layer.", "midlayer.": "layer.", "decoder.norm.": "norm."}  # prefix -> shared name
VOCABULARY = ("d2t", "t2d", "draft_ids")  # buffers that hold a draft vocabulary (set through set_draft_vocab)
BY_VOCABULARY = ("lm_head.",)  # parts whose rows follow the draft vocabulary


@dataclass
class WarmStart:
    """What a warm start copied (tensor names as the new heads call them)."""

    source: str
    vocabulary: bool = False  # the source's draft vocabulary was taken
    loaded: list[str] = field(default_factory=list)
    reshaped: list[str] = field(default_factory=list)  # in both, of another shape (or rows of another vocabulary)
    missing: list[str] = field(default_factory=list)  # not in the source
    parameters: int = 0  # elements copied

    def summary(self) -> str:
        vocab = "its draft vocabulary, " if self.vocabulary else ""
        text = f"warm start from {self.source}: {vocab}{len(self.loaded)} tensors ({self.parameters:,} values) copied"
        if self.reshaped:
            text += f"; another shape, left as initialized: {', '.join(self.reshaped)}"
        if self.missing:
            text += f"; not in the source: {', '.join(self.missing)}"
        return text


def part_name(name: str) -> str:
    """A tensor's name with the family-specific prefix of its part replaced by the name the families share."""
    for prefix, shared in SAME_PART.items():
        if name.startswith(prefix):
            return shared + name[len(prefix):]
    return name


def draft_vocabulary(heads: nn.Module) -> torch.Tensor | None:
    """The target ids a family's heads draft over (None: the whole vocabulary, or none of their own)."""
    h = inner(heads)
    ids = getattr(h, "draft_ids", None)
    if callable(ids):  # eagle3: d2t holds offsets
        return ids()
    if isinstance(ids, torch.Tensor):  # early exit
        return ids
    d2t = getattr(h, "d2t", None)  # eagle: d2t holds the ids
    return d2t if isinstance(d2t, torch.Tensor) else None


def vocabulary_example(ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """A training example whose assistant tokens are ``ids`` once each: counted as a family's ``prepare`` counts a
    draft vocabulary, it chooses exactly ``ids`` when the vocabulary has as many entries."""
    return {"input_ids": ids.cpu(), "loss_mask": torch.ones_like(ids.cpu())}


def same_vocabulary_size(heads: nn.Module, source: nn.Module) -> bool:
    """Whether both draft over a reduced vocabulary of one size (the new heads can take the source's)."""
    mine, theirs = draft_vocabulary(heads), draft_vocabulary(source)
    return mine is not None and theirs is not None and mine.numel() == theirs.numel()


@torch.no_grad()
def copy_fitting(heads: nn.Module, source: nn.Module, vocabulary: bool, name: str) -> WarmStart:
    """Copy into ``heads`` every tensor of ``source`` whose part has the same name and shape (vocabulary buffers
    aside; rows indexed by a vocabulary only when ``vocabulary``: the heads took the source's)."""
    report = WarmStart(name, vocabulary)
    theirs = {part_name(k): v for k, v in source.state_dict().items()}
    for key, mine in inner(heads).state_dict().items():
        if key.split(".")[-1] in VOCABULARY:
            continue
        other = theirs.get(part_name(key))
        if other is None:
            report.missing.append(key)
        elif other.shape != mine.shape or (not vocabulary and part_name(key).startswith(BY_VOCABULARY)):
            report.reshaped.append(key)
        else:
            mine.copy_(other.to(mine.dtype))
            report.loaded.append(key)
            report.parameters += mine.numel()
    return report
