"""The exact target pass: every row of a pass computed as a one-token plain step computes it, bit for bit.

In bf16 a k-token pass rounds differently from k one-token passes, and a near-tie of the target's logits
can flip: speculative output then differs from plain decoding (in fp32 the same happens, only more rarely).
On the CPUs checked (``../shared/NOTES.md``) only attention changes a row's arithmetic with the pass: the
linears give every row the same bits for any number of rows up to a limit, norms, rotary and residual adds
work row by row. So the exact pass fixes how each query row attends:

    keys      a row at position p sees the cache, then its ancestors in depth order, then itself: exactly
              the p + 1 keys a plain step at p sees, in the same order
    kernel    on an AVX-512 CPU the row attention kernel (``selfspec/target/row_attention.py``) attends every row of a
              pass over its own keys in one call per layer, each row's bits independent of the call by
              construction; the rules below are how torch's attention kernel is used where it is not built.
    paths     the tree is covered by paths: the chain after the root (in slot order) reads the cache in place;
              every other path (from its first node down its first children) has its keys, the cache then the
              path's nodes, gathered once for its rows
    width     every call is ``width(p) = round_up(p + 1, WIDTH_STEP)`` keys wide, the rest masked, in the plain
              step too: the kernel's reduction depends on the width, so rows of equal width can share a call
    rows      each row's query heads are folded per K/V head (one block per K/V head, as the plain step folds
              them); a path's rows of one width stack their blocks over its one K, and paths of one width (and
              as many query rows once padded) share a call, a batch entry each, where the start-up self-test
              finds that sharing a call leaves every row's bits as in a call of its own; else one call per row
    threads   torch's CPU attention kernel gives each thread a scratch buffer at an offset that depends on the
              number of query rows per K/V head and the width; where that offset is not 64-byte aligned, the
              same (row, head) computed by the second thread came out with other bits than by the first (one
              2-core CPU, real activations, widths = 0 or 3 mod 4), so a row's result depended on where in its
              call it landed. Each call's query block per K/V head is padded with zero rows (``query_rows``:
              a lone row of SmolLM2's 3 or Qwen2.5's 6 query heads per K/V head to 8; a chain's stacked rows
              to the next count that aligns), which aligns every thread's buffers
    linears   the self-test finds, per weight shape, the row counts of the row grid (``ROW_SIZES``: 1, 2, 4, then
              multiples of 8 up to 256, the counts every exact forward is padded to) whose rows get the bits a
              plain step gives them: on the CPUs checked some shapes compute one row (a
              matrix-vector product) with other bits than 2 to 64 rows (every linear of Qwen2.5-Coder-1.5B, only
              the MLP's down projection of SmolLM2-135M); such a packed linear runs a lone row beside a zero row
              (``padded``), and where every linear needs it the pass itself runs on two rows (its root and a
              padding row); a linear row-variant above some size (on an AMX CPU, SmolLM2's tied LM head above 32
              rows in bf16) runs in chunks of that size, packed or dense; a dense one row-variant below the
              pass's least rows makes the pass inexact (said once). These bounds are set on the linears once, when
              the pass is built (``packed_linear.bound_linears``), not around each pass

The self-test runs a few matmuls of the model's own shapes at start-up, cached per device, dtype and shape
(``check_exact``): an assumption that holds on this CPU need not hold on another, or on a GPU.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.functional import scaled_dot_product_attention

from . import row_attention
from ..disk_cache import cached, machine

log = logging.getLogger(__name__)

# The row grid: the token counts every exact forward runs on (a prompt's chunk, one request's tree, a batch's rows x
# nodes), each one self-tested. A forward of more than ROW_MAX tokens runs in parts of at most ROW_MAX.
ROW_MAX = 256
ROW_STEP = 8
ROW_SIZES = (*(1 << i for i in range(ROW_STEP.bit_length() - 1)),  # powers of two below ROW_STEP, then its multiples
             *range(ROW_STEP, ROW_MAX + 1, ROW_STEP))


def on_grid(tokens: int) -> bool:
    """Whether a forward of ``tokens`` rows is on the row grid (in parts of at most ``ROW_MAX`` where larger)."""
    return tokens in ROW_SIZES or tokens % ROW_STEP == 0
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
    """Query rows of one pass along one root-to-leaf path that share a width: one key sequence serves them all,
    each row seeing its prefix of it."""

    rows: torch.Tensor  # (m,) long: the rows (tree nodes) of the pass, by depth
    width: int
    keys: torch.Tensor | None  # (width,) long cache slots: the cache, then the path; None: slots 0..width-1 in place
    mask: torch.Tensor  # (m, 1, 1, width) additive: 0 for the p + 1 keys each row sees, dtype min after


@dataclass
class ExactPlan:
    """How every (non-padding) row of a pass over a tree attends (node i written at slot cache_len + i of a cache of
    ``slots`` slots); passed to the attention as ``selfspec_exact``. The row attention kernel reads the tree itself;
    torch's kernel reads ``groups``, built at first use."""

    parents: list[int]
    depth: list[int]
    cache_len: int
    slots: int
    dtype: torch.dtype
    device: torch.device
    stacked: bool = True  # groups of one width share a call (where the self-test found that keeps every row's bits)
    prepared: dict = field(default_factory=dict, repr=False, compare=False)  # its calls, built at the first layer

    @property
    def tree(self) -> tuple[int, list[int]]:
        """(cache length, parents): what the row attention kernel needs."""
        return self.cache_len, self.parents

    @property
    def groups(self) -> list[RowGroup]:
        if "groups" not in self.prepared:
            self.prepared["groups"] = cover(self)
        return self.prepared["groups"]


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
    ``slots`` slots. ``batched``: groups of a width share a call; False: every row is a group and a call of its
    own."""
    return ExactPlan(list(parents), list(depth), cache_len, slots, dtype, device, batched)


def cover(plan: ExactPlan) -> list[RowGroup]:
    """The plan's groups for torch's kernel. The tree is covered by paths: the rows that read the cache in place (the
    root and the chain that follows it in slot order), then, for each other node not yet covered, the path down its
    first children; a path's rows of one width are a group, whose keys (the cache, then the path's nodes) are
    gathered once."""
    parents, depth, cache_len = plan.parents, plan.depth, plan.cache_len
    children: list[list[int]] = [[] for _ in parents]
    for node, parent in enumerate(parents[1:], 1):
        children[parent].append(node)
    in_place = 1
    while in_place < len(parents) and parents[in_place] == in_place - 1:
        in_place += 1
    paths, covered = [list(range(in_place))], set(range(in_place))
    for node in range(len(parents)):
        if node not in covered:
            path = [node]
            while children[path[-1]]:
                path.append(children[path[-1]][0])
            paths.append(path)
            covered.update(path)
    groups = []
    for i, path in enumerate(paths):
        keys = None
        if i:  # the cache, then every node from the root to the path's end, at their slots
            full = [*ancestor_path(parents, path[0])[:-1], *path]
            keys = torch.arange(cache_len + len(full))
            keys[cache_len:] = cache_len + torch.tensor(full)
        by_width: dict[int, list[int]] = {}
        for node in path:
            by_width.setdefault(width_for(cache_len + depth[node], plan.slots), []).append(node)
        for width, rows in by_width.items():
            for part in [rows] if plan.stacked else [[r] for r in rows]:
                groups.append(_group(part, [depth[r] for r in part], width, cache_len, keys, plan.dtype, plan.device))
    return groups


def _group(rows: list[int], depths: list[int], width: int, cache_len: int, keys: torch.Tensor | None,
           dtype: torch.dtype, device: torch.device) -> RowGroup:
    """Rows ``rows`` of one path (at ``depths``) attending over ``width`` keys: in place (``keys`` None) or the path's
    ``keys`` (cache slots, cache first), padded to the width with the first slots (masked: weighted exactly 0)."""
    seen = torch.tensor([cache_len + d + 1 for d in depths])
    mask = torch.where(torch.arange(width) < seen[:, None], 0.0, torch.finfo(dtype).min).to(dtype)[:, None, None]
    if keys is not None:
        keys = torch.cat([keys[:width], torch.arange(max(0, width - keys.numel()))]).to(device)
    return RowGroup(torch.tensor(rows, device=device), width, keys, mask.to(device))


def exact_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: ExactPlan | BatchPlan,
                    scale: float | None) -> torch.Tensor:
    """Attention of ``query`` (B, heads, q, d) over the cache ``key``/``value`` (B, kv_heads, slots, d), batch entry
    i by ``plan.plans[i]`` (an ``ExactPlan`` alone: a batch of one); returns (B, q, heads, d), zeros in the rows the
    plans leave out (padding). Groups of one shape share a call where the plan is stacked."""
    b, heads, q, d = query.shape
    if "rows" not in plan.prepared:  # decided once per pass, not in every layer
        plans = plan.plans if isinstance(plan, BatchPlan) else [plan]
        rows = row_attention.used(query.device, query.dtype, (heads, key.shape[1], d))
        plan.prepared["rows"] = row_attention.row_keys([p and p.tree for p in plans], q) if rows else None
    if plan.prepared["rows"] is not None:
        return row_attention.attend(query, key, value, plan.prepared["rows"], scale)
    calls = _calls(plan, b, q, heads, key.shape[1], d)
    if len(calls) == 1 and calls[0].run == (0, b) and calls[0].span == (0, q):  # one call over every row
        return _attend(calls[0], query, key, value, scale)
    out = query.new_zeros(b, q, heads, d)
    for call in calls:
        rows = _attend(call, query, key, value, scale)
        if call.span is not None and call.run is not None:
            out[call.run[0]:call.run[1], call.span[0]:call.span[1]] = rows
        elif call.src is None:
            out[call.at, call.which] = rows
        else:
            out.view(-1, heads, d).index_copy_(0, call.dst, rows.reshape(-1, heads, d).index_select(0, call.src))
    return out


@dataclass
class _Call:
    """One attention call of a pass, prepared once for all its layers: one batch entry per group, each group's query
    blocks stacked (``m`` rows, padded to the call's largest group with copies of its last row), then zero rows up
    to ``n`` per K/V head."""

    members: list[tuple[int, RowGroup]]  # (batch entry, its group): one entry of the call each
    width: int
    in_place: bool  # the members read their entry's cache in place (else each group's keys are gathered)
    mask: torch.Tensor  # (members, 1, n, width)
    at: torch.Tensor  # (members, 1) batch entries
    which: torch.Tensor  # (members, m) each member's rows
    n: int  # query rows per K/V head
    run: tuple[int, int] | None = None  # in place: the members are batch entries a..z-1 in order (their cache, no copy)
    span: tuple[int, int] | None = None  # in place: every entry's rows are lo..hi-1 (sliced, not indexed)
    src: torch.Tensor | None = None  # groups of unequal sizes: the call's real rows (of members x m) ...
    dst: torch.Tensor | None = None  # ... and where they go in the (B x q) rows of the output
    buffer: torch.Tensor | None = None  # the zero-padded query blocks, reused by every layer


def _calls(plan: ExactPlan | BatchPlan, b: int, q: int, heads: int, kv: int, d: int) -> list[_Call]:
    """The calls of a pass by ``plan`` (its groups of equal shape together where it is stacked), with their masks
    and indices built once and kept on the plan for every layer."""
    key = (b, q, heads, kv, d)
    if key in plan.prepared:
        return plan.prepared[key]
    plans = plan.plans if isinstance(plan, BatchPlan) else [plan]
    by_shape: dict[tuple, list[tuple[int, RowGroup]]] = {}
    for entry, p in enumerate(plans):
        for g in p.groups if p is not None else ():
            m = g.rows.numel()  # in place: groups of m rows; gathered: groups padded to the same query rows
            shape = (g.width, g.keys is None, m if g.keys is None else query_rows(m * (heads // kv), d))
            by_shape.setdefault(shape if plan.stacked else (entry, id(g)), []).append((entry, g))
    plan.prepared[key] = [_call(members, b, q, heads // kv, d) for members in by_shape.values()]
    return plan.prepared[key]


def _call(members: list[tuple[int, RowGroup]], b: int, q: int, group: int, d: int) -> _Call:
    """The call attending ``members`` (groups of one width) in a pass of ``b`` entries of ``q`` rows."""
    width, in_place = members[0][1].width, members[0][1].keys is None
    sizes = [g.rows.numel() for _, g in members]
    m = max(sizes)
    n = query_rows(m * group, d)
    pad = [torch.arange(m).clamp(max=size - 1) for size in sizes]  # each member's rows, its last one repeated
    mask = torch.stack([g.mask[idx, 0, 0].to(torch.device("cpu")) for (_, g), idx in zip(members, pad)])
    mask = mask.repeat_interleave(group, 1)  # (members, m * group, width): one row per query head
    mask = torch.cat([mask, mask[:, -1:].expand(-1, n - m * group, -1)], 1)[:, None]
    device = members[0][1].rows.device
    entries = [e for e, _ in members]
    which = torch.stack([g.rows.to(torch.device("cpu"))[idx] for (_, g), idx in zip(members, pad)])
    call = _Call(members, width, in_place, mask.to(device), torch.tensor(entries, device=device)[:, None],
                 which.to(device), n)
    if in_place and entries == list(range(entries[0], entries[-1] + 1)):
        call.run = (entries[0], entries[-1] + 1)
    if min(sizes) < m:
        call.src = torch.tensor([i * m + j for i, size in enumerate(sizes) for j in range(size)], device=device)
        call.dst = torch.cat([e * q + g.rows.to(torch.device("cpu")) for e, g in members]).to(device)
    elif in_place:
        lo = int(which[0, 0])
        if bool((which == torch.arange(lo, lo + m)).all()):
            call.span = (lo, lo + m)
    return call


def _keys(call: _Call, cache: torch.Tensor) -> torch.Tensor:
    """The call's keys (or values) from the cache (B, kv, slots, d): (members, kv, width, d)."""
    if call.in_place:
        if call.run is not None:
            return cache[call.run[0]:call.run[1], :, :call.width]
        return cache[:, :, :call.width].index_select(0, call.at[:, 0])
    kv, d = cache.shape[1], cache.shape[3]
    parts, start = [], 0
    while start < len(call.members):  # one gather per batch entry, its members' keys one after the other
        entry = call.members[start][0]
        end = start
        while end < len(call.members) and call.members[end][0] == entry:
            end += 1
        keys = torch.cat([g.keys for _, g in call.members[start:end]])
        parts.append(cache[entry].index_select(1, keys).view(kv, end - start, call.width, d).transpose(0, 1))
        start = end
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _attend(call: _Call, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None
            ) -> torch.Tensor:
    """One call: each member's query blocks stacked into the call's zero-padded buffer (sliced from ``query`` where
    the members are a run of entries with the same rows, else indexed), attended over its keys; returns the
    members' rows (members, m, heads, d)."""
    (_, heads, _, d), kv = query.shape, key.shape[1]
    (e, m), group = call.which.shape, heads // kv
    if call.buffer is None:
        call.buffer = query.new_zeros(e, kv, call.n, d)  # rows past m * group stay zero, for every layer
    blocks = call.buffer[:, :, :m * group].view(e, kv, m, group, d)
    if call.span is not None and call.run is not None:
        (a, z), (lo, hi) = call.run, call.span
        blocks.copy_(query[a:z, :, lo:hi].view(e, kv, group, m, d).transpose(2, 3))
    else:
        blocks.copy_(query.transpose(1, 2)[call.at, call.which].view(e, m, kv, group, d).transpose(1, 2))
    o = scaled_dot_product_attention(call.buffer, _keys(call, key), _keys(call, value), attn_mask=call.mask,
                                     scale=scale)
    return o[:, :, :m * group].view(e, kv, m, group, d).transpose(1, 2).reshape(e, m, heads, d)


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
        _ROWS[key] = tuple(on_disk("row_range", key, lambda: _row_range(linear, in_features, buckets, device, dtype)))
    return _ROWS[key]


def on_disk(test: str, key: tuple, run):
    """``run()``'s verdict, measured once per machine on a CPU and read back from ``$SELFSPEC_HOME/selftest/``
    after (``selfspec/disk_cache.py``: keyed by the CPU's model and flags, torch's version, the thread count, the
    row kernel's build and ``key``); measured in every process elsewhere (a GPU's would need its model in the key)."""
    if torch.device(key[0]).type != "cpu":
        return run()
    kernel = row_attention.build_name() if row_attention.kernel() is not None else None
    where = {**machine(), "threads": torch.get_num_threads(), "row_kernel": kernel}
    return cached("selftest", {"test": test, **where, "args": [str(k) for k in key]}, lambda: (run(), {}))[0]


def _row_range(linear: nn.Module, in_features: int, buckets: tuple[int, ...], device: torch.device,
               dtype: torch.dtype) -> tuple[int, int]:
    """``row_range``, measured."""
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
    return max(found, key=lambda lm: (lm[1], -lm[0]))


def batching_keeps_rows(heads: int, kv_heads: int, head_dim: int, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``exact_attention`` gives every row the bits it gets in a call of its own (as the plain step runs it)
    when rows share calls: a 32-node chain (its query blocks stacked over one K) and a branching tree (each row its
    own keys), on caches of one to three key blocks; and requests of a batch whose groups of one shape share calls."""
    key = (str(device), dtype, heads, kv_heads, head_dim)
    if key not in _BATCHED:
        _BATCHED[key] = bool(on_disk("batching_keeps_rows", key,
                                     lambda: _batching_keeps_rows(heads, kv_heads, head_dim, device, dtype)))
    return _BATCHED[key]


def _batching_keeps_rows(heads: int, kv_heads: int, head_dim: int, device: torch.device, dtype: torch.dtype) -> bool:
    """``batching_keeps_rows``, measured."""
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
    return ok


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
    fast: int = 1  # tokens a pass runs on at least for speed (>= least; ``fastest_rows``)
    batched: bool = True  # rows of equal width share an attention call
    reason: str = ""  # why not exact
    chunked: dict[str, int] = field(default_factory=dict)  # linears (by name) run on at most that many rows
    padded: dict[str, int] = field(default_factory=dict)  # packed linears (by name) run on at least that many rows

    def bound(self, model: nn.Module) -> None:
        """Set these row bounds on ``model``'s linears, once (``packed_linear.bound_linears``)."""
        from .packed_linear import bound_linears

        bound_linears(model, self.chunked, self.padded)


def check_exact(model: nn.Module) -> ExactSupport:
    """Run the self-test on ``model``'s shapes for forwards of the row grid's sizes (the LM head included)."""
    from ..memory import attention_layout
    from .packed_linear import PackedLinear

    impl = getattr(model.config, "_attn_implementation", None) or "sdpa"
    if impl != "sdpa":
        return ExactSupport(False, reason=f"the model attends with '{impl}', not 'sdpa'")
    param = next(p for p in model.parameters() if p.is_floating_point())
    device, dtype = param.device, param.dtype
    found = {}
    for name, module in model.named_modules():
        if hasattr(module, "in_features") and hasattr(module, "out_features"):
            found[name, module] = row_range(module, module.in_features, ROW_SIZES, device, dtype)  # cached per shape
    dense = [least for (_, module), (least, _) in found.items() if not isinstance(module, PackedLinear)]
    # the pass itself runs on a dense linear's least rows, or on 2 when every linear needs them (one padding row
    # then costs less than one in each linear); a packed linear needing more rows than the pass pads its own input
    least = max(dense, default=1) if min(least for least, _ in found.values()) < 2 else 2
    chunked, padded = {}, {}
    for (name, module), (module_least, most) in found.items():
        if most < max(least, module_least):
            return ExactSupport(False, reason=f"{name} ({module.in_features} -> {module.out_features}) gives a row "
                                              f"other bits in a pass of more than {most} rows")
        if most < ROW_SIZES[-1]:
            chunked[name] = most
        if module_least > least:
            padded[name] = module_least
    support = ExactSupport(True, least, batching_keeps_rows(*attention_layout(model.config)[1:], device, dtype),
                           chunked=chunked, padded=padded)
    most = min((m for _, m in found.values()), default=ROW_MAX)
    support.fast = fastest_rows(model, least, most, device, dtype)
    return support


FAST_MAX = 8  # a pass of fewer tokens may run on up to this many (padding), where that is faster
FAST_MARGIN = 0.9  # ... by at least 10%: a larger count must beat every smaller one by this factor
FAST_PARAMS = 1_000_000  # below this many linear weights a layer, a matmul's rows cost nothing measurable


def fastest_rows(model: nn.Module, least: int, most: int, device: torch.device, dtype: torch.dtype) -> int:
    """The fewest tokens a pass runs on for speed (>= ``least``), measured once per machine and shape: oneDNN picks
    its kernel by the number of rows, and on one 2-core CPU a 2-token pass of Qwen2.5-Coder-1.5B in bf16 took 143 ms
    and a 4-token one 109 ms. Every count from ``least`` to ``most`` gives each row the same bits (the self-test
    above), so running a smaller pass on more rows (padding) changes nothing but its time. Times every linear of
    the model once per count of the row grid up to ``FAST_MAX`` (the weights streamed as a pass streams them); a
    larger count is taken only where it beats every smaller one by ``FAST_MARGIN``. ``least`` on a GPU and for
    small models (a layer of fewer than ``FAST_PARAMS`` linear weights)."""
    layers = getattr(model.get_decoder(), "layers", None)
    if torch.device(device).type != "cpu" or not layers:
        return least
    linears = [m for m in model.modules() if hasattr(m, "in_features") and hasattr(m, "out_features")]
    if sum(m.in_features * m.out_features for m in layers[0].modules() if m in linears) < FAST_PARAMS:
        return least
    counts = [r for r in ROW_SIZES if least <= r <= min(most, FAST_MAX)]
    key = (str(device), dtype, tuple(sorted({(m.in_features, m.out_features) for m in linears})), len(linears),
           tuple(counts))
    return int(on_disk("fastest_rows", key, lambda: _fastest_rows(linears, counts, device, dtype)))


def _fastest_rows(linears: list[nn.Module], counts: list[int], device: torch.device, dtype: torch.dtype,
                  reps: int = 3) -> int:
    """``fastest_rows``, measured: the fastest of ``reps`` interleaved sweeps over ``linears`` per count."""
    import time

    best = {r: float("inf") for r in counts}
    with torch.no_grad():
        xs = {r: {m.in_features: torch.randn(r, m.in_features).to(device=device, dtype=dtype) for m in linears}
              for r in counts}
        for _ in range(reps + 1):  # the first round warms every kernel up
            for r in counts:
                start = time.perf_counter()
                for m in linears:
                    m(xs[r][m.in_features])
                best[r] = min(best[r], time.perf_counter() - start)
    chosen = counts[0]
    for r in counts[1:]:
        if best[r] < FAST_MARGIN * min(best[c] for c in counts if c < r):
            chosen = r
    log.info("exact pass: every pass runs on at least %d tokens, the fastest here (all linears: %s)", chosen,
             ", ".join(f"{r} rows {1e3 * t:.1f} ms" for r, t in best.items()))
    return chosen


def prefill_rows(model: nn.Module) -> tuple[int, int]:
    """(least, most): every linear of the decoder (not the LM head: a prompt needs no logits) gives each row the same
    bits in forwards of any of ``ROW_SIZES`` from ``least`` to ``most`` rows (most 0: no such range), each size
    checked. Forwards of those sizes cache every prompt token with bits that depend on the tokens before it alone."""
    param = next(p for p in model.parameters() if p.is_floating_point())
    least, most = 1, ROW_MAX
    for module in model.get_decoder().modules():
        if hasattr(module, "in_features") and hasattr(module, "out_features"):
            module_least, module_most = row_range(module, module.in_features, ROW_SIZES, param.device,
                                                  param.dtype)
            least, most = max(least, module_least), min(most, module_most)
    return least, most if most >= least else 0


def prefill_parts(n: int, most: int, least: int) -> list[tuple[int, int]]:
    """A prompt chunk of ``n`` tokens as forwards of (tokens, rows): ``most`` tokens while more are left, then the
    rest padded to a row count of ``ROW_SIZES`` (at least ``least``): every forward's row count is one the
    self-test checked, so every token gets its plain step's bits however the prompt is chunked."""
    parts = []
    while n > 0:
        c = min(n, most)
        parts.append((c, next(size for size in ROW_SIZES if size >= max(c, least))))
        n -= c
    return parts
