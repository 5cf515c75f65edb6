"""What an EAGLE-3-style head learns: training-time test over its own unrolled drafts, soft labels from the target.

Batch notation as in ``objectives.py``, plus ``aux`` (B, T, 3H): the target's states after the head's three
``aux_layers``, concatenated. Step 1 feeds the real pairs (fc(aux_t), x_{t+1}); step k feeds step k-1's
outputs h with x_{t+k} at position t + k - 1, through one KV cache holding all earlier steps (each row sees the
real pairs before its root and its own chain: the cache a depth-k draft sees). Step k's row t is scored against
the target's next-token distribution at position t + k restricted to the draft vocabulary (soft cross-entropy,
reported as KL: less the target's entropy);
positions whose next token lies outside the draft vocabulary are masked. Step k weighs ``decay**(k-1)``.

Levers for small data (``Eagle3Loss``, off by default until measured): ``feature_weight`` adds EAGLE-1's dense
target, a smooth-L1 regression of the head's normed output onto the target's final state at the position whose
next token it predicts; ``topk_weight`` adds HASS's top-K distillation, the cross-entropy to the teacher's
probabilities of its ``topk`` most likely draft tokens only; ``curriculum_steps`` grows the unroll with training
(GRIFFIN): one step for the first ``curriculum_steps`` optimizer steps, two for the next, and so on up to ``unroll``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from .eagle import eagle_unroll
from .common import Objective, draft_vocab_counts, fixed, inner, lm_logits


@dataclass(frozen=True)
class Eagle3Loss:
    unroll: int = 3  # drafting steps unrolled in training (training-time test)
    decay: float = 0.8  # the loss of unrolled step k weighs decay**(k-1)
    feature_weight: float = 0.0  # EAGLE-1's dense target: + this x smooth-L1(norm(h), the target's state there)
    topk: int = 10  # the teacher's top tokens the top-K term distills (HASS)
    topk_weight: float = 0.0  # + this x cross-entropy to the teacher's probabilities of its top-K tokens only
    curriculum_steps: int = 0  # > 0: unroll 1 step for this many optimizer steps, then 2, ... up to unroll (GRIFFIN)

    def __post_init__(self) -> None:
        if self.unroll < 1:
            raise ValueError(f"unroll must be >= 1, got {self.unroll}")
        if self.topk < 1 or self.feature_weight < 0 or self.topk_weight < 0 or self.curriculum_steps < 0:
            raise ValueError("topk must be >= 1, the weights and curriculum_steps >= 0")

    def at(self, step: int) -> Eagle3Loss:
        """The settings in effect at optimizer step ``step`` (0-based): the curriculum's unroll at that step."""
        if not self.curriculum_steps:
            return self
        return replace(self, unroll=min(self.unroll, 1 + step // self.curriculum_steps), curriculum_steps=0)


@torch.no_grad()
def features(target: nn.Module, heads: nn.Module, input_ids: torch.Tensor,
             attention_mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """``f`` (final normed states, for the soft labels) and ``aux`` (the three fused layers' states, concatenated)."""
    out = target.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
    aux = torch.cat([out.hidden_states[i] for i in inner(heads).config.aux_layers], dim=-1)
    return {"f": out.last_hidden_state, "aux": aux}


def eagle3_unroll(head: nn.Module, target: nn.Module, aux: torch.Tensor, x: torch.Tensor, steps: int
                  ) -> list[torch.Tensor]:
    """Outputs h of ``steps`` drafting steps; ``out[k-1][:, t]`` predicts x[:, t + k + 1] (via ``logits``): EAGLE's
    unrolling, step 1 fusing the target's states."""
    return eagle_unroll(head, target, aux, x, steps, fuse_first=True)


def loss(head: nn.Module, target: nn.Module, batch: dict[str, torch.Tensor], args: Eagle3Loss
         ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Soft cross-entropy of every unrolled step against the target's draft-vocabulary distribution, less the
    target's own entropy (the same gradients; a loss that can reach 0: KL(target || draft)); sums over the loss
    positions. A step past a short batch's end still enters the loss (an empty sum): every parameter takes part."""
    x, m, f, aux = batch["input_ids"], batch["loss_mask"].bool(), batch["f"], batch["aux"]
    h = inner(head)
    draft_ids, t2d = h.draft_ids(), h.t2d
    nxt = F.pad(x[:, 1:], (0, 1), value=int(draft_ids[0]))  # nxt[:, p]: the token after position p
    if "attention_mask" in batch:  # after a row's last token: no token (as at the batch's end), not the padding's
        nxt = nxt.masked_fill(~F.pad(batch["attention_mask"][:, 1:], (0, 1)).bool(), int(draft_ids[0]))
    m = m & t2d[nxt]  # the target's next token must be draftable
    with torch.no_grad():  # soft labels at every loss position, once for all steps
        teacher_logp = F.log_softmax(lm_logits(target, f[m].float(), draft_ids).float(), -1)
        teacher = teacher_logp.exp()
    position = torch.arange(f.shape[1], device=f.device).expand_as(m)[m]  # of each teacher row
    total, parts = f.new_zeros(()), {}
    if args.topk_weight:  # the teacher's top-K tokens per row (HASS): their probabilities, the rest zero
        top = teacher.topk(min(args.topk, teacher.shape[-1]), dim=-1).indices
        teacher_top = torch.zeros_like(teacher).scatter_(-1, top, teacher.gather(-1, top))
    for k, pred in enumerate(eagle3_unroll(head, target, aux, x, args.unroll), start=1):
        n = max(pred.shape[1] - (k - 1), 0)  # rows t with t + k inside the sequence
        keep = m[:, k:k + n]  # step k's row t guesses position t + k's next token
        guess = pred[:, :n][keep]
        logp = F.log_softmax(h.logits(guess).float(), -1)
        rows = position >= k
        kl = (teacher[rows] * (teacher_logp[rows] - logp)).sum()  # soft cross-entropy - teacher entropy
        step = kl
        parts[f"kl{k}"] = kl.detach()
        if args.feature_weight:  # the target's state at t + k predicts that same token
            reg = F.smooth_l1_loss(h.norm(guess).float(), f[:, k:k + n][keep].float(), reduction="none").mean(-1).sum()
            step = step + args.feature_weight * reg
            parts[f"reg{k}"] = reg.detach()
        if args.topk_weight:
            top_ce = -(teacher_top[rows] * logp).sum()
            step = step + args.topk_weight * top_ce
            parts[f"topk{k}"] = top_ce.detach()
        total = total + args.decay ** (k - 1) * step
    return total, parts


@torch.no_grad()
def predictions(head: nn.Module, target: nn.Module, batch: dict[str, torch.Tensor], depth: int
                ) -> list[torch.Tensor]:
    """Target token ids each unrolled step drafts (greedy): ``out[d-1][:, t]`` guesses the token at t + d + 1."""
    h = inner(head)
    ids = h.draft_ids()
    return [ids[h.logits(pred).argmax(-1)]
            for pred in eagle3_unroll(head, target, batch["aux"], batch["input_ids"], depth)]


def prepare(heads: nn.Module, target: nn.Module, examples: list[dict[str, torch.Tensor]]) -> None:
    """The draft vocabulary (the most frequent assistant tokens of the data; all of a small vocabulary), then the
    LM head and final norm started from the target's own rows and norm."""
    vocab = target.get_output_embeddings().out_features
    if heads.d2t.numel() < vocab:
        heads.set_draft_vocab(draft_vocab_counts(examples, vocab))
    heads.init_lm_head(target)


OBJECTIVE = Objective(features=features, cached=fixed("f", "aux"), loss=loss, predictions=predictions,
                      args=Eagle3Loss, settings=("aux_layers",), prepare=prepare)
