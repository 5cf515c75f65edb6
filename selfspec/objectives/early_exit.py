"""What an early-exit adapter learns: the exit state (first L layers + final norm + adapter) predicts x_{t+1}.

KL divergence to the target's own next-token distribution there, on assistant positions. A layer adapter
reads the whole sequence of exit states causally (the cache it drafts with holds the same states: the
first L layers run on every drafted token, so no step of drafting feeds it anything it did not train on).
LoRA changes the first L layers themselves: its exit states are computed in the loss (through them, with the
adapter), so only the target's final states are cached.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..frozen import truncated_decoder
from .common import Objective, draft_vocab_counts, final_states, inner, lm_logits


@dataclass(frozen=True)
class EarlyExitLoss:
    """No settings: the loss is KL(target || exit) on every assistant position."""


def cached(config) -> tuple[str, ...]:
    """What is cached for this config: no exit states under LoRA (they change as it trains)."""
    return ("f",) if config.adapter == "lora" else ("f", "exit")


def _exits(adapter: nn.Module, target: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The batch's exit states: cached, or (LoRA) computed through the adapted layers."""
    if inner(adapter).config.adapter == "lora":
        return adapter(None, target=target, input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"))
    return adapter(batch["exit"])


@torch.no_grad()
def features(target: nn.Module, heads: nn.Module, input_ids: torch.Tensor,
             attention_mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """``f``, and ``exit``: the first ``exit_layer`` layers' state under the final norm (not under LoRA)."""
    if inner(heads).config.adapter == "lora":
        return final_states(target, heads, input_ids, attention_mask)
    cut = truncated_decoder(target, inner(heads).config.exit_layer)
    exit_states = cut(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    return {**final_states(target, heads, input_ids, attention_mask), "exit": exit_states}


def loss(adapter: nn.Module, target: nn.Module, batch: dict[str, torch.Tensor], args: EarlyExitLoss | None = None
         ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL(target || exit) of the next-token distributions, summed over the assistant positions."""
    m, f = batch["loss_mask"].bool(), batch["f"]
    keep = torch.zeros_like(m)
    keep[:, :-1] = m[:, 1:]  # position t predicts token t+1
    logp = F.log_softmax(lm_logits(target, _exits(adapter, target, batch)[keep]).float(), -1)
    with torch.no_grad():
        teacher = F.log_softmax(lm_logits(target, f[keep]).float(), -1)
    kl = F.kl_div(logp, teacher, log_target=True, reduction="sum")
    return kl, {"kl": kl.detach()}


@torch.no_grad()
def predictions(heads: nn.Module, target: nn.Module, batch: dict[str, torch.Tensor], depth: int
                ) -> list[torch.Tensor]:
    """Depth 1 only, aligned as the other families': ``out[0][:, t]`` (the exit at t + 1) guesses the token at t + 2."""
    ids = inner(heads).draft_ids  # a draft vocabulary: the argmax over it, as the drafter takes it
    logits = lm_logits(target, _exits(heads, target, batch), ids)  # the whole sequence, causally
    guess = logits.argmax(-1) if ids is None else ids[logits.argmax(-1)]
    return [guess[:, 1:]]


def prepare(heads: nn.Module, target: nn.Module, examples: list[dict[str, torch.Tensor]]) -> None:
    """A draft vocabulary, if the config asks for one: the most frequent assistant tokens of the data."""
    h = inner(heads)
    if h.draft_ids is not None:
        h.set_draft_vocab(draft_vocab_counts(examples, target.get_output_embeddings().out_features))


OBJECTIVE = Objective(features=features, cached=cached, loss=loss, predictions=predictions, args=EarlyExitLoss,
                      settings=("exit_layer",), prepare=prepare)
