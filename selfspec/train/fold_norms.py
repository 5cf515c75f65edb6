"""Normed eagle heads as EAGLE-1-layout heads (``norms=False``, what vLLM loads), their norms folded into the weights.

An RMS norm divides each token's vector by that vector's RMS; EAGLE-1's layout has no norm to do it, so the fold
replaces each per-token RMS by one constant calibrated on the target's own states, and carries the final norm's
per-channel scale ``w_fin`` through the residual stream instead (every residual write is scaled by
``s = w_fin / rms_y``, so the layer's output already has the final norm's shape):

    fc           [feature; embedding] columns times w_f / rms_f and w_e / rms_e, rows times s
    q, k, v      input columns times w_in / (rms_x * s)            (the layer's input norm; biases unchanged)
    o, down      output rows times s                              (residual writes)
    post norm    weight kappa * w_post / s, kappa = mean rms(s * r) / rms(r) over the calibration tokens

with rms_u for u = f (the target's final states), e (token embeddings), x (``fc``'s output), y (the layer's output
before its final norm) the least-squares constant: 1 / rms_u = E[|u|^2 / rms(u)] / E[|u|^2] over the loss
positions of the calibration batches. Where every RMS equals its constant the folded heads compute exactly what
the normed ones do (``tests/test_training.py`` checks that algebra); elsewhere they are a starting point for
training (``--init-from``): on Qwen2.5-Coder-1.5B the committed eagle heads' held-out top-1 by depth 0.50 0.45 0.43
0.42 became 0.48 0.38 0.35 0.33 folded, against 0.24 0.12 0.09 0.05 for the same tensors copied and trained 404 steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..errors import SelfspecError


@dataclass
class NormScales:
    """The calibrated constants: ``inv[u]`` = 1 / rms_u for u in f, e, x, y; ``kappa`` for the post-attention norm."""

    inv: dict[str, float]
    kappa: float


def rms(u: torch.Tensor) -> torch.Tensor:
    return u.float().pow(2).mean(-1, keepdim=True).sqrt()


def _check(heads: nn.Module) -> None:
    if getattr(heads.config, "family", "") != "eagle" or not heads.config.norms:
        raise SelfspecError("folding norms needs eagle heads with their norms (norms=true)")


@torch.no_grad()
def calibrate(heads: nn.Module, target: nn.Module, batches) -> NormScales:
    """The constants from ``batches`` (dicts with ``input_ids``, ``loss_mask`` and the target's final states ``f``,
    as training gives them): the heads run teacher-forced on every pair, their norms' inputs recorded."""
    _check(heads)
    layer, seen, sums, posts = heads.decoder.layers[0], {}, {}, []
    hooks = [heads.fc.register_forward_hook(lambda m, i, o: seen.__setitem__("x", o)),
             layer.post_attention_layernorm.register_forward_hook(lambda m, i, o: seen.__setitem__("r", i[0])),
             heads.decoder.norm.register_forward_hook(lambda m, i, o: seen.__setitem__("y", i[0]))]
    try:
        for batch in batches:
            f = batch["f"][:, :-1].float()
            e = target.get_input_embeddings()(batch["input_ids"][:, 1:]).float()
            pos = torch.arange(f.shape[1], device=f.device)[None].expand(f.shape[0], -1)
            heads(f, e, pos)
            keep = batch["loss_mask"][:, 1:].bool()
            for key, u in (("f", f), ("e", e), ("x", seen["x"]), ("y", seen["y"])):
                u = u[keep].float()
                n2 = u.pow(2).sum(-1)
                a, b = sums.get(key, (0.0, 0.0))
                sums[key] = (a + (n2 / rms(u).squeeze(-1)).sum().item(), b + n2.sum().item())
            posts.append(seen["r"][keep].float())
    finally:
        for hook in hooks:
            hook.remove()
    if not posts or not sums["f"][1]:
        raise SelfspecError("no loss positions to calibrate the fold on")
    inv = {key: a / b for key, (a, b) in sums.items()}
    s = heads.decoder.norm.weight.float() * inv["y"]
    r = torch.cat(posts)
    return NormScales(inv, (rms(s * r) / rms(r)).mean().item())


@torch.no_grad()
def fold_norms(heads: nn.Module, target: nn.Module, scales: NormScales) -> nn.Module:
    """New eagle heads with ``norms=False`` (float32) computing what ``heads`` do with each RMS a constant."""
    from dataclasses import replace

    from ..heads import init_heads

    _check(heads)
    config = replace(heads.config, norms=False)
    new = init_heads("eagle", target, **{k: getattr(config, k) for k in ("intermediate_size", "draft_vocab_size",
                                                                          "top_k", "norms")}).float()
    inv, h = scales.inv, heads.fc.weight.shape[0]
    old, mine = heads.decoder.layers[0], new.decoder.layers[0]
    s = heads.decoder.norm.weight.float() * inv["y"]
    fc = heads.fc.weight.float()
    new.fc.weight.copy_(torch.cat([fc[:, :h] * heads.feature_norm.weight.float() * inv["f"],
                                   fc[:, h:] * heads.embed_norm.weight.float() * inv["e"]], dim=1) * s[:, None])
    columns = old.input_layernorm.weight.float() * inv["x"] / s
    for name in ("q_proj", "k_proj", "v_proj"):
        src, dst = getattr(old.self_attn, name), getattr(mine.self_attn, name)
        dst.weight.copy_(src.weight.float() * columns)
        if src.bias is not None:
            dst.bias.copy_(src.bias.float())
    for src, dst in ((old.self_attn.o_proj, mine.self_attn.o_proj), (old.mlp.down_proj, mine.mlp.down_proj)):
        dst.weight.copy_(src.weight.float() * s[:, None])
        if src.bias is not None:
            dst.bias.copy_(src.bias.float() * s)
    mine.post_attention_layernorm.weight.copy_(old.post_attention_layernorm.weight.float() * scales.kappa / s)
    for name in ("gate_proj", "up_proj"):
        getattr(mine.mlp, name).load_state_dict(getattr(old.mlp, name).state_dict())
    new.d2t.copy_(heads.d2t)
    return new
