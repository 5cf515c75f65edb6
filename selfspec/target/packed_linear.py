"""The target's linear layers with their weights pre-packed for oneDNN's CPU matmul (memory-neutral, reversible).

On a CPU a decoding pass is the weights streamed once through a matmul: for k = 1..16 new tokens its time is the
time to read them. ``torch.nn.functional.linear`` reads a row-major weight; oneDNN reads a weight reordered
once into its own blocked layout faster (Qwen2.5-Coder-1.5B's linears, bf16, 2 cores: 1 row 174 ms -> 103 ms,
16 rows 252 -> 157 ms), which is what inductor's freezing and vLLM's CPU backend do to their weights.

    pack_linears(model)     every ``nn.Linear`` of the model becomes a ``PackedLinear`` holding the reordered
                            weight instead of the dense one (same bytes); output embeddings tied to the input
                            ones stay dense (the embedding lookup needs the dense rows)
    unpack_linears(model)   the dense ``nn.Linear`` modules back, bit for bit
    dense_linears(model)    a context: dense inside (e.g. to time stock ``transformers``), packed again after
                            (or, given the dense modules kept from before packing, swapped in and out)
    bound_linears(model,..) the row counts the exact pass's self-test allows a linear, set once as fields
                            (``max_rows``/``min_rows``; a dense linear becomes a ``RowBoundLinear``), kept
                            through unpacking and packing again

Under ``torch.compile`` a packed linear is one opaque operator, ``selfspec::packed_linear(x, key)``, that calls
the module's own packed matmul: inductor fuses the small operations around it (norms, rotary, residual adds)
while every graph shares the one packed copy of the weights. (Inductor's own "freezing" would pack a copy of
every weight into each graph: one copy per tree-size bucket, more than a 1.5B model's 24 GB machine holds.)

The packed weight computes the same products as the dense one (the tests check bit-equality on tiny models),
but oneDNN may block the reduction differently for other shapes: bf16 outputs can differ in the last bit, which
the bench's divergence diagnosis tells apart from a bug.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from itertools import chain, count

import torch
from torch import nn

BATCH_HINT = 16  # rows oneDNN lays the weight out for: measured fastest from 1 to 32 rows on this project's CPU
OUT_STEP = 64  # a dense 16-bit weight's output rows are padded to a multiple of this (``linear``)
ROW_BLOCK = 16384  # output rows per packed block (an LM head's vocabulary is split; the target's layers are not)


def packable(model: nn.Module) -> bool:
    """Whether this model's linears can be packed: CPU weights in float32 or bfloat16, oneDNN available."""
    weight = next((t for t in chain(model.parameters(), model.buffers()) if t.is_floating_point()), None)
    return (weight is not None and weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available())


def pack_weight(weight: torch.Tensor, batch_hint: int = BATCH_HINT) -> torch.Tensor:
    """``weight`` (out, in) reordered into oneDNN's blocked layout (an opaque tensor of the same bytes)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)


def _pointwise(x, packed, bias, *args):
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, *args)


def grid_rows(rows: int) -> int:
    """The row count a packed matmul of ``rows`` rows runs at: a power of two up to 8, then a multiple of 8 up to 256
    (the exact pass's self-tested ``ROW_SIZES``, which it leaves as they are), then of 64. oneDNN keeps one compiled
    kernel per input shape (its primitive cache: ~0.6 MiB each for SmolLM2's 576 x 1536 linear, up to 1,024 of
    them), so matmuls of every row count a server meets (a drafter's features, prompts of any length) grew its
    memory for hours; on this grid a weight meets at most ~50 shapes, all within the first minutes."""
    if rows <= 8:
        return 1 << max(rows - 1, 0).bit_length()
    step = 8 if rows <= 256 else 64
    return -(-rows // step) * step


def on_grid(matmul, x: torch.Tensor) -> torch.Tensor:
    """``matmul(x)`` over ``x``'s rows (every dimension but the last) run at :func:`grid_rows` rows: zero rows added,
    their outputs dropped (each row's result is that of the on-grid call)."""
    rows = x.numel() // x.shape[-1]
    padded = grid_rows(rows)
    if padded == rows:
        return matmul(x)
    out = matmul(torch.cat([x.reshape(rows, x.shape[-1]), x.new_zeros(padded - rows, x.shape[-1])]))[:rows]
    return out.view(*x.shape[:-1], out.shape[-1])


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, W, bias)`` with ``W`` from :func:`pack_weight`, on the grid of row counts."""
    return on_grid(lambda rows: _pointwise(rows, packed, bias, "none", [], ""), x)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` for a dense weight or one from :func:`pack_weight`, on the grid of shapes: rows as
    :func:`grid_rows`, and a dense 16-bit weight's output rows (a request's own context tokens: any number) padded
    to a multiple of ``OUT_STEP`` (on a CPU oneDNN runs 16-bit dense matmuls too, a kept kernel per shape; float32
    ones run through MKL, which keeps none)."""
    if weight.is_mkldnn:
        return packed_linear(x, weight, bias)
    if weight.dtype == torch.float32 or weight.device.type != "cpu":
        return nn.functional.linear(x, weight, bias)
    out, pad = weight.shape[0], -weight.shape[0] % OUT_STEP
    if pad:
        weight = torch.cat([weight, weight.new_zeros(pad, weight.shape[1])])
        bias = None if bias is None else torch.cat([bias, bias.new_zeros(pad)])
    return on_grid(lambda rows: nn.functional.linear(rows, weight, bias), x)[..., :out]


# the operator compiled graphs call: a key into the live packed modules (the module's packed weight is opaque to
# tracing, so the graph carries the key, and the call runs the module's eager forward)
_LIVE: dict[int, weakref.ReferenceType] = {}
_KEYS = count()
_LIB = torch.library.Library("selfspec", "DEF")
_LIB.define("packed_linear(Tensor x, int key) -> Tensor")


def _run_packed(x: torch.Tensor, key: int) -> torch.Tensor:
    module = _LIVE[key]()
    if module is None:
        raise RuntimeError(f"packed linear {key} was freed while a compiled graph still calls it")
    return module.eager_forward(x)


_LIB.impl("packed_linear", _run_packed, "CPU")


@torch.library.register_fake("selfspec::packed_linear")
def _packed_linear_shape(x: torch.Tensor, key: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], _LIVE[key]().out_features)


class PackedLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` in oneDNN's blocked layout; frozen (inference only). Its state dict is an
    ``nn.Linear``'s (``weight``, ``bias``, dense), so saving and loading a packed model work unchanged.

    A weight of more than ``ROW_BLOCK`` output rows (an LM head) is packed as blocks of rows, computed one after
    the other into one output: as fast as one block, and a drafter that needs a few dense rows of the LM head
    (``rows``) unpacks only the blocks holding them (~25 ms, not ~300 ms for a 150k-token vocabulary)."""

    def __init__(self, linear: nn.Linear, batch_hint: int = BATCH_HINT) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.dtype, self.batch_hint = linear.weight.dtype, batch_hint
        self.blocks = 0
        # row bounds (``within_rows``), set once by the exact pass (``bound_linears``), kept through unpacking
        self.max_rows, self.min_rows = getattr(linear, "max_rows", 0), getattr(linear, "min_rows", 1)
        self.key = next(_KEYS)
        _LIVE[self.key] = weakref.ref(self, lambda _, key=self.key: _LIVE.pop(key, None))
        self._pack(linear.weight)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach(), persistent=False)

    def _pack(self, weight: torch.Tensor) -> None:
        parts = weight.detach().split(ROW_BLOCK)
        for i, part in enumerate(parts):
            self.register_buffer(f"packed_{i}", pack_weight(part, self.batch_hint), persistent=False)
        self.blocks = len(parts)

    def packed_blocks(self) -> list[torch.Tensor]:
        """The packed weight, ``ROW_BLOCK`` output rows per block."""
        return [getattr(self, f"packed_{i}") for i in range(self.blocks)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # one opaque call in the graph (see the module's docstring)
            return torch.ops.selfspec.packed_linear(x, self.key)
        return self.eager_forward(x)

    def eager_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The packed matmul over ``x``'s rows (every dimension but the last), within the module's row bounds."""
        return within_rows(self._matmul, x, self.out_features, self.max_rows, self.min_rows)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.blocks == 1:
            return packed_linear(x, self.packed_0, self.bias)
        out = x.new_empty(*x.shape[:-1], self.out_features)
        for i, block in enumerate(self.packed_blocks()):
            lo = i * ROW_BLOCK
            bias = None if self.bias is None else self.bias[lo:lo + ROW_BLOCK]
            out[..., lo:lo + ROW_BLOCK] = packed_linear(x, block, bias)
        return out

    def rows(self, index: torch.Tensor | None = None) -> torch.Tensor:
        """Dense rows ``index`` of the weight (all of them if None): a copy, unpacking only the blocks needed."""
        if index is None:
            return torch.cat([b.to_dense() for b in self.packed_blocks()])
        index = index.cpu()
        out = torch.empty(index.numel(), self.in_features, dtype=self.dtype)
        for i in (index // ROW_BLOCK).unique().tolist():
            here = (index // ROW_BLOCK) == i
            out[here] = getattr(self, f"packed_{i}").to_dense().index_select(0, index[here] - i * ROW_BLOCK)
        return out

    def weight_numel(self) -> int:
        """Elements of the (packed) weight and bias."""
        return self.in_features * self.out_features + (0 if self.bias is None else self.bias.numel())

    def _save_to_state_dict(self, destination, prefix, keep_vars):  # an nn.Linear's keys and dense tensors
        destination[prefix + "weight"] = self.rows()
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        for name in ("weight", "bias") if self.bias is not None else ("weight",):
            if prefix + name not in state_dict:
                missing_keys.append(prefix + name)
        if prefix + "weight" in state_dict:
            self._pack(state_dict[prefix + "weight"].to(self.dtype))
        if self.bias is not None and prefix + "bias" in state_dict:
            self.bias = state_dict[prefix + "bias"].to(self.dtype)

    def to_linear(self) -> nn.Linear:
        """The dense ``nn.Linear`` this was packed from (bit-identical weights), with its row bounds if it has any."""
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        linear.weight = nn.Parameter(self.rows(), requires_grad=False)
        if self.bias is not None:
            linear.bias = nn.Parameter(self.bias, requires_grad=False)
        if (self.max_rows, self.min_rows) != (0, 1):
            return RowBoundLinear(linear, self.max_rows, self.min_rows)
        return linear

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, packed"


def within_rows(matmul, x: torch.Tensor, out_features: int, max_rows: int = 0, min_rows: int = 1) -> torch.Tensor:
    """``matmul`` over ``x``'s rows (every dimension but the last) on at most ``max_rows`` rows per call (0: no
    limit) and at least ``min_rows`` (zero rows added, their outputs dropped): the row counts a kernel was
    self-tested to give each row the bits of a plain step (``selfspec/target/exact.py``)."""
    rows = x.numel() // x.shape[-1]
    if not (max_rows and rows > max_rows) and rows >= min_rows:
        return matmul(x)
    flat = x.reshape(rows, x.shape[-1])
    parts = flat.split(max_rows) if max_rows else (flat,)
    out = torch.cat([matmul(part) if part.shape[0] >= min_rows else
                     matmul(torch.cat([part, part.new_zeros(min_rows - part.shape[0], part.shape[1])]))[:part.shape[0]]
                     for part in parts])
    return out.view(*x.shape[:-1], out_features)


class RowBoundLinear(nn.Linear):
    """A dense ``nn.Linear`` (sharing the wrapped one's weight and bias: a tied LM head stays tied) that runs within
    row bounds, as a ``PackedLinear`` does: at most ``max_rows`` rows per matmul, at least ``min_rows``."""

    def __init__(self, linear: nn.Linear, max_rows: int = 0, min_rows: int = 1) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.register_parameter("bias", linear.bias)
        self.max_rows, self.min_rows = max_rows, min_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return within_rows(lambda rows: nn.functional.linear(rows, self.weight, self.bias), x, self.out_features,
                           self.max_rows, self.min_rows)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, max_rows={self.max_rows}, min_rows={self.min_rows}"


def bound_linears(model: nn.Module, max_rows: dict[str, int], min_rows: dict[str, int]) -> None:
    """Give the linears named in ``max_rows`` / ``min_rows`` those row bounds, once: a packed one keeps them as
    fields, a dense one is replaced by a ``RowBoundLinear`` sharing its weight (already bounded ones are updated)."""
    swap = {}
    for name in {*max_rows, *min_rows}:
        module = model.get_submodule(name)
        bounds = max_rows.get(name, 0), min_rows.get(name, 1)
        if isinstance(module, (PackedLinear, RowBoundLinear)):
            module.max_rows, module.min_rows = bounds
        else:
            swap[name] = RowBoundLinear(module, *bounds)
    _swap(model, swap)


def tied_output(model: nn.Module) -> nn.Module | None:
    """The output embeddings when they share their weight with the input embeddings, else None."""
    if not hasattr(model, "get_output_embeddings"):
        return None
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    weight = getattr(out, "weight", None)
    if weight is None or inp is None or getattr(inp, "weight", None) is None:
        return None
    return out if weight.data_ptr() == inp.weight.data_ptr() else None


def _modules(model: nn.Module, kinds: tuple[type, ...]) -> dict[str, nn.Module]:
    """Submodules of ``kinds`` by qualified name, output embeddings tied to the input ones excepted."""
    skip = tied_output(model)
    return {name: m for name, m in model.named_modules() if isinstance(m, kinds) and m is not skip}


def _swap(model: nn.Module, modules: dict[str, nn.Module]) -> dict[str, nn.Module]:
    """Put ``modules`` in place by qualified name; returns those they replaced."""
    replaced = {}
    for name, module in modules.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        replaced[name] = getattr(parent, child)
        setattr(parent, child, module)
    return replaced


def is_packed(model: nn.Module) -> bool:
    """Whether ``pack_linears`` has packed this model."""
    return any(isinstance(m, PackedLinear) for m in model.modules())


@torch.no_grad()
def pack_linears(model: nn.Module, batch_hint: int = BATCH_HINT) -> int:
    """Pack every ``nn.Linear`` of ``model`` except output embeddings tied to the input ones, in place;
    returns how many. A no-op returning 0 where ``packable`` is false or the model is packed already."""
    if not packable(model) or is_packed(model):
        return 0
    return len(_swap(model, {n: PackedLinear(m, batch_hint) for n, m in _modules(model, (nn.Linear,)).items()}))


@torch.no_grad()
def unpack_linears(model: nn.Module) -> int:
    """Undo ``pack_linears``; returns how many modules went back to ``nn.Linear``."""
    return len(_swap(model, {n: m.to_linear() for n, m in _modules(model, (PackedLinear,)).items()}))


def linear_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The modules ``pack_linears`` packs (or has packed), by qualified name."""
    return _modules(model, (nn.Linear, PackedLinear))


@contextmanager
def dense_linears(model: nn.Module, kept: dict[str, nn.Module] | None = None):
    """Dense ``nn.Linear`` modules inside the block (stock ``transformers`` behaviour), packed again after.

    ``kept``: the dense modules, as :func:`linear_modules` returned them before packing (the caller keeps both
    layouts in memory); they are swapped in and out, nothing is converted. Without it every weight is unpacked
    and packed again: no extra memory, but a few seconds for a 1.5B model."""
    if not is_packed(model):
        yield model
        return
    if kept is not None:
        packed = _swap(model, kept)
        try:
            yield model
        finally:
            _swap(model, packed)
        return
    unpack_linears(model)
    try:
        yield model
    finally:
        pack_linears(model)
