"""EAGLE-style head: one decoder layer of the target's own class that predicts the target's next feature.

Pair t of a sequence is (f_t, x_{t+1}): the target's final hidden state at position t and the token
that follows. The head maps it to

    fc(concat(norm(f_t), norm(embed(x_{t+1}))))  ->  one decoder layer (+ its own final norm)  ->  f^_{t+1}

and the target's frozen LM head on f^_{t+1} predicts x_{t+2}. The two inputs are RMS-normalised
(learned scales) before they meet, as in EAGLE-3: a final hidden state is often 10x longer than a
token embedding, and without the norms the token, which the head most needs, is drowned. Feeding f^ back in place of the true
feature drafts further ahead. The layer is a 1-layer instance of the target's base-model class built
with ``AutoModel.from_config`` (its embedding removed: inputs arrive as ``inputs_embeds``), so rotary
embeddings, attention kernels, 4-D masks and the KV cache are transformers' own for any standard
decoder; no modeling code is copied. ``d2t`` maps the reduced draft vocabulary to target ids (EAGLE-3):
logits are computed over those rows of the frozen LM head only.

With ``norms=False`` the head is EAGLE-1's, as vLLM's ``EagleLlamaForCausalLM`` computes it:
``fc(concat(f_t, embed(x_{t+1})))``, the layer's attention fed without its input norm, no final norm (the
target's final norm already shaped f_t, and the target's LM head reads f^ as it is).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoModel, DynamicCache, PretrainedConfig

from ..verify import cache_kwarg
from ..frozen import config_with_layers, text_config
from .config import EagleConfig


class EagleHead(nn.Module):
    """The trained part: input norms, ``fc`` (2H -> H), one decoder layer, its final norm; ``d2t`` (draft -> target
    ids). Without ``config.norms``: ``fc`` and the layer's attention, post-attention norm and MLP only."""

    def __init__(self, config: EagleConfig, target_config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        hidden = text_config(target_config).hidden_size
        eps = getattr(text_config(target_config), "rms_norm_eps", 1e-6)
        norm = (lambda: nn.RMSNorm(hidden, eps=eps)) if config.norms else nn.Identity
        self.feature_norm, self.embed_norm = norm(), norm()
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        layer_config = config_with_layers(target_config, 1, intermediate_size=config.intermediate_size,
                                          vocab_size=1, pad_token_id=None, bos_token_id=None,
                                          eos_token_id=None, tie_word_embeddings=False)
        self.decoder = AutoModel.from_config(layer_config)
        self.decoder.set_input_embeddings(None)  # tokens come in through the target's frozen embedding
        if not config.norms:  # EAGLE-1: the modules stay (transformers' forward calls them), their weights go
            self.decoder.layers[0].input_layernorm = nn.Identity()
            self.decoder.norm = nn.Identity()
        self.register_buffer("d2t", torch.arange(config.draft_vocab_size))

    def new_cache(self) -> DynamicCache:
        """An empty KV cache for the head's one layer."""
        return DynamicCache(config=self.decoder.config)

    def forward(self, features: torch.Tensor, token_embeds: torch.Tensor, position_ids: torch.Tensor,
                cache: DynamicCache | None = None, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, n, H) features f_t and embeddings of x_{t+1} at ``position_ids`` t -> (B, n, H) predictions of f_{t+1}.

        ``cache`` (appended to, or None for training) holds earlier pairs; ``attention_mask`` is None
        (causal) or a 4-D boolean tree mask (B, 1, n, cached + n).
        """
        x = self.fc(torch.cat([self.feature_norm(features), self.embed_norm(token_embeds)], dim=-1))
        kwargs = {cache_kwarg(type(self.decoder)): cache}
        out = self.decoder(inputs_embeds=x, position_ids=position_ids, attention_mask=attention_mask,
                           use_cache=cache is not None, **kwargs)
        return out.last_hidden_state

    @torch.no_grad()
    def set_draft_vocab(self, token_counts: torch.Tensor) -> None:
        """Draft over the ``draft_vocab_size`` most frequent tokens (counts per target id, e.g. from training data)."""
        top = token_counts.float().topk(self.d2t.numel()).indices.sort().values
        self.d2t.copy_(top.to(self.d2t.device))
