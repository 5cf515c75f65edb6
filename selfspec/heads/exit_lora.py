"""LoRA on the target's first L layers, for early-exit drafting (LayerSkip's lesson: the early layers themselves
must learn to exit, which an adapter after them cannot make up for).

The trained part is the low-rank pairs only: for each layer i < L and each projection p of ``PROJECTIONS``,
``lora_A`` (r, in) and ``lora_B`` (out, r), B zero at the start, so an untrained adapter drafts what the plain
exit drafts. The drafting model (:func:`lora_decoder`) is the target's first L layers with every adapted
projection computing ``base(x) + alpha / r * B(A(x))`` (peft's LoRA): its layer and block modules are shallow
copies whose leaf linears are the target's own (dense, or packed by the static pass), so no weight is copied and
the target's module tree, which verification runs, never holds the adapter. As the adapter changes what layers
< L compute, the drafter keeps its own L-layer KV cache (counted in the memory accounting).

A checkpoint also carries the pairs as a standard peft adapter folder, ``peft/`` (:func:`write_peft_folder`:
``adapter_config.json`` from peft's own ``LoraConfig``, ``adapter_model.safetensors`` under the base model's
module names), so ``PeftModel.from_pretrained(base, heads_folder / "peft")`` puts the same adapter on the full
model. The exit norm is the target's (LoRA adapts linear layers; a norm is not one).
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import torch
from torch import nn
from transformers import PretrainedConfig

from ..errors import SelfspecError
from ..frozen import text_config

# the linear layers of a Llama-style decoder layer (Llama, Qwen2, Mistral, SmolLM2, ...), each adapted
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PEFT_FOLDER = "peft"


def projection_shapes(target_config: PretrainedConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each adapted projection of one decoder layer."""
    tc = text_config(target_config)
    h, heads = tc.hidden_size, tc.num_attention_heads
    kv = getattr(tc, "num_key_value_heads", None) or heads
    dim = getattr(tc, "head_dim", None) or h // heads
    inter = tc.intermediate_size
    return {"q_proj": (h, heads * dim), "k_proj": (h, kv * dim), "v_proj": (h, kv * dim), "o_proj": (heads * dim, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}


class LoraPair(nn.Module):
    """``B(A(x))`` with peft's initialisation: A Kaiming-uniform, B zero."""

    def __init__(self, in_features: int, out_features: int, rank: int) -> None:
        super().__init__()
        self.lora_A = nn.Linear(in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, out_features, bias=False)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=5 ** 0.5)
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lora_B(self.lora_A(x))


class LoraLinear(nn.Module):
    """A target projection (shared, frozen) plus its scaled low-rank update."""

    def __init__(self, base: nn.Module, pair: LoraPair, scaling: float) -> None:
        super().__init__()
        self.base, self.pair, self.scaling = base, pair, scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        return out + (self.pair(x.to(self.pair.lora_A.weight.dtype)) * self.scaling).to(out.dtype)


def build_pairs(target_config: PretrainedConfig, num_layers: int, rank: int) -> nn.ModuleList:
    """``pairs[i][p]``: layer i's pair for projection p."""
    shapes = projection_shapes(target_config)
    return nn.ModuleList(nn.ModuleDict({p: LoraPair(*shapes[p], rank) for p in PROJECTIONS})
                         for _ in range(num_layers))


def _shallow(module: nn.Module) -> nn.Module:
    """A new module object with the same parameters, buffers and children (its child table its own)."""
    new = copy.copy(module)
    new._modules, new._parameters, new._buffers = dict(module._modules), dict(module._parameters), dict(module._buffers)
    return new


def adapted_layer(layer: nn.Module, pairs: nn.ModuleDict, scaling: float) -> nn.Module:
    """A shallow copy of decoder ``layer`` whose projections named in ``pairs`` carry them; ``layer`` is untouched."""
    new, copied = _shallow(layer), {}
    for path, module in layer.named_modules():
        parent_path, _, leaf = path.rpartition(".")
        if leaf not in pairs:
            continue
        parent = new
        for i, name in enumerate(parent_path.split(".") if parent_path else []):
            key = ".".join(parent_path.split(".")[:i + 1])
            if key not in copied:
                copied[key] = parent._modules[name] = _shallow(parent._modules[name])
            parent = copied[key]
        parent._modules[leaf] = LoraLinear(module, pairs[leaf], scaling)
    found = {name.rpartition(".")[2] for name, m in new.named_modules() if isinstance(m, LoraLinear)}
    if found != set(pairs):
        raise SelfspecError(f"a LoRA exit adapter needs the projections {sorted(pairs)} in each decoder layer; "
                            f"{type(layer).__name__} lacks {sorted(set(pairs) - found)}")
    return new


def lora_decoder(cut: nn.Module, adapter: nn.Module) -> nn.Module:
    """``cut`` (the target's first L layers + final norm, sharing its modules: ``frozen.truncated_decoder``)
    with ``adapter``'s LoRA pairs active in shallow copies of its layers; shares every weight."""
    for name, child in list(cut.named_children()):
        if isinstance(child, nn.ModuleList) and len(child) == len(adapter.lora):
            setattr(cut, name, nn.ModuleList(adapted_layer(layer, pairs, adapter.scaling)
                                             for layer, pairs in zip(child, adapter.lora)))
            return cut
    raise SelfspecError(f"could not find the decoder layers of {type(cut).__name__} to adapt")


def _module_names(target: nn.Module, num_layers: int) -> dict[tuple[int, str], str]:
    """(layer, projection) -> the projection's module name in ``target`` (what peft's adapter keys use)."""
    pattern = re.compile(rf"^(.*\.)?layers\.(\d+)\.(.*\.)?({'|'.join(PROJECTIONS)})$")
    names = {}
    for name, _ in target.named_modules():
        m = pattern.match(name)
        if m and int(m.group(2)) < num_layers:
            names[(int(m.group(2)), m.group(4))] = name
    return names


def write_peft_folder(adapter: nn.Module, target: nn.Module, folder: str | Path, base_name: str | None) -> Path:
    """``folder/peft``: the adapter as peft writes a LoRA adapter of ``target`` (config + safetensors)."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    out = Path(folder) / PEFT_FOLDER
    num_layers, config = len(adapter.lora), adapter.config
    names = _module_names(target, num_layers)
    if len(names) != num_layers * len(PROJECTIONS):
        raise SelfspecError(f"{type(target).__name__} does not name its projections as a Llama-style model does: "
                            "no peft folder can be written for it")
    LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha, target_modules=list(PROJECTIONS),
               layers_to_transform=list(range(num_layers)), lora_dropout=0.0, bias="none", task_type="CAUSAL_LM",
               base_model_name_or_path=base_name).save_pretrained(str(out))
    tensors = {f"base_model.model.{names[(i, p)]}.{ab}.weight": getattr(pair, ab).weight.detach().cpu().contiguous()
               for i, pairs in enumerate(adapter.lora) for p, pair in pairs.items() for ab in ("lora_A", "lora_B")}
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    return out
