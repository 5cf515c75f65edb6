"""Prompts cached exactly, and reused exactly.

Where the exact pass attends through the row attention kernel, a prompt's K/V (and the states the drafter reads)
are the bits token-by-token plain steps write, however the prompt is chunked; a later prompt that starts the same
way reuses them (``PrefixCache``) and decodes the tokens it decodes without the cache.
"""

from __future__ import annotations

import pytest
import torch

from conftest import perturb, tiny_model
from selfspec.target import row_attention
from selfspec.target import RowPass
from selfspec.batching import BatchEngine
from selfspec.drafters.prompt_lookup import PromptLookupDrafter
from selfspec.engine import DecodeConfig
from selfspec.target.exact import ROW_SIZES, prefill_parts
from selfspec.heads import init_heads, make_drafter
from selfspec.prefix_cache import MIN_REUSE, OWN_PAGES_MIN, PrefixCache
from selfspec.tree import chain

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 64
KERNEL = row_attention.used("cpu", torch.float32)
needs_kernel = pytest.mark.skipif(not KERNEL, reason="prompts are cached exactly only through the row kernel")


def ids(seed: int, n: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def cached(target: RowPass, prompt: torch.Tensor, chunks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The K of every layer and the last layer's states after caching ``prompt`` in ``chunks``."""
    slot = target.new_cache(prompt.numel() + 8)
    done, states = 0, []
    for c in chunks:
        states.append(target.prefill_chunk(slot, prompt[done:done + c], done, (-1,))[0])
        done += c
    keys = torch.stack([layer.keys[slot.row, :, :done].clone() for layer in target.cache.layers])
    target.release(slot)
    return keys, torch.cat(states)


def test_prefill_forwards_have_row_counts_the_self_test_checked() -> None:
    sizes = ROW_SIZES
    for n in (1, 2, 3, 7, 8, 9, 100, 255, 256, 257, 700):
        for least in (1, 2):
            parts = prefill_parts(n, 256, least)
            assert sum(c for c, _ in parts) == n
            assert all(c <= rows and rows in sizes and rows >= least for c, rows in parts)
    assert prefill_parts(700, 256, 1) == [(256, 256), (256, 256), (188, 192)]
    assert prefill_parts(3, 256, 1) == [(3, 4)] and prefill_parts(1, 256, 2) == [(1, 2)]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_prompts_cache_is_the_plain_steps_cache_however_it_is_chunked(arch: str, dtype: torch.dtype) -> None:
    model = tiny_model(5, vocab=VOCAB, arch=arch).to(dtype)
    target = RowPass(model, 2, 512)
    assert target.exact and target.exact_prefill and target.prefill_rows[1] >= 8
    prompt = torch.tensor(ids(1, 150))
    whole, states = cached(target, prompt, [150])
    for chunks in ([1] * 150, [3, 147], [64, 86], [9, 130, 11]):
        keys, st = cached(target, prompt, chunks)
        assert torch.equal(keys, whole) and torch.equal(st, states), chunks
    slot = target.new_cache(200)  # token by token, as plain decoding's passes write them
    steps = []
    for p, token in enumerate(prompt.tolist()):
        steps.append(target.verify(slot, chain(token, []), p, (-1,)).hidden_states[0])
        target.keep(slot, p, [0])
    assert torch.equal(torch.stack([layer.keys[slot.row, :, :150] for layer in target.cache.layers]), whole)
    assert torch.equal(torch.cat(steps), states)


def test_without_exact_prompts_there_is_no_prefix_cache() -> None:
    model = tiny_model(5, vocab=VOCAB)
    assert BatchEngine(model, max_batch=2, context=256, exact=False).prefix is None  # --no-exact
    assert BatchEngine(model, max_batch=2, context=256, prefix_cache=0).prefix is None


def drafter_for(name: str, model):
    if name == "none":
        return None
    if name == "lookup":
        return PromptLookupDrafter()
    return make_drafter(perturb(init_heads(name, model, top_k=4, draft_vocab_size=VOCAB), 7, 0.3), model)


@needs_kernel
@pytest.mark.parametrize("drafter", ["none", "lookup", "eagle"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_request_reusing_a_cached_prefix_decodes_what_it_decodes_without_it(arch: str, drafter: str) -> None:
    model = tiny_model(6, vocab=VOCAB, arch=arch)
    d = drafter_for(drafter, model)
    system, question = ids(2, 40), ids(3, 25)
    prompts = [system + question,  # seen first
               system + question,  # the same again: all of it reused
               system + ids(4, 30),  # the system prompt reused
               system + question + ids(5, 20) + ids(6, 9)]  # a conversation's next turn
    cfg = DecodeConfig(max_new_tokens=24, max_depth=4, max_nodes=16)
    fresh = [BatchEngine(model, d, max_batch=1, context=256, prefix_cache=0).generate_batch([p], cfg)[0].tokens
             for p in prompts]
    engine = BatchEngine(model, d, max_batch=2, context=256)
    got = [engine.generate_batch([p], cfg)[0].tokens for p in prompts]
    assert got == fresh
    assert engine.prefix.hits == 3 and engine.prefix.reused == 64 + 40 + 64
    together = BatchEngine(model, d, max_batch=2, context=256).generate_batch(prompts, cfg)  # joining together
    assert [r.tokens for r in together] == fresh


@needs_kernel
def test_the_reused_cache_is_what_the_request_reads() -> None:
    """Negative control: an entry's values spoiled on purpose change the next request's tokens."""
    model = tiny_model(6, vocab=VOCAB)
    prompt = ids(2, 60)
    cfg = DecodeConfig(max_new_tokens=24)
    engine = BatchEngine(model, max_batch=1, context=256)
    first = engine.generate_batch([prompt], cfg)[0].tokens
    assert engine.generate_batch([prompt], cfg)[0].tokens == first
    for entry in engine.prefix.entries.values():
        entry.values.mul_(-1)
    assert engine.generate_batch([prompt], cfg)[0].tokens != first


def test_the_cache_keeps_the_longest_prompts_within_its_bytes() -> None:
    def kv(n: int):
        return torch.zeros(2, 1, n, 4), torch.zeros(2, 1, n, 4)

    per_token = 2 * 2 * 4 * 4 + 8  # K and V of 2 layers x 4 floats, and the token id
    cache = PrefixCache(100 * per_token)
    a = torch.arange(40)
    cache.add(a, *kv(40))
    assert cache.match(torch.arange(60))[0] == 40 and cache.match(a[:MIN_REUSE - 1])[0] == 0
    cache.add(torch.arange(70), *kv(70))  # extends the first entry: replaces it
    assert len(cache) == 1 and cache.match(torch.arange(100))[0] == 70
    cache.add(torch.arange(20), *kv(20))  # already held by the longer entry
    assert len(cache) == 1
    b = torch.arange(100, 150)
    cache.add(b, *kv(50))  # 70 + 50 tokens exceed 100: the least recently used goes
    assert len(cache) == 1 and cache.match(torch.arange(70))[0] == 0 and cache.match(b)[0] == 50
    assert cache.nbytes <= cache.max_bytes
    cache.add(torch.arange(300), *kv(300))  # larger than the whole cache: not kept
    assert cache.match(torch.arange(300))[0] == 0 and len(cache) == 1
    states = {-1: torch.zeros(30, 8)}
    cache.add(torch.arange(200, 230), *kv(30), states)
    assert cache.match(torch.arange(200, 240), (-1,))[0] == 30 and cache.match(b, (-1,))[0] == 0  # no states: no match


def test_large_entries_are_kept_in_pages_of_their_own_outside_the_c_heap() -> None:
    footprint = pytest.importorskip("selfspec.serve.footprint")
    if not footprint.malloc_bytes():
        pytest.skip("reads glibc's heap")

    def heap() -> int:  # what glibc hands out, from its arenas or mapped by it
        m = footprint.malloc_bytes()
        return m["malloc_in_use"] + m["malloc_mmapped"]

    cache = PrefixCache(8 * 2**20)
    prompt = torch.arange(300)
    keys, values = torch.randn(4, 2, 300, 64), torch.randn(4, 2, 300, 64)  # 600 KiB each, as an entry's K/V
    expected = keys.clone(), values.clone()
    states = {-1: torch.randn(300, 8)}  # 9.6 KiB: under OWN_PAGES_MIN, kept as it is
    before = heap()
    cache.add(prompt, keys, values, states)
    assert heap() - before < keys.nbytes // 4  # the entry's copies are not glibc's: the token ids and objects only
    before = heap()
    del keys, values
    assert before - heap() >= 2 * expected[0].nbytes  # the caller's tensors went back to glibc: the entry kept none
    entry = cache.match(prompt)[1]
    assert torch.equal(entry.keys, expected[0]) and torch.equal(entry.values, expected[1])
    assert entry.hidden[-1] is states[-1]
    entry.values.mul_(-1)  # the pages are the entry's own and writable
    assert torch.equal(entry.values, -expected[1])


def test_an_entry_the_system_cannot_map_stays_where_it_is(monkeypatch) -> None:
    import mmap

    def refuse(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")  # as mmap says past vm.max_map_count

    monkeypatch.setattr(mmap, "mmap", refuse)
    cache = PrefixCache(8 * 2**20)
    keys, values = torch.randn(4, 2, 300, 64), torch.randn(4, 2, 300, 64)
    cache.add(torch.arange(300), keys, values)
    entry = cache.match(torch.arange(300))[1]
    assert entry.keys is keys and entry.values is values
