"""The frozen target's parts that heads and their training objectives share: its text config, truncated configs and
decoders, placement, LM head rows; and the trained-parameter count. Outside ``heads/`` so that the objectives
(``selfspec/train/``), which ``heads`` registers, import none of ``heads``."""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from .errors import SelfspecError
from .target.packed_linear import PackedLinear


def text_config(config: PretrainedConfig) -> PretrainedConfig:
    """The decoder's own config (multimodal configs nest it; plain LMs return themselves)."""
    return config.get_text_config(decoder=True)


def config_with_layers(config: PretrainedConfig, num_layers: int, **overrides) -> PretrainedConfig:
    """A copy of ``config`` describing only its first ``num_layers`` decoder layers (plus ``overrides``)."""
    data = text_config(config).to_dict()
    data["num_hidden_layers"] = num_layers
    if data.get("layer_types"):  # per-layer attention kinds, one per layer
        data["layer_types"] = data["layer_types"][:num_layers]
    data.update(overrides)
    return type(text_config(config)).from_dict(data)


def trained_parameter_count(module: torch.nn.Module) -> int:
    """Parameters of ``module`` (what a heads checkpoint stores; integer buffers such as index maps excluded)."""
    return sum(p.numel() for p in module.parameters())


def placement(model: torch.nn.Module) -> tuple[torch.device, torch.dtype]:
    """Device and floating dtype of ``model``'s weights, for building heads beside it."""
    for p in model.parameters():
        if p.is_floating_point():
            return p.device, p.dtype
    raise SelfspecError(f"{type(model).__name__} has no floating-point weights to attach heads to")


def lm_head(model: torch.nn.Module) -> torch.nn.Module:
    """The target's frozen LM head: its ``nn.Linear``, or the ``PackedLinear`` the static pass made of it.
    Drafters look it up when they use it, so a head packed after they were built is the one they run."""
    head = model.get_output_embeddings()
    if not isinstance(head, (torch.nn.Linear, PackedLinear)):
        raise SelfspecError(f"{type(model).__name__}'s output layer is a {type(head).__name__}, not a Linear: "
                            "draft heads need a plain LM head")
    return head


def lm_head_rows(model: torch.nn.Module, rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Weight (and bias) of the target's frozen LM head, restricted to ``rows`` (a reduced draft vocabulary);
    dense: a copy where the static pass has packed the head (to run the whole head, call :func:`lm_head`)."""
    head = lm_head(model)
    if rows is not None:
        rows = rows.to(head.bias.device if head.bias is not None else "cpu")
    bias = None if head.bias is None or rows is None else head.bias.index_select(0, rows)
    if isinstance(head, PackedLinear):
        return head.rows(rows), head.bias if rows is None else bias
    if rows is None:
        return head.weight, head.bias
    return head.weight.index_select(0, rows.to(head.weight.device)), bias

def truncated_decoder(target: nn.Module, num_layers: int) -> nn.Module:
    """The target's base model cut to its first ``num_layers`` layers (+ final norm), sharing every module.

    The cut holds the target's own submodules (its first layers, embeddings, norm, rotary embedding), not
    copies of their tensors, so whatever later happens to a shared module (``selfspec/target/packed_linear.py``
    packing its linears) happens to both."""
    decoder = target.get_decoder()
    config = config_with_layers(target.config, num_layers, attn_implementation=decoder.config._attn_implementation)
    with torch.device("meta"):
        cut = type(decoder)(config)
    for name, child in list(cut.named_children()):
        source = getattr(decoder, name, None)
        if isinstance(child, nn.ModuleList) and isinstance(source, nn.ModuleList) and len(source) >= len(child):
            setattr(cut, name, nn.ModuleList(source[:len(child)]))
        elif type(source) is type(child):
            setattr(cut, name, source)
        else:
            raise SelfspecError(f"early exit cannot share '{name}' with {type(target).__name__}: "
                                "its truncated copy does not have the same modules")
    persistent = set(cut.state_dict())
    for name, _ in list(cut.named_buffers(recurse=False)):
        cut.register_buffer(name, decoder.get_buffer(name), persistent=name in persistent)
    if any(t.is_meta for t in (*cut.parameters(), *cut.buffers())):
        raise SelfspecError(f"early exit could not share every tensor of {type(target).__name__}")
    return cut.eval()
