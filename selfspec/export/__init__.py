"""Heads in the layouts serving engines load: vLLM's and SGLang's EAGLE-3 drafter, the speculators format, and
vLLM's MTP, EAGLE-1 and Medusa drafters.

    export_for_serving(heads_folder, out, "vllm" | "sglang" | "speculators", num_speculative_tokens=3)
    vllm_speculative_config(out)  # {"method": "eagle3" | "mtp" | "eagle" | "medusa", "model": out, ...}

writes ``out/config.json`` and ``out/model.safetensors`` (for vLLM also ``out/selfspec_vllm.json``: the method,
draft length and target overrides the export is served with, and the vLLM it was checked with; ``vllm.py``).
One module per drafter layout (``eagle3.py``, ``eagle_as_eagle3.py``, ``mtp.py``, ``eagle1.py``, ``medusa.py``). The ``eagle3`` family has a place in all three: its
tensors already carry the EAGLE-3 names (``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t`` as target id
minus draft id, ``t2d``), so the export is a copy (cast to ``dtype``), checked against the names and shapes
those engines' EAGLE-3 model classes declare (``expected_tensors``: their loaders drop unexpected tensors and
leave missing ones uninitialised without an error, so the check has to be here). The configs differ:

    vllm         a Llama config, ``architectures: [LlamaForCausalLMEagle3]``, ``draft_vocab_size``,
                 ``target_hidden_size`` and ``eagle_aux_hidden_state_layer_ids`` as indices into
                 ``hidden_states`` (vLLM captures the input of layer k: what selfspec's ``aux_layers`` mean)
    sglang       the same layout, the layer ids one less (SGLang and SpecForge capture after layer k)
    speculators  ``speculators_model_type: eagle3``, the layer config under ``transformer_layer_config``,
                 ``norm_before_residual: false`` written out (the format's default is true), the verifier
                 and a greedy proposal of ``num_speculative_tokens``; ``vllm serve OUT`` alone serves it

``eagle`` heads go to vLLM only. With their norms (the default) they go, by default, as vLLM's EAGLE-3 drafter
with two layers computing what the head computes (``_export_eagle_as_eagle3``: no aux states, the head's draft
vocabulary), or with ``layout="mtp"`` as the MTP layer vLLM runs for MiMo (``MiMoMTP``, method ``mtp``), which is
the head tensor for tensor: ``hidden_layernorm`` (feature_norm), ``token_layernorm`` (embed_norm), ``input_proj``
(fc, the same [feature; embedding] order), a Qwen2 decoder layer, ``final_layernorm``. vLLM builds that layer from
the *target's* config, so a Llama layer's q/k/v get zero biases, the MLP zero rows up to the target's width
(nothing added either way), the target's config needs ``num_nextn_predict_layers`` (``vllm_serve_flags``), and the
embedding and LM head are copied in for vLLM's loader (it then shares the target's). ``eagle`` heads built with
``norms=False`` (EAGLE-1's layout) go as vLLM's ``EagleLlamaForCausalLM`` (method ``eagle``): a one-layer Llama
config (``qkv_bias`` where the layer's q/k/v carry biases, as Qwen2's do), ``fc.weight`` with its two input halves
swapped (vLLM concatenates [embedding; feature], selfspec [feature; embedding]) and the layer as ``layers.0.*``;
the embedding and LM head are the target's, shared, and vLLM drafts over the whole vocabulary (``d2t`` stays
behind).

``medusa`` heads go to vLLM only (SGLang and speculators have no Medusa drafter): ``model_type: medusa``,
``blocks.{i}.layers.{j}.{weight,bias}`` (``medusa_fc_bias: true``), and the target's own LM head once as
``lm_heads.0.weight`` with ``original_lm_head: true`` (vLLM shares it among the heads, as selfspec does); vLLM
drafts a chain of each head's top-1 token, fed the target's final (normed) hidden state, as selfspec's heads
were trained. Other families refuse with one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..errors import SelfspecError
from ..checkpoint.format import check_heads_folder
from .eagle1 import export_eagle1
from .eagle3 import export_eagle3
from .eagle_as_eagle3 import export_eagle_as_eagle3
from .medusa import export_medusa
from .mtp import export_mtp
from .vllm import (misread_by_vllm, vllm_serve_flags, vllm_speculative_config, vllm_target_overrides,  # noqa: F401
                   write_settings)


FORMATS = ("vllm", "sglang", "speculators")


EAGLE_LAYOUTS = ("eagle3", "mtp")  # where normed eagle heads go in vLLM; the first is the default


def vllm_method(meta: dict[str, Any], layout: str | None = None) -> str | None:
    """The vLLM drafter a heads folder's metadata exports to (its ``speculative_config`` method), or None;
    ``layout`` picks one of ``EAGLE_LAYOUTS`` for normed eagle heads."""
    family = meta["family"]
    normed_eagle = family == "eagle" and meta["config"].get("norms") is not False
    if layout is not None and (not normed_eagle or layout not in EAGLE_LAYOUTS):
        raise SelfspecError(f"layout '{layout}' is for eagle heads with their norms, one of {', '.join(EAGLE_LAYOUTS)}")
    if family == "eagle":
        return (layout or EAGLE_LAYOUTS[0]) if normed_eagle else "eagle"
    return family if family in ("eagle3", "medusa") else None


def export_for_serving(folder: str | Path, out: str | Path, fmt: str = "vllm", base: str | None = None,
                       num_speculative_tokens: int = 3, dtype: torch.dtype = torch.bfloat16,
                       layout: str | None = None) -> Path:
    """Write the heads in ``folder`` as a drafter ``fmt`` loads (``layout``: see ``vllm_method``); returns ``out``.
    For vLLM the folder also gets ``SETTINGS``: the speculative config and target overrides the export was checked
    with, which ``vllm_speculative_config`` reads back instead of guessing them from the engine's config."""
    if fmt not in FORMATS:
        raise SelfspecError(f"unknown export format '{fmt}'; choose one of {', '.join(FORMATS)}")
    meta = check_heads_folder(folder)
    family = meta["family"]
    if family != "eagle3" and not (fmt == "vllm" and vllm_method(meta, layout)):
        why = {"eagle": f"{fmt} takes EAGLE-3 drafters only; train an eagle3 head (or export to vllm)",
               "medusa": f"{fmt} has no Medusa drafter (export to vllm)"}.get(
                   family, "only eagle3 heads (and medusa heads, for vllm) have a layout there")
        raise SelfspecError(f"{family} heads cannot be exported to {fmt}: {why}")
    method = vllm_method(meta, layout)
    out = Path(out)
    if fmt == "vllm" and method == "mtp" and misread_by_vllm(out):
        raise SelfspecError(f"vLLM would take {out} for an EAGLE drafter by its path (it contains 'eagle-', 'eagle3', "
                            "'dflash' or 'dspark'): export the MTP layout to a folder named otherwise")
    if fmt == "vllm" and family != "eagle3":
        export = {"medusa": export_medusa, "eagle": export_eagle1, "mtp": export_mtp, "eagle3": export_eagle_as_eagle3}
        export[method](folder, meta, out, base, dtype)
    else:
        export_eagle3(folder, meta, out, fmt, base, num_speculative_tokens, dtype)
    if fmt == "vllm":
        tokens = meta["config"]["num_heads"] if method == "medusa" else num_speculative_tokens
        write_settings(out, method, tokens)
    return out
