"""Memory a drafter adds beside the target: counted from the tensors actually held, and predicted from configs.

    added bytes = drafter weights not shared with the target          (fixed)
                + the drafter's own KV cache                          (grows with the context)
                + the verification tree: its extra target-cache entries and logits (per step, transient)

*Counted* walks the drafter object and its per-request state and sums unique tensor storages that
are not the target's own. *Predicted* uses only configs and counts (no forward pass), so a memory
budget can be checked before anything is loaded on the device. ``max_context`` turns a budget into
the longest context each method can serve.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch
from torch import nn

from .errors import SelfspecError

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def weight_numel(model: nn.Module) -> int:
    """The model's parameter count, packed or not: a packed linear's weight and bias are buffers, not parameters,
    and it counts them itself (``weight_numel()``, ``selfspec/target/packed_linear.py``)."""
    packed = sum(m.weight_numel() for m in model.modules() if callable(getattr(m, "weight_numel", None)))
    return sum(p.numel() for p in model.parameters()) + packed


def parse_bytes(text: str | int) -> int:
    """'4GiB', '512MB', '1.5gib' or a plain number of bytes -> bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise SelfspecError(f"cannot read '{text}' as a memory size; write e.g. 4GiB, 512MiB, 2GB or a number of bytes")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_bytes(n: float) -> str:
    """Bytes in binary units, 3 significant digits."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    return f"{n} B"


def _tensors(obj, seen_objs: set[int]):
    """Every tensor reachable from ``obj`` through modules, caches, dataclasses, containers and attributes."""
    if id(obj) in seen_objs or obj is None or isinstance(obj, (str, bytes, int, float, bool, torch.dtype, torch.device)):
        return
    seen_objs.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, nn.Module):
        yield from obj.parameters()
        yield from obj.buffers()
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v, seen_objs)
    elif isinstance(obj, (list, tuple, set)):
        for v in obj:
            yield from _tensors(v, seen_objs)
    elif hasattr(obj, "layers") and hasattr(obj, "get_seq_length"):  # a transformers Cache
        for layer in obj.layers:
            for name in ("keys", "values"):
                t = getattr(layer, name, None)
                if isinstance(t, torch.Tensor):
                    yield t
    elif dataclasses.is_dataclass(obj) or hasattr(obj, "__dict__"):
        for v in vars(obj).values():
            yield from _tensors(v, seen_objs)


def _storage(t: torch.Tensor) -> tuple[int, int]:
    if t.is_mkldnn:  # an opaque packed weight (selfspec/target/packed_linear.py): no storage to ask, keyed by identity
        return id(t), t.numel() * t.element_size()
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def storages(obj) -> dict[int, int]:
    """Unique storages (pointer -> bytes) of the tensors reachable from ``obj``."""
    return dict(_storage(t) for t in _tensors(obj, set()) if t.device.type != "meta")


def counted_bytes(obj, exclude: dict[int, int] | None = None) -> int:
    """Bytes of the storages reachable from ``obj`` that are not in ``exclude`` (e.g. the target's)."""
    exclude = exclude or {}
    return sum(n for p, n in storages(obj).items() if p not in exclude)


def attention_layout(config) -> tuple[int, int, int, int]:
    """(layers, query heads, K/V heads, head dim) of a decoder's attention, from its (text) config."""
    tc = config.get_text_config(decoder=True)
    heads = tc.num_attention_heads
    kv_heads = getattr(tc, "num_key_value_heads", None) or heads
    return tc.num_hidden_layers, heads, kv_heads, getattr(tc, "head_dim", None) or tc.hidden_size // heads


def kv_bytes_per_token(config, dtype: torch.dtype, num_layers: int | None = None) -> int:
    """Keys + values of one token in a full-attention KV cache of ``num_layers`` (default: all) layers."""
    layers, _, kv_heads, head_dim = attention_layout(config)
    layers = layers if num_layers is None else num_layers
    return 2 * layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()




def model_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the model's first floating-point parameter."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


@dataclass
class MemoryEstimate:
    """Bytes of one component: fixed weights, KV per context token, transient per-step working set."""

    weights: int = 0
    kv_per_token: int = 0
    transient: int = 0

    def at(self, context: int) -> int:
        """Bytes at a context of ``context`` tokens."""
        return self.weights + self.kv_per_token * context + self.transient

    def __add__(self, other: MemoryEstimate) -> MemoryEstimate:
        return MemoryEstimate(self.weights + other.weights, self.kv_per_token + other.kv_per_token,
                              self.transient + other.transient)

    def to_dict(self) -> dict[str, int]:
        """Plain-JSON form."""
        return dataclasses.asdict(self)


def predict_target(target: nn.Module) -> MemoryEstimate:
    """The target alone: its weights and its KV cache per token (plain decoding's working set is ignored)."""
    dtype = model_dtype(target)
    weights = weight_numel(target) * torch.empty((), dtype=dtype).element_size()
    return MemoryEstimate(weights, kv_bytes_per_token(target.config, dtype))


def predict_added(target: nn.Module, drafter, max_nodes: int) -> MemoryEstimate:
    """What ``drafter`` (None: plain decoding) adds: its resident weights, its KV per token, the tree's transient bytes.

    The tree: ``max_nodes - 1`` drafted tokens in the target's cache during verification, and their
    logits (fp32) beside the one row plain decoding computes.
    """
    if drafter is None:
        return MemoryEstimate()
    dtype = model_dtype(target)
    size = torch.empty((), dtype=dtype).element_size()
    vocab = target.get_output_embeddings().out_features
    drafted = max_nodes - 1
    tree = drafted * (kv_bytes_per_token(target.config, dtype) + vocab * 4)
    return MemoryEstimate(drafter.extra_parameters() * size, drafter.kv_bytes_per_token(), tree)


def counted_added(target: nn.Module, drafter, state_bytes: int, tree_nodes: int) -> dict[str, int]:
    """Counted after a run: drafter tensors not shared with the target (``weights``), the peak bytes of its
    per-request state the engine saw (``kv_cache``), the largest tree's extra target-cache entries and logits."""
    if drafter is None:
        return {"weights": 0, "kv_cache": 0, "tree": 0, "total": 0}
    dtype = model_dtype(target)
    vocab = target.get_output_embeddings().out_features
    weights = counted_bytes(drafter, exclude=storages(target))
    tree = max(tree_nodes - 1, 0) * (kv_bytes_per_token(target.config, dtype) + vocab * 4)
    return {"weights": weights, "kv_cache": state_bytes, "tree": tree, "total": weights + state_bytes + tree}


def max_context(budget: int, total: MemoryEstimate, limit: int | None = None) -> int:
    """Longest context whose target + drafter memory fits ``budget`` (0 if not even the weights fit)."""
    room = budget - total.weights - total.transient
    if room <= 0:
        return 0
    n = room // total.kv_per_token if total.kv_per_token else (limit or 2**31)
    return int(min(n, limit) if limit else n)


def free_memory(device: torch.device) -> int | None:
    """Bytes free on ``device`` now (a GPU's free memory, or the CPU's available RAM; None where unknown)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
