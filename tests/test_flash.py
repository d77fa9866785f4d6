"""Chapter 09's kernels in readable PyTorch (minikv/engine/flash.py), against the fast ones: the
online softmax is softmax, a merge of any split of the keys is attention over all of them, tiled
attention is SDPA, and a query walking its block table is the engine's paged_attention. Random
shapes from Hypothesis; tolerances are float32 rounding (float64 where exactness is the claim)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from minikv.engine.attention import paged_attention
from minikv.engine.flash import (
    IO,
    Partial,
    combine,
    flash_decoding,
    merge,
    naive_attention,
    online_softmax,
    tile_kind,
    tiled_attention,
    walk,
)

FAST = settings(max_examples=40, deadline=None)


def randn(*shape, seed: int, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


# --- online softmax ------------------------------------------------------------------------------
@FAST
@given(n=st.integers(1, 70), tile=st.integers(1, 80), scale=st.sampled_from([1.0, 30.0, 300.0]),
       seed=st.integers(0, 10_000))
def test_online_softmax_is_softmax(n, tile, scale, seed):
    """Any tile size, and scores so large that exp(x) overflows float32 (scale 300)."""
    x = randn(3, n, seed=seed, scale=scale)
    probs, m, denom = online_softmax(x, tile)
    assert torch.allclose(probs, x.softmax(-1), atol=1e-6, rtol=1e-5)
    assert torch.equal(m, x.amax(-1, keepdim=True))      # the max is exact: no arithmetic
    assert torch.allclose(denom, torch.exp(x - m).sum(-1, keepdim=True), rtol=1e-5)


def test_without_the_max_the_softmax_overflows():
    """Why the running max exists: exp(100) is inf in float16 (and exp(89) in float32)."""
    x = torch.tensor([100.0, 99.0, 0.0])
    assert torch.isnan(torch.exp(x) / torch.exp(x).sum()).any()
    assert torch.allclose(online_softmax(x, 1)[0], x.softmax(-1))


# --- partials and their merge --------------------------------------------------------------------
def partial_of(scores: torch.Tensor, v: torch.Tensor) -> Partial:
    """The partial of a set of keys, straight from its definition (float64)."""
    m = scores.amax(-1, keepdim=True)
    p = torch.exp(scores - m)
    return Partial(p @ v / p.sum(-1, keepdim=True), m, p.sum(-1, keepdim=True))


@FAST
@given(n=st.integers(2, 60), cuts=st.lists(st.integers(1, 59), max_size=6, unique=True),
       seed=st.integers(0, 10_000))
def test_a_merge_of_any_split_is_the_whole(n, cuts, seed):
    """Cut the keys anywhere into runs: combining the runs' partials gives softmax(s) v over all
    of them, exactly up to float64 rounding; merging two at a time (any order) does too."""
    s = randn(2, n, seed=seed, dtype=torch.float64, scale=4.0)
    v = randn(n, 5, seed=seed + 1, dtype=torch.float64)
    edges = [0, *sorted(c for c in cuts if c < n), n]
    parts = [partial_of(s[:, a:b], v[a:b]) for a, b in zip(edges, edges[1:])]
    whole = combine(*(torch.stack([getattr(p, f) for p in parts]) for f in ("out", "max", "sum")),
                    dim=0)
    want = s.softmax(-1) @ v
    assert torch.allclose(whole.out, want, atol=1e-12)
    assert torch.equal(whole.max, s.amax(-1, keepdim=True))
    folded = parts[-1]
    for p in reversed(parts[:-1]):
        folded = merge(p, folded)
    assert torch.allclose(folded.out, want, atol=1e-12)
    assert torch.allclose(folded.sum, partial_of(s, v).sum, rtol=1e-12)


def test_a_merge_in_float32_differs_in_the_last_bits_only():
    """Chapter 05's batch variance in one line: the same keys cut in two places give results
    that differ by float32 rounding, never more; the same cut gives the same bits."""
    s, v = randn(64, 256, seed=1, scale=3.0), randn(256, 64, seed=2)

    def cut_at(c):
        a, b = partial_of(s[:, :c], v[:c]), partial_of(s[:, c:], v[c:])
        return merge(a, b).out
    gap = (cut_at(64) - cut_at(128)).abs().max().item()
    assert 0 < gap < 1e-5
    assert torch.equal(cut_at(96), cut_at(96))


# --- FlashAttention's tiles ---------------------------------------------------------------------
@FAST
@given(B=st.integers(1, 2), nh=st.integers(1, 3), T=st.integers(1, 40), extra=st.integers(0, 20),
       hs=st.sampled_from([4, 8, 16]), bq=st.integers(1, 24), bk=st.integers(1, 24),
       causal=st.booleans(), seed=st.integers(0, 10_000))
def test_tiled_attention_is_sdpa(B, nh, T, extra, hs, bq, bk, causal, seed):
    L = T + extra  # the T queries are the last T of L positions, as in a prefill after a cache
    q, k, v = (randn(B, nh, n, hs, seed=seed + i) for i, n in enumerate((T, L, L)))
    mask = torch.ones(T, L, dtype=torch.bool).tril(L - T) if causal else None
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    io = IO()
    got = tiled_attention(q, k, v, causal, bq, bk, io)
    assert torch.allclose(got, want, atol=2e-6, rtol=1e-5)
    assert torch.allclose(naive_attention(q, k, v, causal), want, atol=2e-6, rtol=1e-5)
    # never more scores held than one tile's, and every tile accounted for
    assert io.peak_scores <= B * nh * bq * bk * 4
    assert sum(io.tiles.values()) == math.ceil(T / bq) * math.ceil(L / bk)


@FAST
@given(T=st.integers(1, 50), extra=st.integers(0, 30), bq=st.integers(1, 16),
       bk=st.integers(1, 16))
def test_a_tiles_kind_is_what_the_causal_mask_holds_in_it(T, extra, bq, bk):
    L = T + extra
    mask = torch.ones(T, L, dtype=torch.bool).tril(L - T)
    for i in range(math.ceil(T / bq)):
        for j in range(math.ceil(L / bk)):
            block = mask[i * bq:(i + 1) * bq, j * bk:(j + 1) * bk]
            want = "skipped" if not block.any() else "full" if block.all() else "masked"
            assert tile_kind(i, j, bq, bk, T, L) == want, (i, j)


def test_tiles_hold_a_constant_share_of_scores_and_move_fewer_bytes():
    """The chapter's table in small: scores held grow as T² for the naive kernel and stay one
    tile for the tiled one; causal tiling skips about half the tiles."""
    held, moved = {}, {}
    for T in (128, 256):
        q, k, v = (randn(1, 1, T, 64, seed=i) for i in range(3))
        naive, tiled = IO(), IO()
        naive_attention(q, k, v, True, naive)
        tiled_attention(q, k, v, True, 64, 64, tiled)
        held[T], moved[T] = (naive.peak_scores, tiled.peak_scores), (naive, tiled)
    assert held[128] == (128 * 128 * 4, 64 * 64 * 4) and held[256] == (256 * 256 * 4, 64 * 64 * 4)
    assert moved[256][1].tiles == {"full": 6, "masked": 4, "skipped": 6}
    naive, tiled = moved[256]
    # naive: q, k read; S written, read; P written; P, v read; out written
    assert naive.read + naive.written == 4 * 256 * 64 * 4 + 4 * 256 * 256 * 4
    # tiled: q and out once; k and v once per tile computed (10 of 16)
    assert tiled.read + tiled.written == 2 * 256 * 64 * 4 + 10 * 2 * 64 * 64 * 4


# --- a query walking its block table, and FlashDecoding ------------------------------------------
@st.composite
def pools(draw):
    """A pool of pages, a batch of rows each with its own block table (blocks in random order),
    some rows ending mid-page; grouped-query heads."""
    H = draw(st.sampled_from([1, 2]))
    nh = H * draw(st.sampled_from([1, 2]))
    page = draw(st.sampled_from([1, 2, 4, 8, 16]))
    lengths = draw(st.lists(st.integers(1, 48), min_size=1, max_size=4))
    seed = draw(st.integers(0, 10_000))
    need = [-(-n // page) for n in lengths]
    order = torch.randperm(sum(need) + 3, generator=torch.Generator().manual_seed(seed)).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(order[at:at + n])
        at += n
    keys, values = (randn(len(order), H, page, 8, seed=seed + i) for i in (1, 2))
    q = randn(len(lengths), nh, 1, 8, seed=seed + 3)
    return q, keys, values, tables, lengths


def padded(tables):
    width = max(map(len, tables))
    return torch.tensor([t + [-1] * (width - len(t)) for t in tables])


@FAST
@given(case=pools(), n_splits=st.integers(1, 6))
def test_a_walk_through_the_block_table_is_paged_attention(case, n_splits):
    q, keys, values, tables, lengths = case
    fast = paged_attention(q, keys, values, padded(tables), torch.tensor(lengths), n_splits)
    for r, (table, n) in enumerate(zip(tables, lengths)):
        one = walk(q[r, :, 0], keys, values, table, 0, n).out
        assert torch.allclose(one, fast[r, :, 0], atol=2e-6, rtol=1e-5)
        split = flash_decoding(q[r, :, 0], keys, values, table, n, n_splits).out
        assert torch.allclose(split, fast[r, :, 0], atol=2e-6, rtol=1e-5)


def test_the_walk_records_each_tile_it_reads():
    """Steps name the block and slots each tile came from, in table order, and the running
    output after the last tile is the walk's answer."""
    keys, values = randn(6, 1, 4, 8, seed=1), randn(6, 1, 4, 8, seed=2)
    q, steps = randn(2, 8, seed=3), []
    out = walk(q, keys, values, [5, 0, 3], 0, 10, tile=8, steps=steps)
    assert [(s.block, s.slot, s.n, s.position) for s in steps] == [
        (5, 0, 4, 0), (0, 0, 4, 4), (3, 0, 2, 8)]          # tiles never straddle a page
    assert torch.equal(steps[-1].out, out.out)
    assert all(torch.all(a.max <= b.max) for a, b in zip(steps, steps[1:]))  # a running max


@pytest.mark.parametrize("call, message", [
    (lambda: online_softmax(torch.zeros(3), 0), "tile must be a positive int"),
    (lambda: tiled_attention(*(torch.zeros(1, 1, 4, 8),) * 3, block_q=0), "block_q"),
    (lambda: tiled_attention(torch.zeros(1, 1, 5, 8), *(torch.zeros(1, 1, 4, 8),) * 2),
     "5 queries but 4 keys"),
    (lambda: naive_attention(torch.zeros(1, 1, 4, 8), torch.zeros(1, 1, 4, 4),
                             torch.zeros(1, 1, 4, 4)), "give \\(B, nh, T, hs\\)"),
    (lambda: walk(torch.zeros(2, 8), torch.zeros(3, 1, 4, 8), torch.zeros(3, 1, 4, 8), [0, 1],
                  0, 9), "end must be an int in"),
])
def test_bad_tiles_are_refused_with_the_argument_named(call, message):
    with pytest.raises(ValueError, match=message):
        call()
