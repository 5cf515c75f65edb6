"""The row attention kernel: each row attends over its own keys, with bits that do not depend on the call.

What the exact pass relies on: a tree row (the cache, then its ancestors in depth order, then itself) gets the
bits of a plain step at its position (the same keys contiguous in the cache), alone or beside any other rows,
and the values are attention's (against a float64 reference).
"""

from __future__ import annotations

import pytest
import torch

from selfspec.target import row_attention
from selfspec.target.row_attention import RowKeys, row_keys

pytestmark = pytest.mark.skipif(row_attention.kernel() is None, reason="the row attention kernel cannot be built here")


def test_row_keys_list_each_nodes_ancestors_in_depth_order_then_itself() -> None:
    rows = row_keys([(5, [-1, 0, 1, 0, 3]), None, (2, [-1])], q=5)
    assert rows.index.tolist() == [0, 1, 2, 3, 4, 10]  # entry 1 is padding; entry 2 has one real row of 5
    assert rows.entry.tolist() == [0, 0, 0, 0, 0, 2] and rows.prefix.tolist() == [5, 5, 5, 5, 5, 2]
    keys = [row[:n] for row, n in zip(rows.extra.tolist(), rows.count.tolist())]
    assert keys == [[5], [5, 6], [5, 6, 7], [5, 8], [5, 8, 9], [2]]
    assert row_keys([(3, [-1, 0]), (4, [-1, 0])], q=2).index is None  # every row real: no gather


def cache(entries: int, kv: int, slots: int, d: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    return tuple((torch.randn(entries, kv, slots, d, generator=gen) * 2).to(dtype) for _ in range(2))


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: RowKeys, scale: float) -> torch.Tensor:
    """float64 attention of every row over its keys: (R, heads, d)."""
    out = []
    group = q.shape[1] // k.shape[1]
    for r in range(q.shape[0]):
        slots = list(range(int(rows.prefix[r]))) + rows.extra[r, :int(rows.count[r])].tolist()
        e = int(rows.entry[r])
        keys = k[e][:, slots].double().repeat_interleave(group, 0)
        values = v[e][:, slots].double().repeat_interleave(group, 0)
        weights = torch.softmax(q[r].double()[:, None] @ keys.transpose(1, 2) * scale, -1)
        out.append((weights @ values)[:, 0])
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("heads,kv,d", [(4, 2, 8), (9, 3, 64), (12, 2, 128), (2, 2, 24)])
def test_the_kernel_computes_attention_over_each_rows_keys(dtype: torch.dtype, heads: int, kv: int, d: int) -> None:
    k, v = cache(3, kv, 96, d, dtype, 0)
    rows = row_keys([(40, [-1, 0, 1, 0, 3, 3]), None, (70, [-1, 0])], q=6)
    q = (torch.randn(rows.entry.numel(), heads, d, generator=torch.Generator().manual_seed(1)) * 2).to(dtype)
    out = row_attention.kernel().row_attention(q, k, v, rows.entry, rows.prefix, rows.extra, rows.count, d ** -0.5)
    tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(out.double(), reference(q, k, v, rows, d ** -0.5), atol=tol, rtol=tol)


@pytest.mark.parametrize("heads,kv,d", [(9, 3, 64), (12, 2, 128)])
def test_a_tree_row_gets_a_plain_steps_bits_alone_or_beside_other_rows(heads: int, kv: int, d: int) -> None:
    """Entry 0 holds a 300-token cache and a 10-node tree; entry 1 another request. Each tree row, computed in one
    call with everything, alone, and as a plain step (its keys copied in order to contiguous slots of a fresh cache
    row: prefix = its position + 1, no other keys), gives the same bits."""
    parents = [-1, 0, 1, 2, 0, 4, 1, 6, 6, 3]
    k, v = cache(2, kv, 512, d, torch.bfloat16, 2)
    rows = row_keys([(300, parents), (137, [-1, 0, 1])], q=len(parents))
    q = torch.randn(rows.entry.numel(), heads, d, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    run = row_attention.kernel().row_attention
    together = run(q, k, v, rows.entry, rows.prefix, rows.extra, rows.count, d ** -0.5)
    for r in range(len(parents)):
        one = slice(r, r + 1)
        alone = run(q[one], k, v, rows.entry[one], rows.prefix[one], rows.extra[one], rows.count[one], d ** -0.5)
        slots = list(range(300)) + rows.extra[r, :int(rows.count[r])].tolist()
        plain_k, plain_v = torch.zeros_like(k[:1]), torch.zeros_like(v[:1])
        plain_k[0, :, :len(slots)], plain_v[0, :, :len(slots)] = k[0][:, slots], v[0][:, slots]
        n = len(slots)
        step = run(q[one], plain_k, plain_v, torch.tensor([0]), torch.tensor([n - 1]), torch.tensor([[n - 1]]),
                   torch.tensor([1]), d ** -0.5)
        assert torch.equal(alone, together[one]) and torch.equal(step, together[one])


class RowVariantKernel:
    """Negative control: the real kernel, except that a row beside other rows gets its last bit nudged."""

    def __init__(self, real) -> None:
        self.real = real

    def row_attention(self, q, *args):
        out = self.real.row_attention(q, *args)
        return out if q.shape[0] == 1 else out + torch.finfo(out.dtype).eps * out.abs()


def test_the_self_test_catches_a_row_variant_kernel_and_the_exact_pass_falls_back(monkeypatch, tmp_path) -> None:
    from selfspec.target import exact

    real = row_attention.kernel()
    row_attention.keeps_rows.cache_clear()
    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path))  # the faked kernel's verdict stays out of the real cache
    monkeypatch.setattr(row_attention, "kernel", lambda: RowVariantKernel(real))
    try:
        assert not row_attention.keeps_rows(4, 2, 16, torch.bfloat16)
        assert not row_attention.used(torch.device("cpu"), torch.bfloat16, (4, 2, 16))
        calls = []
        monkeypatch.setattr(row_attention, "attend", lambda *a: calls.append(a))
        q = torch.randn(1, 4, 3, 16).to(torch.bfloat16)
        k, v = cache(1, 2, 128, 16, torch.bfloat16, 4)
        plan = exact.plan_pass([-1, 0, 0], [0, 1, 1], 40, 128, torch.bfloat16, torch.device("cpu"))
        out = exact.exact_attention(q, k, v, plan, None)  # through torch's kernel, by paths
        assert not calls and out.shape == (1, 3, 4, 16)
    finally:
        monkeypatch.undo()
        row_attention.keeps_rows.cache_clear()
    assert row_attention.keeps_rows(4, 2, 16, torch.bfloat16)  # the real kernel passes
