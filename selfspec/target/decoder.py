"""The decoder stack as one loop over the model's own weights, for the exact pass.

A plain step of SmolLM2-135M on 2 CPU cores spent about 40% of its time outside its matmuls and attention:
transformers' per-layer Python (keyword plumbing, decorators, output capture, the attention-interface lookup, the
cache's update call) and ~200 small torch operators a layer (the RMS norms' 8 each, rotary positions, the gated
activation, views and casts). For the standard pre-norm decoder layer (Llama, Qwen2, Mistral: an input norm,
attention through q/k/v/o projections with rotary positions, a residual add, a post-attention norm, a gated MLP, a
residual add) this loop runs the layers itself:

    fits(decoder)   why a decoder's layers are not of that form (None: they are): each layer holds exactly those
                    parts, every layer attends over the whole context, the rotary function is the module's own
    DecoderLoop     (rows, tokens) ids -> the final normed states, and the states after each layer if asked
                    (transformers' ``hidden_states`` numbering), every row attending by the exact pass's plan

It calls the model's own projections (packed linears), attention (the exact pass's) and embedding. The norms, the
rotary positions, the residual adds and the gated activation run as one C++ call each (``row_ops.py``), which
round where the modules round: a pass differs from the model's forward by the last bit of a norm or an activation
now and then, and every row's bits stay independent of the pass, so speculative output stays identical to plain
decoding. Where that extension cannot be built, the loop calls the model's own norm, rotary and MLP modules: the
model's forward's bits exactly.

The first pass through the loop is also run through the model's own forward and compared (bit for bit through the
modules; within rounding, ``TOLERANCE``, through the extension): where they differ, the model's own forward runs
every pass (said once in the log). ``SELFSPEC_DECODER_LOOP=0`` runs the model's own forward always.
"""

from __future__ import annotations

import os
import sys

import torch
from torch import nn

from .attention import selfspec_attention
from .packed_linear import PackedLinear, grid_rows
from .row_ops import ops as row_ops

LAYER_PARTS = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
ATTENTION_PARTS = {"q_proj", "k_proj", "v_proj", "o_proj"}
MLP_PARTS = {"gate_proj", "up_proj", "down_proj", "act_fn"}
# the first pass's final states through the extension against the model's forward: |a - b| / |b| at most this
# (rounding differences compound over the layers: on a code prompt 0.006 for SmolLM2-135M and 0.007 for
# Qwen2.5-Coder-1.5B in bf16; a wrong operation gives ~1)
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 5e-2}


def wanted() -> bool:
    """Whether exact passes may run through the loop (``SELFSPEC_DECODER_LOOP=0``: the model's own forward always)."""
    return os.environ.get("SELFSPEC_DECODER_LOOP", "1") != "0"


def fits(decoder: nn.Module) -> str | None:
    """None if every layer of ``decoder`` is the standard pre-norm layer this loop runs, else why not."""
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if any(not hasattr(decoder, name) for name in needed):
        return f"{type(decoder).__name__} has no {', '.join(n for n in needed if not hasattr(decoder, n))}"
    config = getattr(decoder, "config", None)
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "the model attends over a sliding window"
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or ()):
        return "not every layer attends over the whole context"
    for layer in decoder.layers:
        parts = {name for name, _ in layer.named_children()}
        if parts != LAYER_PARTS:
            return f"{type(layer).__name__} holds {', '.join(sorted(parts))}, not {', '.join(sorted(LAYER_PARTS))}"
        attn = layer.self_attn
        parts = {name for name, _ in attn.named_children()}
        if parts != ATTENTION_PARTS or not hasattr(attn, "head_dim") or not hasattr(attn, "scaling"):
            return f"{type(attn).__name__} is not attention through q/k/v/o projections alone"
        if rotary(attn) is None:
            return f"{type(attn).__name__}'s module has no apply_rotary_pos_emb"
    return None


def rotary(attn: nn.Module):
    """The function ``attn``'s own forward applies rotary positions with (its module's ``apply_rotary_pos_emb``)."""
    return getattr(sys.modules.get(type(attn).__module__), "apply_rotary_pos_emb", None)


def fused(decoder: nn.Module) -> bool:
    """Whether the extension's operations are the model's: RMS norms (a weight, ``variance_epsilon``), a SiLU-gated
    MLP of gate/up/down projections, CPU tensors of one dtype."""
    norms = [decoder.norm, *(n for layer in decoder.layers for n in (layer.input_layernorm,
                                                                     layer.post_attention_layernorm))]
    act = getattr(getattr(decoder, "config", None), "hidden_act", None)
    weight = decoder.embed_tokens.weight
    return (weight.device.type == "cpu" and act in ("silu", "swish")
            and all(n.weight.dtype == weight.dtype for n in norms)
            and all("RMSNorm" in type(n).__name__ and hasattr(n, "variance_epsilon") for n in norms)
            and all({name for name, _ in layer.mlp.named_children()} == MLP_PARTS for layer in decoder.layers))


def linear(module: nn.Module, x: torch.Tensor, rows: int) -> torch.Tensor:
    """``module(x)`` for ``rows`` rows, without its Python frames where it is one packed block and ``rows`` is within
    its row bounds and on its row grid: then the module would run exactly this kernel on these rows."""
    if (type(module) is PackedLinear and module.blocks == 1 and rows >= module.min_rows
            and (not module.max_rows or rows <= module.max_rows) and grid_rows(rows) == rows):
        return torch.ops.mkldnn._linear_pointwise(x, module.packed_0, module.bias, "none", [], "")
    return module(x)


class DecoderLoop:
    """``decoder``'s layers run as one loop (check :func:`fits` first); through the extension's operations where
    they are the model's and it is built (``ops``), else the model's own modules."""

    def __init__(self, decoder: nn.Module) -> None:
        self.decoder = decoder
        self.layers = list(decoder.layers)
        self.rope = rotary(self.layers[0].self_attn)
        self.ops = row_ops() if fused(decoder) else None
        self.trusted: bool | None = None  # None: not yet compared with the model's own forward

    def agrees(self, ours: torch.Tensor, theirs: torch.Tensor) -> bool:
        """Whether the loop's final states agree with the model's forward's: the same bits through the modules,
        within ``TOLERANCE`` through the extension."""
        if self.ops is None:
            return torch.equal(ours, theirs)
        diff = (ours.float() - theirs.float()).norm() / theirs.float().norm().clamp_min(1e-30)
        return bool(diff <= TOLERANCE.get(theirs.dtype, 5e-2))

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, cache, plan, states: bool
                 ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """(rows, n) ``ids`` at ``positions``, K/V written through ``cache.update``, every row attending by ``plan``
        -> (the final normed states (rows, n, H), the states transformers' ``hidden_states`` would hold if
        ``states``: the embeddings, each layer's output, the last one normed; else ())."""
        h = self.decoder.embed_tokens(ids)
        cos, sin = self.decoder.rotary_emb(h, positions)
        if self.ops is None:
            return self._modules(h, cos, sin, cache, plan, states)
        return self._fused(h, cos, sin, cache, plan, states)

    def _attend(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache, plan) -> torch.Tensor:
        """Layer ``i``'s attention of (b, n, heads, d) queries, writing (b, n, kv_heads, d) K/V: (b, n, heads, d)."""
        attn = self.layers[i].self_attn
        k, v = cache.update(k.transpose(1, 2), v.transpose(1, 2), i)
        out, _ = selfspec_attention(attn, q.transpose(1, 2), k, v, None, scaling=attn.scaling, selfspec_exact=plan)
        return out

    def _modules(self, h, cos, sin, cache, plan, states: bool):
        """The loop through the model's own modules: its forward's arithmetic, operator for operator."""
        b, n = h.shape[:2]
        kept = [h] if states else None
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            shape = (b, n, -1, attn.head_dim)
            q = attn.q_proj(x).view(shape).transpose(1, 2)
            k = attn.k_proj(x).view(shape).transpose(1, 2)
            q, k = self.rope(q, k, cos, sin)
            o = self._attend(i, q.transpose(1, 2), k.transpose(1, 2), attn.v_proj(x).view(shape), cache, plan)
            h = h + attn.o_proj(o.reshape(b, n, -1).contiguous())
            h = h + layer.mlp(layer.post_attention_layernorm(h))
            if states:
                kept.append(h)
        h = self.decoder.norm(h)
        if states:
            kept[-1] = h
        return h, tuple(kept) if states else ()

    def _fused(self, h, cos, sin, cache, plan, states: bool):
        """The loop through the extension's operations: rows flattened, the residual stream updated in place."""
        ops, (b, n, hidden) = self.ops, h.shape
        rows = h.view(b * n, hidden)
        cos, sin = cos.reshape(b * n, -1).contiguous(), sin.reshape(b * n, -1).contiguous()
        kept = [h.clone()] if states else None
        first = self.layers[0].input_layernorm
        x = ops.rms_norm(rows, first.weight, first.variance_epsilon)
        m = b * n
        for i, layer in enumerate(self.layers):
            attn, mlp, d = layer.self_attn, layer.mlp, layer.self_attn.head_dim
            q, k, v = linear(attn.q_proj, x, m), linear(attn.k_proj, x, m), linear(attn.v_proj, x, m)
            ops.rope_(q, cos, sin, q.shape[1] // d, d)
            ops.rope_(k, cos, sin, k.shape[1] // d, d)
            o = self._attend(i, q.view(b, n, -1, d), k.view(b, n, -1, d), v.view(b, n, -1, d), cache, plan)
            norm = layer.post_attention_layernorm
            x = ops.add_rms_norm_(rows, linear(attn.o_proj, o.reshape(m, -1), m), norm.weight, norm.variance_epsilon)
            down = linear(mlp.down_proj, ops.silu_mul(linear(mlp.gate_proj, x, m), linear(mlp.up_proj, x, m)), m)
            norm = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.decoder.norm
            x = ops.add_rms_norm_(rows, down, norm.weight, norm.variance_epsilon)
            if states:
                kept.append(rows.view(b, n, hidden).clone())
        x = x.view(b, n, hidden)
        if states:
            kept[-1] = x
        return x, tuple(kept) if states else ()
