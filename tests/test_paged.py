"""The paged KV cache and the continuous-batching server: every request's output equals generating
it alone, whatever the arrivals and however small the pool; no block leaks; shared blocks are
copied before they are written; deterministic requests are bit-identical whatever happens around
them."""
import random
from functools import partial

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import minikv
from minikv.bench import random_model
from minikv.engine.attention import masked_attention, packed_causal_mask, paged_attention
from minikv.engine.paged import BlockPool, BlockTable, PagedCache

from conftest import varied_model

MODEL = varied_model().double()           # float64: no near-tie can flip a greedy token
MODEL32 = varied_model("small", seed=0)


def alone(model, request):
    return minikv.generate(model, request.prompt, request.max_new_tokens,
                           eos_id=request.eos_id).tokens


def test_a_paged_cache_holds_what_a_kv_cache_holds():
    torch.manual_seed(0)
    ids = torch.randint(0, 512, (1, 23))
    pool = BlockPool(MODEL.config, 10, 4, dtype=torch.float64)
    paged = PagedCache(pool, [BlockTable(owner=0)])
    flat = minikv.KVCache.for_model(MODEL, max_len=30)
    with torch.no_grad():
        for chunk in (ids[:, :9], ids[:, 9:10], ids[:, 10:23]):  # prefill, a decode, a chunk
            paged.reserve(chunk.shape[1])
            a = MODEL(chunk, cache=paged)
            b = MODEL(chunk, cache=flat)
            torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    assert paged.get_seq_length() == flat.get_seq_length() == 23
    assert len(paged.tables[0].blocks) == 6 and pool.n_free == 4      # ceil(23 / 4) blocks
    for layer in range(MODEL.config.n_layer):
        blocks = pool.keys[layer][paged.tables[0].blocks]            # (6, nh, 4, hs)
        gathered = blocks.transpose(0, 1).reshape(MODEL.config.n_head, -1, 16)[:, :23]
        torch.testing.assert_close(gathered, flat.keys[layer][0, :, :23], atol=0, rtol=0)


def test_crop_gives_blocks_back():
    pool = BlockPool(MODEL.config, 8, 4, dtype=torch.float64)
    cache = PagedCache(pool, [BlockTable(owner=0)])
    cache.reserve(14)
    with torch.no_grad():
        MODEL(torch.arange(1, 15).view(1, -1), cache=cache)
    assert pool.n_free == 4
    cache.crop(5)
    assert cache.get_seq_length() == 5 and len(cache.tables[0].blocks) == 2 and pool.n_free == 6
    cache.crop(0)
    assert pool.n_free == 8


def test_copy_on_write_leaves_the_other_sharer_alone():
    pool = BlockPool(MODEL.config, 8, 4, dtype=torch.float64)
    a = PagedCache(pool, [BlockTable(owner=0)])
    a.reserve(6)
    with torch.no_grad():
        MODEL(torch.tensor([[1, 2, 3, 4, 5, 6]]), cache=a)
    b_table = BlockTable(owner=1, blocks=list(a.tables[0].blocks), length=6)
    for block in b_table.blocks:
        pool.share(block, 1)
    before = [t[a.tables[0].blocks].clone() for t in pool.keys + pool.values]
    b = PagedCache(pool, [b_table])
    b.reserve(1)  # block 1 is shared and half full: b gets its own copy before writing
    assert b_table.blocks[0] == a.tables[0].blocks[0] and b_table.blocks[1] != a.tables[0].blocks[1]
    with torch.no_grad():
        MODEL(torch.tensor([[9]]), cache=b)
    after = [t[a.tables[0].blocks] for t in pool.keys + pool.values]
    assert all(torch.equal(x, y) for x, y in zip(before, after))  # a's K/V untouched
    assert [what for what, _, _ in pool.log].count("copy") == 1


def requests_from(seed, n, vocab=512, max_prompt=20, max_new=12, spread=6, det=False):
    rng = random.Random(seed)
    return [minikv.Request([rng.randrange(vocab) for _ in range(rng.randint(1, max_prompt))],
                           rng.randint(1, max_new), arrival=rng.randrange(spread),
                           deterministic=det and k == 0, temperature=0.8 if det and k == 0 else 0,
                           seed=seed)
            for k in range(n)]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), n=st.integers(1, 7), page_size=st.sampled_from([1, 2, 4, 8]),
       tight=st.booleans(), prefix=st.booleans())
def test_every_request_gets_what_it_would_get_alone(seed, n, page_size, tight, prefix):
    requests = requests_from(seed, n)
    biggest = max(-(-(len(r.prompt) + r.max_new_tokens + 4) // page_size) + 1 for r in requests)
    num_blocks = biggest if tight else None  # tight: only the largest request fits at once
    outs = minikv.serve(MODEL, requests, page_size=page_size, num_blocks=num_blocks,
                        prefix_caching=prefix)
    for r, out in zip(requests, outs):
        assert out.tokens == alone(MODEL, r)
    assert outs.pool.n_free == outs.pool.num_blocks and all(c == 0 for c in outs.pool.ref)


def test_a_small_pool_preempts_and_still_gets_every_output_right():
    requests = requests_from(3, 6, max_prompt=30, max_new=20, spread=2)
    outs = minikv.serve(MODEL, requests, page_size=4, num_blocks=16)
    assert sum(o.stats.preempted for o in outs) > 0
    assert [o.tokens for o in outs] == [alone(MODEL, r) for r in requests]
    assert outs.pool.n_free == 16


def test_prefix_caching_reuses_a_shared_prompt():
    system = list(range(1, 41))                     # a 40-token "system prompt"
    requests = [minikv.Request(system + [50 + k, 60 + k], 6, arrival=k) for k in range(4)]
    with_cache = minikv.serve(MODEL, requests, page_size=8, prefix_caching=True)
    without = minikv.serve(MODEL, requests, page_size=8, prefix_caching=False)
    assert [o.tokens for o in with_cache] == [o.tokens for o in without]
    assert [o.stats.reused for o in with_cache] == [0, 40, 40, 40]  # 5 full blocks shared
    assert "share" in [what for what, _, _ in with_cache.pool.log]
    assert with_cache.pool.n_free == with_cache.pool.num_blocks


def test_deterministic_requests_are_bit_identical_whatever_the_arrivals():
    det = minikv.Request([5, 6, 7, 8], 30, deterministic=True, temperature=0.8, seed=1)
    outputs = set()
    for pattern in range(12):
        others = requests_from(100 + pattern, pattern % 6, vocab=2048, max_prompt=30, max_new=25,
                               spread=8)
        det.arrival = pattern % 4
        blocks = None if pattern % 3 else 14  # some patterns with a pool small enough to preempt
        out = minikv.serve(MODEL32, [det] + others, replay_window=4, page_size=4, num_blocks=blocks)
        outputs.add(tuple(out[0].tokens))
    assert len(outputs) == 1


def test_a_preempted_deterministic_request_is_recomputed_exactly():
    """Found by search: a crowd and a pool size in which the deterministic request itself is
    preempted (and later recomputed); its output is still the one it gets alone."""
    det = minikv.Request([5, 6, 7, 8], 24, deterministic=True, temperature=0.8, seed=2)
    alone_out = minikv.serve(MODEL32, [det], page_size=4)[0]
    for seed in range(40):
        crowd = requests_from(seed, 4, vocab=2048, max_prompt=16, max_new=20, spread=1)
        det.arrival = 1  # after the first others: the newest running request when the pool fills
        for num_blocks in (10, 12, 14):
            try:
                out = minikv.serve(MODEL32, crowd + [det], page_size=4, num_blocks=num_blocks)
            except ValueError:  # a request larger than this pool
                continue
            if out[-1].stats.preempted:
                assert out[-1].tokens == alone_out.tokens
                assert out.pool.n_free == num_blocks
                return
    raise AssertionError("no crowd in range preempts the deterministic request")


@pytest.mark.parametrize("kwargs, message", [
    (dict(page_size=0), "page_size must be a positive int"),
    (dict(num_blocks=0), "num_blocks must be a positive int"),
    (dict(num_blocks=1), "needs more than the pool"),
    (dict(requests=[minikv.Request([1, 2], 3, arrival=-1)]), "arrival must be an int >= 0"),
    (dict(requests=[minikv.Request([1] * 60, 3)], num_blocks=3, page_size=8),
     "needs more than the pool"),
])
def test_bad_input(kwargs, message):
    args = dict(requests=[minikv.Request([1, 2, 3], 4)]) | kwargs
    with pytest.raises(ValueError, match=message):
        minikv.serve(MODEL32, **args)


@pytest.mark.parametrize("page_size", [1, 4, 12, 16])
@pytest.mark.parametrize("n_splits", [1, 2, 5])
def test_paged_attention_is_attention_read_through_the_tables(page_size, n_splits):
    """Rows of different lengths in scattered blocks: the same numbers as plain attention over
    each row's own keys, whatever the split count (fp64: up to rounding)."""
    g = torch.Generator().manual_seed(page_size * 10 + n_splits)
    nh, hs, lengths = 3, 8, [1, 7, 23, 16]
    nb = [-(-n // page_size) for n in lengths]
    order = torch.randperm(sum(nb), generator=g).tolist()  # blocks in no particular order
    tables, k = [], 0
    for n in nb:
        tables.append(order[k:k + n] + [-1] * (max(nb) - n))
        k += n
    keys = torch.randn(sum(nb), nh, page_size, hs, generator=g, dtype=torch.float64)
    values = torch.randn(sum(nb), nh, page_size, hs, generator=g, dtype=torch.float64)
    q = torch.randn(len(lengths), nh, 1, hs, generator=g, dtype=torch.float64)
    out = paged_attention(q, keys, values, torch.tensor(tables), torch.tensor(lengths), n_splits)
    for b, n in enumerate(lengths):
        kb = keys[tables[b][:nb[b]]].transpose(0, 1).reshape(nh, -1, hs)[:, :n]
        vb = values[tables[b][:nb[b]]].transpose(0, 1).reshape(nh, -1, hs)[:, :n]
        want = torch.nn.functional.scaled_dot_product_attention(q[b], kb, vb)
        torch.testing.assert_close(out[b], want, atol=1e-12, rtol=0)
    # the real blocks handed in from the host (the server's way): the same bits
    real = tuple(torch.tensor([(b, j) for b, n in enumerate(nb) for j in range(n)]).T)
    assert torch.equal(paged_attention(q, keys, values, torch.tensor(tables),
                                       torch.tensor(lengths), n_splits, real=real), out)


def test_packed_prefill_equals_prompts_computed_one_by_one():
    """Three prompts (one continuing two cached blocks) in one packed pass: each one's logits
    and K/V are those of computing it alone."""
    pool = BlockPool(MODEL.config, 16, 4, dtype=torch.float64)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7, 9, 3, 2, 3]]
    tables = [BlockTable(owner=i) for i in range(3)]
    with torch.no_grad():
        first = PagedCache(pool, [tables[2]])  # the third prompt's first 8 tokens are cached
        first.reserve(8)
        MODEL(torch.tensor([prompts[2][:8]]), cache=first)
        counts = [5, 3, 2]
        cache = PagedCache(pool, tables, counts=counts)
        for t, n in zip(tables, counts):
            PagedCache(pool, [t]).reserve(n)
        past = [0, 0, 8]
        ids = prompts[0] + prompts[1] + prompts[2][8:]
        positions = torch.tensor([p for a, n in zip(past, counts) for p in range(a, a + n)])
        mask = packed_causal_mask(past, counts, "cpu")
        logits = MODEL(torch.tensor([ids]), cache=cache, positions=positions,
                       attention=partial(masked_attention, mask=mask))[0]
        starts = [0, 5, 8]
        for prompt, start, n, table in zip(prompts, starts, counts, tables):
            want = MODEL(torch.tensor([prompt]))[0, -n:]
            torch.testing.assert_close(logits[start:start + n], want, atol=1e-10, rtol=0)
            assert table.length == len(prompt)


def test_a_freed_prompt_block_is_reused_until_it_is_reallocated():
    system = list(range(1, 17))  # two full blocks of 8
    first = minikv.serve(MODEL, [minikv.Request(system + [40], 2),
                                 minikv.Request(system + [41], 2, arrival=5)], page_size=8)
    assert [o.stats.reused for o in first] == [0, 16]  # the first had left: its blocks were kept
    # a pool so small that the requests in between take all but one of the freed blocks: the
    # longest free go first, and a sequence frees its blocks last to first, so the prefix's first
    # block is still there and its second is gone
    crowded = minikv.serve(MODEL, [minikv.Request(system + [40], 2),
                                   minikv.Request([7] * 20, 2, arrival=3),
                                   minikv.Request([8] * 12, 2, arrival=3),
                                   minikv.Request(system + [41], 2, arrival=8)],
                           page_size=8, num_blocks=6)
    assert [o.stats.reused for o in crowded] == [0, 0, 0, 8]
    assert [o.tokens for o in crowded][0::3] == [o.tokens for o in first]


def test_a_preempted_deterministic_request_comes_back_with_room_for_its_recompute():
    """A preempted deterministic request recomputes its tokens in padded windows: admitting it
    must hold those blocks, or a request admitted in the same step takes them and the recompute
    finds the pool empty (MemoryError before the fix; these crowds and pools were found so)."""
    model = random_model("tiny", "cpu")
    det = minikv.Request(list(range(1, 20)), 30, deterministic=True, temperature=1.0, seed=3)
    alone_out = minikv.serve(model, [det], page_size=4)[0].tokens
    preempted = 0
    for seed in range(12):
        rng = random.Random(seed)
        crowd = [minikv.Request([rng.randrange(512) for _ in range(rng.randint(5, 30))],
                                rng.randint(4, 30), arrival=i % 3) for i in range(6)]
        det.arrival = seed % 3
        for num_blocks in (20, 24):
            out = minikv.serve(model, crowd + [det], page_size=4, num_blocks=num_blocks)
            assert out[-1].tokens == alone_out and out.pool.n_free == num_blocks
            preempted += out[-1].stats.preempted
    assert preempted > 0  # the case under test happened


def test_the_old_names_are_gone_after_their_release():
    """serve(window=, verify=) were renamed replay_window= and replay= one release ago (with a
    warning then); block_size= is the model's context length, page_size the pool's."""
    requests = [minikv.Request([1, 2, 3], 4, deterministic=True)]
    for old in ("window", "verify", "block_size"):
        with pytest.raises(TypeError, match=old):
            minikv.serve(MODEL32, requests, **{old: 4})
    assert not hasattr(minikv, "TokenBudget") and not hasattr(minikv, "ChunkedPrefill")


def test_the_pool_keeps_the_books_of_a_table():
    """reserve, crop and blocks_needed on a table; publish and cached_prefix on a prompt."""
    pool = BlockPool(MODEL32.config, 8, 4)
    table = BlockTable(owner=0)
    assert pool.blocks_needed(table, 9) == 3
    pool.reserve(table, 9)
    table.length = 9
    assert len(table.blocks) == 3 and pool.n_free == 5 and pool.blocks_needed(table, 3) == 0
    prompt = list(range(10, 19))
    pool.publish(prompt, table)                         # two full blocks findable
    assert pool.cached_prefix(prompt + [7]) == table.blocks[:2]
    assert pool.cached_prefix(prompt[:8]) == table.blocks[:1]  # one token left to compute
    pool.crop(table, 5)
    assert len(table.blocks) == 2 and pool.n_free == 6
    pool.free_table(table, preempted=True)
    assert pool.n_free == 8 and pool.log[-3] == ("preempt", -1, 0)
    assert pool.cached_prefix(prompt + [7]) == [0, 1]  # freed, still findable until reallocated
