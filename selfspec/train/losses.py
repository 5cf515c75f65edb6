"""What each head family learns from the frozen target, and its held-out top-1 accuracy per draft depth.

Notation for one batch: tokens x (B, T), loss mask m (B, T) (1 on assistant tokens), the target's
final normed hidden states f (B, T, H); f_t under the target's LM head predicts x_{t+1}.

* Medusa: head i (0-based) on f_t predicts x_{t+2+i}; cross-entropy weighted decay**i.
* EAGLE: the pair (f_t, x_{t+1}) predicts f_{t+1}: smooth-L1 regression on the feature plus a soft
  cross-entropy between the draft's and the target's next-token distributions (over the draft vocabulary),
  unrolled ``eagle_unroll`` steps the way drafting runs (EAGLE-3's training-time test): step k feeds
  step k-1's predicted features back in, and each of its rows sees the real pairs before its root plus
  its own chain of predicted pairs, exactly the cache a depth-k draft sees. Step k's loss weighs decay**(k-1).
* Early exit: the exit state (first L layers + final norm + adapter) predicts x_{t+1}: KL to the
  target's own distribution there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..heads.common import lm_head_rows
from ..heads.early_exit import truncated_decoder
from ..tree import additive_mask


def inner(module: nn.Module) -> nn.Module:
    """The module itself, under a DDP/FSDP wrapper if there is one (for reading attributes)."""
    return getattr(module, "module", module)


def feature_keys(family: str) -> tuple[str, ...]:
    """The target states a family trains on (what the feature cache stores)."""
    return ("f", "exit") if family == "early-exit" else ("f",)


@torch.no_grad()
def target_features(family: str, target: nn.Module, heads: nn.Module, input_ids: torch.Tensor,
                    attention_mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The frozen target's states for a (B, T) batch: ``f`` (final normed) and, for early exit, ``exit``."""
    # the decoder alone: its last state is hidden_states[-1] of the full model, and skipping the LM head
    # matters on CPU, where a (1, 1, H) row through a large vocabulary is slow under bf16 autocast
    decoder = target.get_decoder()
    feats = {"f": decoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state}
    if family == "early-exit":
        cut = truncated_decoder(target, inner(heads).config.exit_layer)
        feats["exit"] = cut(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    return feats


def _lm(target: nn.Module, h: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    weight, bias = lm_head_rows(target, rows)
    return F.linear(h, weight.to(h.dtype), None if bias is None else bias.to(h.dtype))


def medusa_loss(heads: nn.Module, target: nn.Module, batch: dict[str, torch.Tensor], decay: float
                ) -> tuple[torch.Tensor, dict[str, float]]:
    """Weighted cross-entropy of every head on the positions whose target token is an assistant token."""
    x, m, f = batch["input_ids"], batch["loss_mask"].bool(), batch["f"]
    states = heads(f)  # (K, B, T, H)
    total, logs = f.new_zeros(()), {}
    for i in range(states.shape[0]):
        shift = i + 2
        if x.shape[1] <= shift:
            break
        keep = m[:, shift:]
        if not keep.any():
            continue
        logits = _lm(target, states[i][:, :-shift][keep])  # (n, V)
        ce = F.cross_entropy(logits.float(), x[:, shift:][keep])
        total = total + decay**i * ce
        logs[f"ce{i + 1}"] = ce.item()
    return total, logs


def eagle_step(head: nn.Module, target: nn.Module, feats: torch.Tensor, next_tokens: torch.Tensor, start: int,
               attention_mask: torch.Tensor | None, cache=None) -> torch.Tensor:
    """One pass of the head over pairs (feats[:, j], next_tokens[:, j]) at positions start + j -> predicted features."""
    embeds = target.get_input_embeddings()(next_tokens).to(feats.dtype)
    pos = torch.arange(start, start + feats.shape[1], device=feats.device)[None].expand(feats.shape[0], -1)
    return head(feats, embeds, pos, cache=cache, attention_mask=attention_mask)


def unroll_mask(n: int, step: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Step ``step``'s (1, 1, n, step * n) additive mask: row t sees real pairs 0..t and its own chain (row t of each step)."""
    causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    eye = torch.eye(n, dtype=torch.bool, device=device)
    return additive_mask(torch.cat([causal] + [eye] * (step - 1), dim=1)[None, None], dtype)


def eagle_unroll(head: nn.Module, target: nn.Module, f: torch.Tensor, x: torch.Tensor, steps: int
                 ) -> list[torch.Tensor]:
    """Predicted features of ``steps`` drafting steps; ``out[k-1][:, t]`` guesses f[:, t + k] (x[:, t + k + 1] under the LM head).

    Step 1 reads the real pairs (f_t, x_{t+1}); step k reads (step k-1's output, x_{t+k}) at position
    t + k - 1 through one KV cache holding all earlier steps.
    """
    n = f.shape[1] - 1
    tokens = F.pad(x, (0, steps))  # x[:, t + k] for every row t; rows past the end are masked from the loss
    cache, feats, out = inner(head).new_cache(), f[:, :-1], []
    for k in range(1, steps + 1):
        mask = None if k == 1 else unroll_mask(n, k, feats.dtype, f.device).expand(f.shape[0], -1, -1, -1)
        feats = eagle_step(head, target, feats, tokens[:, k:k + n], k - 1, mask, cache)
        out.append(feats)
    return out


def eagle_loss(head: nn.Module, target: nn.Module, batch: dict[str, torch.Tensor], token_weight: float,
               steps: int = 1, decay: float = 0.8) -> tuple[torch.Tensor, dict[str, float]]:
    """Feature regression + soft cross-entropy to the target's next-token distribution, over ``steps`` unrolled steps."""
    x, m, f = batch["input_ids"], batch["loss_mask"].bool(), batch["f"]
    rows = inner(head).d2t
    with torch.no_grad():  # the target's distribution at every loss position, once for all steps
        teacher = F.softmax(_lm(target, f[m].float(), rows).float(), -1)
    position = torch.arange(f.shape[1], device=f.device).expand_as(m)[m]  # of each teacher row
    total, logs = f.new_zeros(()), {}
    for k, pred in enumerate(eagle_unroll(head, target, f, x, steps), start=1):
        n = pred.shape[1] - (k - 1)  # rows t with t + k inside the sequence
        if n <= 0:
            break
        keep = m[:, k:k + n]  # step k's row t guesses position t + k: the loss positions >= k, in order
        if not keep.any():
            continue
        truth = f[:, k:k + n][keep].float()
        guess = pred[:, :n][keep].float()
        reg = F.smooth_l1_loss(guess, truth)
        draft_logp = F.log_softmax(_lm(target, guess, rows).float(), -1)  # fp32 softmax under autocast too
        soft_ce = -(teacher[position >= k] * draft_logp).sum(-1).mean()
        total = total + decay ** (k - 1) * (reg + token_weight * soft_ce)
        logs[f"reg{k}"], logs[f"soft_ce{k}"] = reg.item(), soft_ce.item()
    return total, logs


def early_exit_loss(adapter: nn.Module, target: nn.Module, batch: dict[str, torch.Tensor]
                    ) -> tuple[torch.Tensor, dict[str, float]]:
    """KL(target || exit) of the next-token distributions on assistant positions."""
    m, f, e = batch["loss_mask"].bool(), batch["f"], batch["exit"]
    keep = torch.zeros_like(m)
    keep[:, :-1] = m[:, 1:]  # position t predicts token t+1
    logp = F.log_softmax(_lm(target, adapter(e[keep])).float(), -1)
    with torch.no_grad():
        teacher = F.log_softmax(_lm(target, f[keep]).float(), -1)
    kl = F.kl_div(logp, teacher, log_target=True, reduction="batchmean")
    return kl, {"kl": kl.item()}


def head_loss(family: str, heads: nn.Module, target: nn.Module, batch: dict[str, torch.Tensor], cfg
              ) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of ``family`` (settings from the run's TrainConfig)."""
    if family == "medusa":
        return medusa_loss(heads, target, batch, cfg.medusa_decay)
    if family == "eagle":
        return eagle_loss(heads, target, batch, cfg.eagle_token_weight, cfg.eagle_unroll, cfg.eagle_unroll_decay)
    return early_exit_loss(heads, target, batch)


@torch.no_grad()
def depth_accuracy(family: str, heads: nn.Module, target: nn.Module, batch: dict[str, torch.Tensor],
                   max_depth: int = 4) -> tuple[list[int], list[int]]:
    """(correct, total) top-1 counts per draft depth against the *target's* greedy token, on assistant positions.

    The target's greedy token after each true prefix (argmax of its LM head on ``f``) is what greedy
    verification accepts, so this is teacher-forced acceptance; on self-distilled data it is also the
    data's token. Depth d means: the token d places after the root. Medusa head d-1; EAGLE unrolled d
    times on its own predicted features (teacher-forced tokens, the cache a depth-d draft sees); early
    exit has depth 1 only.
    """
    x, m = batch["input_ids"], batch["loss_mask"].bool()
    correct, total = [0] * max_depth, [0] * max_depth
    T = x.shape[1]
    greedy = torch.cat([x[:, :1], _lm(target, batch["f"][:, :-1]).argmax(-1)], dim=1)  # greedy[:, j] follows x[:, :j]

    def score(d: int, predicted: torch.Tensor, first: int) -> None:  # predicted[:, j] guesses greedy[:, first + j]
        n = min(predicted.shape[1], T - first)
        if n <= 0:
            return
        keep = m[:, first:first + n]
        correct[d - 1] += int(((predicted[:, :n] == greedy[:, first:first + n]) & keep).sum())
        total[d - 1] += int(keep.sum())

    if family == "medusa":
        states = heads(batch["f"])
        for i in range(min(states.shape[0], max_depth)):
            score(i + 1, _lm(target, states[i]).argmax(-1), i + 2)
    elif family == "eagle":
        d2t = inner(heads).d2t
        for d, pred in enumerate(eagle_unroll(heads, target, batch["f"], x, max_depth), start=1):
            score(d, d2t[_lm(target, pred, d2t).argmax(-1)], d + 1)
    else:
        score(1, _lm(target, heads(batch["exit"])).argmax(-1), 1)
    return correct, total
