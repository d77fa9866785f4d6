"""Checkers for chapter 09 (the attention kernel that reads the cache), each against the engine's
readable kernels (minikv/engine/flash.py), in a few CPU seconds, from data (the recipe in
__init__.py): running_stats (the online softmax by hand: the running max and sum after every
tile), merge_partials (two partial results into one, the split-KV merge), predict_tiles
(predict, then measure: how many tiles a causal FlashAttention computes, masks and skips,
measured by tiled_attention's IO) and tiled_attention_fixed (debug: a tiled attention that
forgets to rescale its output).
"""
from __future__ import annotations

import math

import torch

from ...engine.flash import (
    IO,
    Partial,
    combine,
    flash_decoding,
    merge,
    online_softmax,
    tile_kind,
    tiled_attention,
    walk,
)
from . import Exercise, Refused, ints, tensor

# The engine's kernels and torch's own softmax: the exercises build them
KERNELS = (online_softmax, combine, merge, tiled_attention, walk, flash_decoding, tile_kind)
SOFTMAX = ("softmax", "log_softmax", "logsumexp", "scaled_dot_product_attention")


def _vector(seed: int, n: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale + shift


def _number(x) -> float | None:
    if isinstance(x, bool):
        return None
    if isinstance(x, (int, float)):
        return float(x)
    if isinstance(x, torch.Tensor) and x.numel() == 1 and x.is_floating_point():
        return float(x)
    return None


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-6)


# --- exercise 1: the online softmax by hand ---------------------------------------------------

def running_stats_by_hand(x: torch.Tensor, tile: int) -> list[tuple[float, float]]:
    """The solution, as a student writes it: one pass, a tile at a time."""
    m, total, after = -math.inf, 0.0, []
    for start in range(0, len(x), tile):
        t = x[start:start + tile]
        m_new = max(m, float(t.max()))
        total = total * math.exp(m - m_new) + float(torch.exp(t - m_new).sum())
        m = m_new
        after.append((m, total))
    return after


def _stats_reference(x: torch.Tensor, tile: int) -> list[tuple[float, float]]:
    """The engine's online_softmax on each prefix that ends a tile (float64)."""
    out = []
    for end in range(tile, len(x) + tile, tile):
        _, m, total = online_softmax(x[:end].double(), tile)
        out.append((float(m), float(total)))
    return out


def _pairs(got, x, tile):
    n = -(-len(x) // tile)
    hint = (f"return a list of {n} pairs (m, sum), one after each tile of {tile} (the last one "
            "may be shorter), each two numbers")
    if not isinstance(got, (list, tuple)) or len(got) != n:
        raise Refused(hint)
    pairs = []
    for pair in got:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise Refused(hint)
        m, total = map(_number, pair)
        if m is None or total is None:
            raise Refused(hint)
        pairs.append((m, total))
    return pairs


def _same_pairs(got, want) -> bool:
    return all(_close(a, c) and _close(b, d) for (a, b), (c, d) in zip(got, want))


def _no_rescale(x, tile):
    m, total, after = -math.inf, 0.0, []
    for start in range(0, len(x), tile):
        t = x[start:start + tile]
        m = max(m, float(t.max()))
        total = total + float(torch.exp(t - m).sum())
        after.append((m, total))
    return after


def _no_max(x, tile):
    m, total, after = -math.inf, 0.0, []
    for start in range(0, len(x), tile):
        t = x[start:start + tile]
        m = max(m, float(t.max()))
        total = total + float(torch.exp(t).sum())
        after.append((m, total))
    return after


def _tile_max(x, tile):
    m, total, after = -math.inf, 0.0, []
    for start in range(0, len(x), tile):
        t = x[start:start + tile]
        m_new = float(t.max())
        total = total * math.exp(m - m_new) + float(torch.exp(t - m_new).sum())
        m = m_new
        after.append((m, total))
    return after


def _inverted(x, tile):
    m, total, after = -math.inf, 0.0, []
    for start in range(0, len(x), tile):
        t = x[start:start + tile]
        m_new = max(m, float(t.max()))
        total = (total * math.exp(m_new - m) if total else 0.0) + float(torch.exp(t - m_new).sum())
        m = m_new
        after.append((m, total))
    return after


RUNNING_STATS = Exercise(
    "running_stats",
    cases=[(_vector(1, 12), 4), (torch.tensor([0.5, 2.0, 1.0, 3.5, -1.0, 0.0]), 2),
           (_vector(2, 10, 2.0), 3), (torch.tensor([3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0]), 1),
           (_vector(3, 9) + torch.arange(9.0), 4), (_vector(4, 16, 3.0), 16),
           (torch.tensor([90.0, 95.0, 100.0, 20.0]), 1), (_vector(5, 11, 1.0, -40.0), 5)],
    describe=lambda x, tile: (f"{len(x)} scores {[round(float(v), 2) for v in x[:4]]}"
                              f"{' ...' if len(x) > 4 else ''}, tiles of {tile}"),
    reference=_stats_reference,
    returns=_pairs,
    same=_same_pairs,
    show=lambda pairs: [(round(m, 4), round(s, 4)) for m, s in pairs],
    mistakes={
        "when a tile raises the max, the sum so far was taken against the old max: multiply it by "
        "exp(old m - new m) before adding the tile's exps (the rescale)": _no_rescale,
        "the sum is of exp(x - m), not exp(x): without the max subtracted exp overflows (exp(89) "
        "is inf in float32) and the sum is not the one the softmax divides by": _no_max,
        "m is the running max, the largest score of every tile so far, not this tile's max":
            _tile_max,
        "the rescale goes the other way: the old sum shrinks by exp(old m - new m), a number "
        "at most 1": _inverted,
    },
    otherwise="keep m (start at -inf) and a sum (start at 0); per tile: m_new = max(m, max of the "
              "tile); sum = sum × exp(m - m_new) + Σ exp(tile - m_new); m = m_new; record (m, sum)",
    forbid=(*KERNELS, *SOFTMAX),
    unchanged="read the scores, don't change them: they are the cache's",
    solution=running_stats_by_hand,
)
check_running_stats = RUNNING_STATS.check


# --- exercise 2: merge two partial results ----------------------------------------------------

def merge_by_hand(a: tuple, b: tuple) -> tuple:
    """The solution: each partial's sum counts exps against its own max; bring both to the larger
    max, then weigh the outputs by what they count."""
    (out_a, m_a, s_a), (out_b, m_b, s_b) = a, b
    m = max(m_a, m_b)
    w_a, w_b = math.exp(m_a - m) * s_a, math.exp(m_b - m) * s_b
    return (w_a * out_a + w_b * out_b) / (w_a + w_b), m, w_a + w_b


def _partial(seed: int, n: int, hs: int, scale: float, shift: float = 0.0) -> tuple:
    """The partial (out, max, sum) of one query against n keys, from the engine's walk."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(n, generator=g, dtype=torch.float64) * scale + shift
    v = torch.randn(n, hs, generator=g, dtype=torch.float64)
    m = float(scores.max())
    p = torch.exp(scores - m)
    return (p @ v / p.sum(), m, float(p.sum()))


def _merge_reference(a, b):
    p = merge(*(Partial(torch.as_tensor(o), torch.tensor([float(m)], dtype=torch.float64),
                        torch.tensor([float(s)], dtype=torch.float64)) for o, m, s in (a, b)))
    return p.out, float(p.max), float(p.sum)


def _merged(got, a, b):
    hint = "return (out, m, sum): the merged output (a tensor like a's), its max and its sum"
    if not isinstance(got, (list, tuple)) or len(got) != 3:
        raise Refused(hint)
    out, m, total = got
    m, total = _number(m), _number(total)
    if not isinstance(out, torch.Tensor) or out.shape != a[0].shape or m is None or total is None:
        raise Refused(hint)
    return out.double(), m, total


def _same_merge(got, want) -> bool:
    return (torch.allclose(got[0], want[0].double(), rtol=1e-6, atol=1e-9)
            and _close(got[1], want[1]) and _close(got[2], want[2]))


def _by_sums(a, b):
    (out_a, m_a, s_a), (out_b, m_b, s_b) = a, b
    return (s_a * out_a + s_b * out_b) / (s_a + s_b), max(m_a, m_b), s_a + s_b


def _by_max_only(a, b):
    (out_a, m_a, s_a), (out_b, m_b, s_b) = a, b
    m = max(m_a, m_b)
    w_a, w_b = math.exp(m_a - m), math.exp(m_b - m)
    return (w_a * out_a + w_b * out_b) / (w_a + w_b), m, w_a * s_a + w_b * s_b


def _unnormalised(a, b):
    (out_a, m_a, s_a), (out_b, m_b, s_b) = a, b
    m = max(m_a, m_b)
    w_a, w_b = math.exp(m_a - m) * s_a, math.exp(m_b - m) * s_b
    return w_a * out_a + w_b * out_b, m, w_a + w_b


def _sum_unscaled(a, b):
    out, m, _ = merge_by_hand(a, b)
    return out, m, a[2] + b[2]


MERGE_CASES = [(_partial(1, 6, 4, 1.0), _partial(2, 5, 4, 1.0, 2.0)),
               (_partial(3, 8, 8, 3.0, 1.0), _partial(4, 8, 8, 3.0)),
               (_partial(5, 1, 4, 1.0), _partial(6, 12, 4, 2.0, -3.0)),
               (_partial(7, 16, 6, 4.0, -20.0), _partial(8, 3, 6, 1.0, -18.0)),
               (_partial(9, 4, 4, 1.0, 5.0), _partial(10, 4, 4, 1.0, -5.0))]


def _describe_merge(a, b) -> str:
    return (f"a: {len(a[0])} numbers, m={a[1]:.3f}, sum={a[2]:.3f}; "
            f"b: m={b[1]:.3f}, sum={b[2]:.3f}")


MERGE = Exercise(
    "merge_partials",
    cases=MERGE_CASES,
    describe=_describe_merge,
    reference=_merge_reference,
    returns=_merged,
    same=_same_merge,
    show=lambda r: (r[0].to(torch.float32), round(r[1], 4), round(r[2], 4)),
    mistakes={
        "you weighed each output by its sum alone: a's sum counts exp(score - m_a), b's "
        "exp(score - m_b); against the common max M they count exp(m_a - M)·sum_a and "
        "exp(m_b - M)·sum_b": _by_sums,
        "each partial weighs exp(its max - M) × its sum: the sum says how many exps it "
        "averaged, the factor brings them to the common max": _by_max_only,
        "each output is already a weighted mean (divided by its own sum): the merged one is "
        "(w_a·out_a + w_b·out_b) / (w_a + w_b)": _unnormalised,
        "the merged sum is against the merged max: exp(m_a - M)·sum_a + exp(m_b - M)·sum_b, "
        "not sum_a + sum_b": _sum_unscaled,
    },
    otherwise="M = max(m_a, m_b); w_a = exp(m_a - M)·sum_a, w_b = exp(m_b - M)·sum_b; return "
              "((w_a·out_a + w_b·out_b) / (w_a + w_b), M, w_a + w_b)",
    forbid=(*KERNELS, *SOFTMAX),
    unchanged="build a new output: the partials may be another split's, still in use",
    solution=merge_by_hand,
)
check_merge_partials = MERGE.check


# --- exercise 3: predict, then measure: the causal tile schedule ------------------------------

def predict_tiles_by_hand(T: int, L: int, block_q: int, block_k: int) -> tuple[int, int, int]:
    """The solution: the T queries sit at positions L - T .. L - 1; a key tile is skipped if its
    first key is after the tile's last query, full if its last key is at or before the tile's
    first query, else masked."""
    full = masked = skipped = 0
    for i in range(-(-T // block_q)):
        first_q, last_q = L - T + i * block_q, L - T + min((i + 1) * block_q, T) - 1
        for j in range(-(-L // block_k)):
            first_k, last_k = j * block_k, min((j + 1) * block_k, L) - 1
            if first_k > last_q:
                skipped += 1
            elif last_k <= first_q:
                full += 1
            else:
                masked += 1
    return full, masked, skipped


def measured_tiles(T: int, L: int, block_q: int, block_k: int) -> tuple[int, int, int]:
    """What tiled_attention counts when it runs (IO.tiles), on random data."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, n, 4, generator=g) for n in (T, L, L))
    io = IO()
    tiled_attention(q, k, v, True, block_q, block_k, io)
    return io.tiles["full"], io.tiles["masked"], io.tiles["skipped"]


def _counts(T, L, block_q, block_k, offset=None, strict=False, floor=False):
    offset = L - T if offset is None else offset
    nq = T // block_q if floor else -(-T // block_q)
    nk = L // block_k if floor else -(-L // block_k)
    full = masked = skipped = 0
    for i in range(nq):
        first_q, last_q = offset + i * block_q, offset + min((i + 1) * block_q, T) - 1
        for j in range(nk):
            first_k, last_k = j * block_k, min((j + 1) * block_k, L) - 1
            if first_k > last_q:
                skipped += 1
            elif last_k < first_q or (not strict and last_k == first_q):
                full += 1
            else:
                masked += 1
    return full, masked, skipped


def _by_index(T, L, block_q, block_k):
    nq, nk = -(-T // block_q), -(-L // block_k)
    full = sum(min(i, nk) for i in range(nq))
    masked = sum(1 for i in range(nq) if i < nk)
    return full, masked, nq * nk - full - masked


TILE_CASES = [(8, 8, 4, 4), (16, 16, 4, 8), (12, 20, 4, 4), (10, 10, 4, 4), (6, 30, 3, 8),
              (9, 9, 3, 1), (16, 16, 16, 16), (5, 17, 2, 5), (32, 40, 8, 4)]

PREDICT = Exercise(
    "predict_tiles",
    cases=TILE_CASES,
    describe=lambda T, L, bq, bk: (f"{T} queries (the last of {L} positions), "
                                   f"block_q={bq}, block_k={bk}"),
    reference=measured_tiles,
    returns=ints(3, "return three ints: (full, masked, skipped)"),
    show=tuple,
    explain=lambda T, L, bq, bk: "(full, masked, skipped), as tiled_attention counted them",
    mistakes={
        "the queries are the LAST T of the L positions (a prefill after a cache, a chunk): "
        "query t sits at position L - T + t, not t": lambda *c: _counts(*c, offset=0),
        "a tile whose last key is the position of its first query is full: every query in it "
        "sees that key (a query sees itself)": lambda *c: _counts(*c, strict=True),
        "count in positions, not tile numbers: with block_q ≠ block_k, or T ≠ L, tile i is "
        "not on the diagonal with tile i": _by_index,
        "the last tile may be short (T or L not a multiple of the block): ceil, not floor":
            lambda *c: _counts(*c, floor=True),
    },
    otherwise="query tile i holds positions L-T+i·block_q ..; key tile j holds j·block_k ..; "
              "skipped if its first key > the tile's last query; full if its last key <= the "
              "tile's first query; else masked",
    forbid=KERNELS,
    solution=predict_tiles_by_hand,
)
check_predict_tiles = PREDICT.check


# --- exercise 4: debug a tiled attention that forgets to rescale ------------------------------

def fixed_by_hand(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_k: int) -> torch.Tensor:
    """The solution: the output so far is rescaled with the sum when the max rises."""
    m = torch.full((q.shape[0], 1), -math.inf)
    total = torch.zeros(q.shape[0], 1)
    acc = torch.zeros(q.shape[0], v.shape[1])
    for start in range(0, k.shape[0], block_k):
        s = q @ k[start:start + block_k].T / math.sqrt(q.shape[1])
        m_new = torch.maximum(m, s.max(dim=1, keepdim=True).values)
        p = torch.exp(s - m_new)
        total = total * torch.exp(m - m_new) + p.sum(dim=1, keepdim=True)
        acc = acc * torch.exp(m - m_new) + p @ v[start:start + block_k]
        m = m_new
    return acc / total


def _attention_reference(q, k, v, block_k):
    out = tiled_attention(q[None, None], k[None, None], v[None, None], False, q.shape[0],
                          block_k)
    return out[0, 0]


def _as_reported(q, k, v, block_k):
    m = torch.full((q.shape[0], 1), -math.inf)
    total, acc = torch.zeros(q.shape[0], 1), torch.zeros(q.shape[0], v.shape[1])
    for start in range(0, k.shape[0], block_k):
        s = q @ k[start:start + block_k].T / math.sqrt(q.shape[1])
        m_new = torch.maximum(m, s.max(dim=1, keepdim=True).values)
        p = torch.exp(s - m_new)
        total = total * torch.exp(m - m_new) + p.sum(dim=1, keepdim=True)
        acc = acc + p @ v[start:start + block_k]
        m = m_new
    return acc / total


def _not_normalised(q, k, v, block_k):
    m = torch.full((q.shape[0], 1), -math.inf)
    acc = torch.zeros(q.shape[0], v.shape[1])
    for start in range(0, k.shape[0], block_k):
        s = q @ k[start:start + block_k].T / math.sqrt(q.shape[1])
        m_new = torch.maximum(m, s.max(dim=1, keepdim=True).values)
        acc = acc * torch.exp(m - m_new) + torch.exp(s - m_new) @ v[start:start + block_k]
        m = m_new
    return acc


def _unscaled_scores(q, k, v, block_k):
    return fixed_by_hand(q * math.sqrt(q.shape[1]), k, v, block_k)


def _debug_case(seed: int, T: int, L: int, hs: int, block_k: int, scale: float = 1.0) -> tuple:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, hs, generator=g) * scale
    k = torch.randn(L, hs, generator=g)
    k[-1] *= 3.0  # a late key stands out: the max rises after the first tile
    return q, k, torch.randn(L, hs, generator=g), block_k


DEBUG = Exercise(
    "tiled_attention_fixed",
    cases=[_debug_case(1, 3, 12, 8, 4), _debug_case(2, 1, 20, 4, 8, 2.0),
           _debug_case(3, 4, 9, 8, 2), _debug_case(4, 2, 16, 16, 16),
           _debug_case(5, 5, 33, 8, 5, 3.0)],
    describe=lambda q, k, v, b: (f"{q.shape[0]} queries, {k.shape[0]} keys of "
                                 f"{q.shape[1]}, tiles of {b}"),
    reference=_attention_reference,
    returns=tensor("return the output: a tensor of q's shape", shape=lambda q, k, v, b: q.shape),
    same=lambda got, want: torch.allclose(got.double(), want.double(), atol=1e-5, rtol=1e-4),
    show=lambda t: t[0, :4],
    mistakes={
        "the bug as reported: when the max rises, the output so far (acc) holds exps taken "
        "against the old max, like the sum: it needs the same exp(old m - new m) rescale":
            _as_reported,
        "the output is acc divided by the running sum, once, after the last tile (acc holds "
        "exps times values, not yet a weighted mean)": _not_normalised,
        "the scores are q·k / sqrt(hs), as in the model": _unscaled_scores,
    },
    otherwise="per tile: s = q kᵀ/√hs; m_new = max(m, row max of s); p = exp(s - m_new); "
              "sum = sum·exp(m - m_new) + Σp; acc = acc·exp(m - m_new) + p v; m = m_new; "
              "finally acc / sum",
    forbid=(*KERNELS, *SOFTMAX),
    solution=fixed_by_hand,
)
check_tiled_attention_fixed = DEBUG.check

EXERCISES = (RUNNING_STATS, MERGE, PREDICT, DEBUG)
