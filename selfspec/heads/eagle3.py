"""EAGLE-3-style head: three of the target's layers fused, one Llama layer over [token; feature], its own LM head.

Pair t of a sequence is (g_t, x_{t+1}), g_t the target's hidden states at position t after three of its layers
(``aux_layers``: indices into ``transformers``' ``hidden_states``, default (2, N//2, N-3) for N layers, the
convention vLLM reads), concatenated (3H). The head runs

    h_t = midlayer(input_layernorm(embed(x_{t+1})) ++ hidden_norm(fc(g_t)))      (attention over 2H inputs)
    p(x_{t+2}) = softmax(lm_head(norm(h_t)))                                      (over the draft vocabulary)

and drafts further by feeding h_t back where fc(g) stood (no target states exist for drafted tokens). The
residual of the midlayer is its fused input, as in EAGLE-3. The midlayer is ``transformers``' own
``LlamaDecoderLayer`` (attention, rotary embedding, MLP, norms, KV cache) with q/k/v widened to 2H inputs, so
no modeling code is copied; the trained weights carry exactly the names of the EAGLE-3 layout that vLLM
(``LlamaForCausalLMEagle3``) and SGLang load: ``fc``, ``midlayer.{self_attn,mlp,input_layernorm,hidden_norm,
post_attention_layernorm}``, ``norm``, ``lm_head``, ``d2t`` (target id - draft id, per draft id) and ``t2d``
(a bool mask over the target vocabulary). The token embedding is the target's, frozen and shared.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from torch import nn
from transformers import DynamicCache, LlamaConfig, PretrainedConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

from ..errors import SelfspecError
from ..frozen import text_config
from .config import EagleConfig


def default_aux_layers(num_layers: int) -> list[int]:
    """(2, N//2, N-3) for an N-layer target, each kept inside 1..N-1 (tiny targets repeat a layer)."""
    top = max(1, num_layers - 1)
    return [min(max(i, 1), top) for i in (2, num_layers // 2, num_layers - 3)]


@dataclass
class Eagle3Config(EagleConfig):
    """EAGLE-3: ``aux_layers`` fused by ``fc``, one Llama layer, a final norm and an LM head over the draft vocabulary.

    ``intermediate_size`` None: the target's; ``draft_vocab_size`` None: all of a vocabulary up to 32768 tokens,
    else 32768; ``aux_layers`` None: (2, N//2, N-3); ``top_k``: the EAGLE-2 tree's expansion width. Checked as
    EAGLE's fields are.
    """

    family: ClassVar[str] = "eagle3"
    aux_layers: list[int] | None = None
    train_lm_head: bool = True  # False: the LM head keeps the target's rows it starts from (frozen in training)

    def copied_parameters(self, vocab_size: int, hidden_size: int) -> int:
        """None: the LM head over the draft vocabulary is the head's own, trained and counted with it."""
        return 0

    def resolved(self, target_config: PretrainedConfig) -> Eagle3Config:
        """Fill in the MLP width, draft vocabulary and fused layers from the target's config."""
        tc = text_config(target_config)
        n = tc.num_hidden_layers
        layers = [int(i) for i in self.aux_layers] if self.aux_layers is not None else default_aux_layers(n)
        if len(layers) != 3 or not all(1 <= i <= n for i in layers):
            raise SelfspecError(f"eagle3 aux_layers must be 3 indices into hidden_states within 1..{n}, got {layers}")
        vocab = self.draft_vocab_size or min(tc.vocab_size, 32768)
        if vocab > tc.vocab_size:
            raise SelfspecError(f"eagle3 draft_vocab_size {vocab} exceeds the target's vocabulary ({tc.vocab_size})")
        return replace(self, intermediate_size=self.intermediate_size or tc.intermediate_size,
                       draft_vocab_size=vocab, aux_layers=layers)


def layer_config(target_config: PretrainedConfig, config: Eagle3Config) -> LlamaConfig:
    """The one-layer Llama config of the midlayer: the target's widths, heads, rotary settings and norm epsilon."""
    tc = text_config(target_config)
    heads = tc.num_attention_heads
    rope = getattr(tc, "rope_parameters", None)
    config = LlamaConfig(
        hidden_size=tc.hidden_size, intermediate_size=config.intermediate_size, num_hidden_layers=1,
        num_attention_heads=heads, num_key_value_heads=getattr(tc, "num_key_value_heads", None) or heads,
        head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // heads, rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
        max_position_embeddings=tc.max_position_embeddings, vocab_size=config.draft_vocab_size,
        rope_parameters=dict(rope) if rope else None, attention_bias=False, mlp_bias=False, hidden_act="silu",
        tie_word_embeddings=False, pad_token_id=None, bos_token_id=None, eos_token_id=None)
    config._attn_implementation = "sdpa"  # the attention runs standalone: it applies the additive masks given
    return config


def causal_mask(n: int, cached: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive (1, 1, n, cached + n): row i sees the ``cached`` earlier pairs and new pairs 0..i."""
    seen = torch.ones(n, cached + n, dtype=torch.bool, device=device).tril(cached)
    return torch.zeros(seen.shape, dtype=dtype, device=device).masked_fill_(~seen, torch.finfo(dtype).min)[None, None]


class Eagle3Head(nn.Module):
    """The trained part, named as EAGLE-3 checkpoints are: ``fc``, ``midlayer``, ``norm``, ``lm_head``, ``d2t``, ``t2d``."""

    def __init__(self, config: Eagle3Config, target_config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.layer_config = layer_config(target_config, config)
        hidden, eps = self.layer_config.hidden_size, self.layer_config.rms_norm_eps
        self.fc = nn.Linear(len(config.aux_layers) * hidden, hidden, bias=False)
        self.midlayer = LlamaDecoderLayer(self.layer_config, layer_idx=0)
        attn = self.midlayer.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):  # attention reads [token; feature]
            setattr(attn, name, nn.Linear(2 * hidden, getattr(attn, name).out_features, bias=False))
        self.midlayer.hidden_norm = LlamaRMSNorm(hidden, eps=eps)
        self.norm = LlamaRMSNorm(hidden, eps=eps)
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
        self.lm_head.requires_grad_(config.train_lm_head)
        self.rotary = LlamaRotaryEmbedding(self.layer_config)
        vocab = text_config(target_config).vocab_size
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[:config.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)

    def draft_ids(self) -> torch.Tensor:
        """Target token id of each draft-vocabulary entry."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def new_cache(self) -> DynamicCache:
        """An empty KV cache for the midlayer."""
        return DynamicCache(config=self.layer_config)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """(..., 3H) concatenated target states -> (..., H) the midlayer's feature input."""
        return self.fc(aux)

    def forward(self, features: torch.Tensor, token_embeds: torch.Tensor, position_ids: torch.Tensor,
                cache: DynamicCache | None = None, attention_mask: torch.Tensor | None = None, fuse: bool = False
                ) -> torch.Tensor:
        """(B, n, H) features (fused target states or the head's own earlier outputs) and embeddings of the next
        tokens at ``position_ids`` -> (B, n, H) outputs h (before ``norm``). ``fuse``: the features are the
        target's concatenated states (B, n, 3H), fused by ``fc`` first. ``attention_mask``: additive
        (B, 1, n, cached + n); None is causal over ``cache``'s pairs and these."""
        if fuse:
            features = self.fc(features)
        layer = self.midlayer
        if attention_mask is None:
            cached = 0 if cache is None else cache.get_seq_length()
            attention_mask = causal_mask(features.shape[1], cached, features.dtype, features.device)
        x = torch.cat([layer.input_layernorm(token_embeds), layer.hidden_norm(features)], dim=-1)
        attn, _ = layer.self_attn(hidden_states=x, position_embeddings=self.rotary(features, position_ids),
                                  attention_mask=attention_mask, cache=cache)
        h = features + attn
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """(..., H) outputs -> (..., draft_vocab) logits."""
        return self.lm_head(self.norm(h))

    @torch.no_grad()
    def set_draft_vocab(self, token_counts: torch.Tensor) -> None:
        """Draft over the ``draft_vocab_size`` most frequent tokens (counts per target id, e.g. from training data)."""
        top = token_counts.float().topk(self.d2t.numel()).indices.sort().values.to(self.d2t.device)
        self.d2t.copy_(top - torch.arange(top.numel(), device=top.device))
        self.t2d.zero_()
        self.t2d[top] = True

    @torch.no_grad()
    def init_lm_head(self, target: nn.Module) -> None:
        """Start the LM head from the target's rows for the draft vocabulary (and the norm from the target's)."""
        from ..frozen import lm_head_rows

        weight, _ = lm_head_rows(target, self.draft_ids())
        self.lm_head.weight.copy_(weight.to(self.lm_head.weight))
        norm = getattr(target.get_decoder(), "norm", None)
        if norm is not None and getattr(norm, "weight", None) is not None:
            self.norm.weight.copy_(norm.weight.to(self.norm.weight))
