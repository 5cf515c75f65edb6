"""The exact target pass: every row of a pass computed as a one-token plain step computes it, bit for bit.

In bf16 a k-token pass rounds differently from k one-token passes, and a near-tie of the target's logits
can flip: speculative output then differs from plain decoding (in fp32 the same happens, only more rarely).
On the CPUs checked (``../shared/NOTES.md``) only attention changes a row's arithmetic with the pass: the
linears give every row the same bits for any number of rows up to a limit, norms, rotary and residual adds
work row by row. So the exact pass fixes how each query row attends:

    keys      a row at position p sees the cache, then its ancestors in depth order, then itself: exactly
              the p + 1 keys a plain step at p sees, in the same order (a chain's rows read the cache in place;
              a branching tree's rows gather their ancestors behind the cache)
    width     every call is ``width(p) = round_up(p + 1, WIDTH_STEP)`` keys wide, the rest masked, in the plain
              step too: the kernel's reduction depends on the width, so rows of equal width can share a call
    rows      each row's query heads are folded per K/V head (one block per K/V head, as the plain step folds
              them); rows of equal width that read the cache in place (a chain) stack their blocks in one call
              over the one K, rows with keys of their own are one batch entry each, where the start-up
              self-test finds that sharing a call leaves every row's bits as in a call of its own; else one
              call per row
    threads   torch's CPU attention kernel gives each thread a scratch buffer at an offset that depends on the
              number of query rows per K/V head and the width; where that offset is not 64-byte aligned, the
              same (row, head) computed by the second thread came out with other bits than by the first (one
              2-core CPU, real activations, widths = 0 or 3 mod 4), so a row's result depended on where in its
              call it landed. Each call's query block per K/V head is padded with zero rows (``query_rows``:
              a lone row of SmolLM2's 3 or Qwen2.5's 6 query heads per K/V head to 8; a chain's stacked rows
              to the next count that aligns), which aligns every thread's buffers
    linears   the self-test finds, per weight shape, the pass sizes (buckets) whose rows get the bits a plain step
              gives them: on the CPUs checked one row takes another kernel than 2 to 64 rows, so a plain step runs
              on two rows (its root and a padding row, as the smallest bucket); a packed linear row-variant above
              some bucket runs in chunks of that bucket; a dense one makes the pass inexact (said once)

The self-test runs a few matmuls of the model's own shapes at start-up, cached per device, dtype and shape
(``check_exact``): an assumption that holds on this CPU need not hold on another, or on a GPU.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.functional import scaled_dot_product_attention

log = logging.getLogger(__name__)

WIDTH_STEP = 32  # key widths are rounded up to this: fewer distinct widths (calls) per pass, <= 31 masked keys


def query_rows(group: int, head_dim: int) -> int:
    """Query rows per K/V head a call runs on (the group's own, then zeros): the fewest >= ``group`` for which the
    attention kernel's per-thread buffers, rows x (width + 2 + head_dim) floats and rows x width bf16 values, are
    whole 64-byte lines at every width that is a multiple of ``WIDTH_STEP`` (8 rows for head_dim 64 or 128)."""
    rows = group
    while rows < 32 and (rows * (head_dim + 2) * 4) % 64:
        rows += 1
    return rows


def width_for(position: int, slots: int) -> int:
    """Keys a query at ``position`` attends over (its own p + 1 and masked ones): the same in every pass."""
    return min(-(-(position + 1) // WIDTH_STEP) * WIDTH_STEP, slots)


@dataclass
class RowGroup:
    """Query rows of one pass that share a width, attended in one call."""

    rows: torch.Tensor  # (m,) long: the rows (tree nodes) of the pass
    width: int
    keys: torch.Tensor | None  # (m * width,) long cache slots, row by row; None: every row reads slots 0..width-1
    mask: torch.Tensor  # (m, 1, 1, width) additive: 0 for the p + 1 keys each row sees, dtype min after


@dataclass
class ExactPlan:
    """How every (non-padding) row of a pass attends; passed to the attention as ``selfspec_exact``."""

    groups: list[RowGroup]
    prepared: dict = field(default_factory=dict, repr=False, compare=False)  # its calls, built at the first layer


@dataclass
class BatchPlan:
    """A batched pass's plans: ``plans[i]`` for batch entry i (a request's row of the cache), None for a padding
    entry. Each entry attends over its own cache row exactly as that request's pass alone would; ``stacked``: groups
    of the same shape in different entries share one call (where the self-test found that keeps every row's bits)."""

    plans: list[ExactPlan | None]
    stacked: bool = True
    prepared: dict = field(default_factory=dict, repr=False, compare=False)  # its calls, built at the first layer


def ancestor_path(parents: list[int], node: int) -> list[int]:
    """``node``'s ancestors from the root down, then ``node`` itself."""
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def plan_pass(parents: list[int], depth: list[int], cache_len: int, slots: int, dtype: torch.dtype,
              device: torch.device, batched: bool = True) -> ExactPlan:
    """The plan for a pass over a tree (``parents``, ``depth``; node i written at slot cache_len + i) on a cache of
    ``slots`` slots. ``batched``: rows of a width share a call (those that read the cache in place apart from those
    whose keys are gathered); False: every row its own call."""
    calls: dict[tuple[int, bool], list[tuple[int, list[int] | None]]] = {}
    for node in range(len(parents)):
        path = ancestor_path(parents, node)
        in_place = path == list(range(node + 1))  # the row's keys are slots 0..position already: no copy
        calls.setdefault((width_for(cache_len + depth[node], slots), in_place), []).append(
            (node, None if in_place else path))
    groups = []
    for (width, _), members in calls.items():
        parts = [members] if batched else [[m] for m in members]
        groups += [_group(part, width, cache_len, dtype, device) for part in parts]
    return ExactPlan(groups)


def _group(members: list[tuple[int, list[int] | None]], width: int, cache_len: int, dtype: torch.dtype,
           device: torch.device) -> RowGroup:
    """Rows ``members`` (node, its path if its keys must be gathered) attending over ``width`` keys."""
    seen = torch.tensor([cache_len + (node if path is None else len(path) - 1) + 1 for node, path in members])
    mask = torch.where(torch.arange(width) < seen[:, None], 0.0, torch.finfo(dtype).min).to(dtype)[:, None, None]
    keys = None
    if any(path is not None for _, path in members):
        keys = torch.arange(width).repeat(len(members), 1)  # masked slots: any of the cache (weighted exactly 0)
        for r, (_, path) in enumerate(members):
            if path is not None:
                keys[r, cache_len:cache_len + len(path)] = cache_len + torch.tensor(path)
        keys = keys.flatten().to(device)
    return RowGroup(torch.tensor([node for node, _ in members], device=device), width, keys, mask.to(device))


def exact_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: ExactPlan | BatchPlan,
                    scale: float | None) -> torch.Tensor:
    """Attention of ``query`` (B, heads, q, d) over the cache ``key``/``value`` (B, kv_heads, slots, d), batch entry
    i by ``plan.plans[i]`` (an ``ExactPlan`` alone: a batch of one); returns (B, q, heads, d), zeros in the rows the
    plans leave out (padding). Groups of equal shape in different entries share one call where ``plan.stacked``."""
    b, heads, q, d = query.shape
    rows = query.transpose(1, 2)  # (B, q, heads, d)
    out = query.new_zeros(b, q, heads, d)
    for call in _calls(plan, b, heads, key.shape[1], d):
        (_attend_in_place if call.in_place else _attend_gathered)(call, rows, key, value, out, scale)
    return out


@dataclass
class _Call:
    """One attention call of a pass, prepared once for all its layers."""

    members: list[tuple[int, RowGroup]]  # (batch entry, its group)
    width: int
    in_place: bool  # the members read their entry's cache in place (else each row's keys are gathered)
    mask: torch.Tensor  # in place: (entries, 1, query rows, width); gathered: (rows, 1, 1, width)
    at: torch.Tensor | None = None  # in place: (entries, 1) batch entries
    which: torch.Tensor | None = None  # in place: (entries, m) each entry's rows
    every: bool = False  # in place: every batch entry, in order (the cache itself, no copy)
    n: int = 0  # in place: query rows per K/V head (the entries' blocks stacked, then zeros)


def _calls(plan: ExactPlan | BatchPlan, b: int, heads: int, kv: int, d: int) -> list[_Call]:
    """The calls of a pass by ``plan`` (its groups of equal shape in different entries together where it is
    stacked), with their masks and indices built once and kept on the plan for every layer."""
    key = (b, heads, kv, d)
    if key in plan.prepared:
        return plan.prepared[key]
    plans, stacked = (plan.plans, plan.stacked) if isinstance(plan, BatchPlan) else ([plan], False)
    group = heads // kv
    by_shape: dict[tuple, list[tuple[int, RowGroup]]] = {}
    for entry, p in enumerate(plans):
        for g in p.groups if p is not None else ():
            shape = (g.width, g.keys is None, g.rows.numel() if g.keys is None else 0)
            by_shape.setdefault(shape if stacked else (entry, id(g)), []).append((entry, g))
    calls = []
    for members in by_shape.values():
        width = members[0][1].width
        if members[0][1].keys is not None:
            calls.append(_Call(members, width, False, torch.cat([g.mask for _, g in members])))
            continue
        m = members[0][1].rows.numel()
        n = query_rows(m * group, d)
        mask = torch.stack([g.mask[:, 0, 0] for _, g in members]).repeat_interleave(group, 1)  # per query head
        mask = torch.cat([mask, mask[:, -1:].expand(-1, n - m * group, -1)], 1)[:, None]
        entries = [e for e, _ in members]
        at = torch.tensor(entries, device=mask.device)[:, None]
        calls.append(_Call(members, width, True, mask, at, torch.stack([g.rows for _, g in members]),
                           entries == list(range(b)), n))
    plan.prepared[key] = calls
    return calls


def _attend_in_place(call: _Call, rows: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor,
                     scale: float | None) -> None:
    """One call for groups (one per batch entry) of ``m`` rows each that read their entry's cache in place over the
    same width: each entry's query blocks stacked and padded once, over the entry's own K."""
    heads, d = rows.shape[2:]
    kv, (e, m) = key.shape[1], call.which.shape
    group = heads // kv
    q1 = rows.new_zeros(e, kv, call.n, d)
    q1[:, :, :m * group] = rows[call.at, call.which].view(e, m, kv, group, d).transpose(1, 2).reshape(
        e, kv, m * group, d)
    if call.every:  # every entry: the cache itself, not a copy
        k, v = key[:, :, :call.width], value[:, :, :call.width]
    else:
        k, v = key[:, :, :call.width].index_select(0, call.at[:, 0]), value[:, :, :call.width].index_select(
            0, call.at[:, 0])
    o = scaled_dot_product_attention(q1, k, v, attn_mask=call.mask, scale=scale)
    out[call.at, call.which] = o[:, :, :m * group].view(e, kv, m, group, d).transpose(1, 2).reshape(e, m, heads, d)


def _attend_gathered(call: _Call, rows: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor,
                     scale: float | None) -> None:
    """One call for rows with keys of their own (a branching tree's), over the same width: each row one batch entry,
    its keys gathered from its entry's cache."""
    heads, d = rows.shape[2:]
    kv, width = key.shape[1], call.width
    group = heads // kv
    qs, ks, vs = [], [], []
    for e, g in call.members:
        m = g.rows.numel()
        q1 = rows.new_zeros(m, kv, query_rows(group, d), d)
        q1[:, :, :group] = rows[e].index_select(0, g.rows).view(m, kv, group, d)
        qs.append(q1)
        ks.append(key[e].index_select(1, g.keys).view(kv, m, width, d).transpose(0, 1))  # (m, kv, width, d)
        vs.append(value[e].index_select(1, g.keys).view(kv, m, width, d).transpose(0, 1))
    one = len(call.members) == 1
    o = scaled_dot_product_attention(*(parts[0] if one else torch.cat(parts) for parts in (qs, ks, vs)),
                                     attn_mask=call.mask, scale=scale)
    start = 0
    for e, g in call.members:  # (m, kv, query rows, d) each
        m = g.rows.numel()
        out[e].index_copy_(0, g.rows, o[start:start + m, :, :group].reshape(m, heads, d))
        start += m


# --- the start-up self-test ------------------------------------------------------------------------------

_ROWS: dict[tuple, tuple[int, int]] = {}  # (device, dtype, kind, in, out, buckets) -> rows that keep each row's bits
_BATCHED: dict[tuple, bool] = {}  # (device, dtype, heads, kv_heads, head_dim) -> batching rows keeps their bits


def row_range(linear: nn.Module, in_features: int, buckets: tuple[int, ...], device: torch.device,
              dtype: torch.dtype) -> tuple[int, int]:
    """(least, most): a pass of ``b`` rows, for every bucket b from ``least`` to ``most``, gives each row the bits it
    gets in a pass of ``least`` rows (itself and a padding row when least is 2), for random inputs of a few scales.
    Kernels pick their path by the number of rows: on one CPU every bf16 linear of Qwen2.5-Coder-1.5B computes one
    row (a matrix-vector product) with other bits than 2 to 64 rows, which agree with each other; such a model's
    exact passes run on at least 2 rows (most = 1: none agree)."""
    key = (str(device), dtype, type(linear).__name__, in_features, getattr(linear, "out_features", None), buckets)
    if key not in _ROWS:
        rows = buckets[-1]
        out = getattr(linear, "out_features", None) or 1
        trials = max(1, min(6, 300_000 // (out * rows)))  # rounding differences are rare: look at enough outputs
        gen = torch.Generator().manual_seed(0)
        xs = [(torch.randn(rows, in_features, generator=gen) * 4.0 ** (t % 3 - 1)).to(device=device, dtype=dtype)
              for t in range(trials)]
        found = []
        with torch.no_grad():
            for least in (1, 2):
                refs = [torch.cat([linear(part) for part in x.split(least)]) for x in xs]  # each row in a least-row pass
                most = 0
                for b in (b for b in buckets if b >= least):
                    if not all(torch.equal(linear(x[:b]), ref[:b]) for x, ref in zip(xs, refs)):
                        break
                    most = b
                found.append((least, most))
                if most == buckets[-1]:
                    break
        _ROWS[key] = max(found, key=lambda lm: (lm[1], -lm[0]))
    return _ROWS[key]


def batching_keeps_rows(heads: int, kv_heads: int, head_dim: int, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``exact_attention`` gives every row the bits it gets in a call of its own (as the plain step runs it)
    when rows share calls: a 32-node chain (its query blocks stacked over one K) and a branching tree (each row its
    own keys), on caches of one to three key blocks; and requests of a batch whose groups of one shape share calls."""
    key = (str(device), dtype, heads, kv_heads, head_dim)
    if key not in _BATCHED:
        gen = torch.Generator().manual_seed(0)
        ok = True
        for cache_len, parents in ((40, [-1, *range(31)]), (500, [-1, *range(15)]), (1000, [-1, 0, 0, 1, 1, 2, 3, 3, 5, 4])):
            n, slots, depth = len(parents), 1088, _depths(parents)
            q = torch.randn(1, heads, n, head_dim, generator=gen).to(device=device, dtype=dtype)
            k = torch.randn(1, kv_heads, slots, head_dim, generator=gen).to(device=device, dtype=dtype)
            v = torch.randn(1, kv_heads, slots, head_dim, generator=gen).to(device=device, dtype=dtype)
            outs = [exact_attention(q, k, v, plan_pass(parents, depth, cache_len, slots, dtype, device, batched),
                                    head_dim ** -0.5) for batched in (True, False)]
            ok &= torch.equal(*outs)
        for rows in (((40, [-1]), (300, [-1]), (45, [-1]), (500, [-1, 0, 1, 2]), (1000, [-1, 0, 0, 1]), None),
                     ((40, [-1]), (41, [-1]), (50, [-1]))):  # requests of a batch: some groups shared, some not
            ok &= _stacking_keeps_rows(rows, heads, kv_heads, head_dim, device, dtype, gen)
        _BATCHED[key] = ok
    return _BATCHED[key]


def _depths(parents: list[int]) -> list[int]:
    """Each node's depth in a tree given by ``parents`` (parents first)."""
    depth = [0] * len(parents)
    for i, p in enumerate(parents[1:], 1):
        depth[i] = depth[p] + 1
    return depth


def _stacking_keeps_rows(rows: tuple, heads: int, kv_heads: int, head_dim: int, device: torch.device,
                         dtype: torch.dtype, gen: torch.Generator) -> bool:
    """A batch of requests (``rows``: (cache length, tree parents) each, None for padding) attended with equal
    groups of different requests stacked gives each request the bits of its own call."""
    slots, n = 1088, max(len(r[1]) for r in rows if r is not None)
    plans = []
    for r in rows:
        if r is None:
            plans.append(None)
            continue
        plans.append(plan_pass(r[1], _depths(r[1]), r[0], slots, dtype, device))
    q = torch.randn(len(rows), heads, n, head_dim, generator=gen).to(device=device, dtype=dtype)
    k = torch.randn(len(rows), kv_heads, slots, head_dim, generator=gen).to(device=device, dtype=dtype)
    v = torch.randn(len(rows), kv_heads, slots, head_dim, generator=gen).to(device=device, dtype=dtype)
    together = exact_attention(q, k, v, BatchPlan(plans), head_dim ** -0.5)
    return all(torch.equal(together[i:i + 1], exact_attention(q[i:i + 1], k[i:i + 1], v[i:i + 1], p, head_dim ** -0.5))
               for i, p in enumerate(plans) if p is not None)


@dataclass
class ExactSupport:
    """What the self-test found for one model: whether its passes can be exact, and how to run them."""

    exact: bool
    least: int = 1  # rows a pass runs on at least (a plain step's root and a padding row when 2)
    batched: bool = True  # rows of equal width share an attention call
    reason: str = ""  # why not exact
    chunked: dict[nn.Module, int] = field(default_factory=dict)  # packed linears run on at most that many rows


def check_exact(model: nn.Module, buckets: tuple[int, ...]) -> ExactSupport:
    """Run the self-test on ``model``'s shapes for passes padded to ``buckets`` rows (the LM head included)."""
    from .memory import attention_layout
    from .packed_linear import PackedLinear

    impl = getattr(model.config, "_attn_implementation", None) or "sdpa"
    if impl != "sdpa":
        return ExactSupport(False, reason=f"the model attends with '{impl}', not 'sdpa'")
    param = next(p for p in model.parameters() if p.is_floating_point())
    device, dtype = param.device, param.dtype
    found = {}
    for name, module in model.named_modules():
        if hasattr(module, "in_features") and hasattr(module, "out_features"):
            found[name, module] = row_range(module, module.in_features, buckets, device, dtype)  # cached per shape
    least = max(least for least, _ in found.values())
    chunked = {}
    for (name, module), (_, most) in found.items():
        if most < max(least, buckets[-1]) and (most < least or not isinstance(module, PackedLinear)):
            return ExactSupport(False, reason=f"{name} ({module.in_features} -> {module.out_features}) gives a row "
                                              f"other bits in a pass of more than {most} rows")
        if most < buckets[-1]:
            chunked[module] = most
    return ExactSupport(True, least, batching_keeps_rows(*attention_layout(model.config)[1:], device, dtype), chunked=chunked)


@contextmanager
def row_chunks(support: ExactSupport):
    """Inside, the packed linears the self-test found row-variant in large passes run in chunks that keep each row's
    bits."""
    for module, rows in support.chunked.items():
        module.max_rows = rows
    try:
        yield
    finally:
        for module in support.chunked:
            module.max_rows = 0


