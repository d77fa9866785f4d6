"""Checkers for chapter 09 (the attention kernel that reads the cache), each against the engine's
readable kernels (minikv/engine/flash.py), in a few CPU seconds, from data (the recipe in
__init__.py): online_step (the online softmax's step by hand: one tile into the running max and
sum; the step never sees the row, so only an online solution can pass), merge_partials (two
partial results into one, the split-KV merge), predict_tiles (predict, then measure: how many
tiles a causal FlashAttention computes, masks and skips, measured by tiled_attention's IO),
tile_step_fixed (debug: a tiled attention's step that forgets to rescale its output) and
choose_tiles (design: tile shapes for an on-chip memory budget, the bytes measured by IO).
"""
from __future__ import annotations

import functools
import math

import torch

from ...engine.flash import (
    IO,
    Partial,
    absorb,
    combine,
    flash_decoding,
    merge,
    online_softmax,
    tile_kind,
    tiled_attention,
    walk,
)
from . import Exercise, Refused, call, expect, fail, forbid, guarded, ints, passed

# The engine's kernels and torch's own softmax: the exercises build them
KERNELS = (online_softmax, absorb, combine, merge, tiled_attention, walk, flash_decoding,
           tile_kind)
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


# --- exercise 1: the online softmax, one tile at a time --------------------------------------
# The learner writes the step a kernel runs per tile: (m, d) after the tiles before, and this
# tile's scores, in; (m, d) after it, out. The step never sees the row, so a solution that takes
# the global max first or recomputes each prefix cannot be written; the cases are states from
# several rows, interleaved, so a step that remembers earlier tiles (another row's) is caught.

def online_step_by_hand(m: float, d: float, tile: torch.Tensor) -> tuple[float, float]:
    """The solution, as a student writes it: bring the sum so far to the new max, add the tile."""
    m_new = max(m, float(tile.max()))
    return m_new, d * math.exp(m - m_new) + float(torch.exp(tile - m_new).sum())


def _step_reference(m: float, d: float, tile: torch.Tensor) -> tuple[float, float]:
    """The engine's step (flash.absorb, the one tiled_attention runs), in float64."""
    x, f64 = tile.double()[None], dict(dtype=torch.float64)
    m_new, d_new, _ = absorb(torch.tensor([[m]], **f64), torch.tensor([[d]], **f64),
                             torch.zeros(1, 1, **f64), x, torch.zeros(len(tile), 1, **f64))
    return float(m_new), float(d_new)


def _states(x: torch.Tensor, tile: int) -> list[tuple[float, float, torch.Tensor]]:
    """(m, d, tile) before each tile of a row, as the engine's step leaves them."""
    m, d, out = -math.inf, 0.0, []
    for start in range(0, len(x), tile):
        t = x[start:start + tile]
        out.append((m, d, t))
        m, d = _step_reference(m, d, t)
    return out


_ROWS = [_states(_vector(1, 12), 4), _states(torch.tensor([0.5, 2.0, 1.0, 3.5, -1.0, 0.0]), 2),
         _states(torch.tensor([90.0, 95.0, 100.0, 20.0]), 1), _states(_vector(3, 9) + torch.arange(
             9.0), 4), _states(_vector(5, 11, 1.0, -40.0), 5), _states(_vector(4, 16, 3.0), 16)]
# interleaved across rows, each row's first tile (m = -inf, d = 0) among them, not all first
STEP_CASES = [_ROWS[0][1], _ROWS[1][0], _ROWS[2][2], _ROWS[0][2], _ROWS[3][1], _ROWS[2][0],
              _ROWS[1][1], _ROWS[4][1], _ROWS[2][3], _ROWS[3][2], _ROWS[5][0], _ROWS[1][2]]


def _pair(got, m, d, tile):
    hint = "return the pair (m, d) after this tile: two numbers"
    if not isinstance(got, (list, tuple)) or len(got) != 2:
        raise Refused(hint)
    m_new, d_new = map(_number, got)
    if m_new is None or d_new is None:
        raise Refused(hint)
    return m_new, d_new


def _same_pair(got, want) -> bool:
    return _close(got[0], want[0]) and _close(got[1], want[1])


def _no_rescale(m, d, tile):
    m_new = max(m, float(tile.max()))
    return m_new, d + float(torch.exp(tile - m_new).sum())


def _no_max(m, d, tile):
    return max(m, float(tile.max())), d + float(torch.exp(tile).sum())


def _tile_max(m, d, tile):
    m_new = float(tile.max())
    return m_new, d * math.exp(m - m_new) + float(torch.exp(tile - m_new).sum())


def _inverted(m, d, tile):
    m_new = max(m, float(tile.max()))
    return m_new, (d * math.exp(m_new - m) if d else 0.0) + float(torch.exp(tile - m_new).sum())


def _remembered(answers) -> str:
    """The hint when a new max is not max(m, the tile's max): the step used scores it was not
    given (remembered from earlier calls: a global max, a prefix recomputed) or dropped the m it
    was given: not online."""
    for (m, d, tile), (m_new, _) in answers:
        if not math.isclose(m_new, max(m, float(tile.max())), rel_tol=1e-6, abs_tol=1e-6):
            return STEP_HINTS["remembered"]
    return STEP_HINTS["otherwise"]


STEP_HINTS = {
    "remembered": "your new m is not max(m, the max of this tile): the step is not online. It "
                  "gets the state (m, d) and one tile, nothing else (the check's tiles come from "
                  "several rows, interleaved): a max taken over scores kept from earlier calls, "
                  "or one that ignores the m it is given, is wrong here. Keep only m and d, and "
                  "bring d to the new max",
    "otherwise": "m after the tile is the largest score seen, max(m, max of the tile); d after "
                 "it is the sum of exp(x - new m) over every score seen: the terms already in d "
                 "were taken against the old m (how does exp(x - m_new) relate to exp(x - m)?)",
}

ONLINE_STEP = Exercise(
    "online_step",
    cases=STEP_CASES,
    describe=lambda m, d, tile: (f"m={m:.4g}, d={d:.4g}, a tile of {len(tile)} scores "
                                 f"{[round(float(v), 2) for v in tile[:4]]}"
                                 f"{' ...' if len(tile) > 4 else ''}"),
    reference=_step_reference,
    returns=_pair,
    same=_same_pair,
    show=lambda pair: (round(pair[0], 4), round(pair[1], 4)),
    mistakes={
        "when the tile raises the max, d was summed against the old max: bring it to the new "
        "one (multiply it by exp(old m - new m)) before adding the tile's exps": _no_rescale,
        "d is a sum of exp(x - m), not exp(x): without the max subtracted exp overflows (exp(89) "
        "is inf in float32) and the sum is not the one the softmax divides by": _no_max,
        "m is the running max, the largest score of every tile so far, not this tile's max":
            _tile_max,
        "the rescale goes the other way: the old sum shrinks when the max rises, by "
        "exp(old m - new m), a number at most 1": _inverted,
    },
    otherwise=_remembered,
    forbid=(*KERNELS, *SOFTMAX),
    unchanged="read the scores, don't change them: they are the cache's",
    solution=online_step_by_hand,
)
check_online_step = ONLINE_STEP.check


def run_steps(step, x: torch.Tensor, tile: int) -> list[tuple[float, float]]:
    """A row's scores fed to `step` a tile at a time, as a kernel does: (m, d) after each."""
    m, d, after = -math.inf, 0.0, []
    for start in range(0, len(x), tile):
        m, d = step(m, d, x[start:start + tile])
        after.append((float(m), float(d)))
    return after


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
# The learner fixes the step the reported loop calls per tile of keys: the running state of
# every query (m, d, acc) and one tile of keys and values in, the state after it out. The loop
# (in the notebook and here, `attend_in_tiles`) owns the keys and divides once at the end; the
# step never sees the row, so a global max first or a prefix recomputed cannot be written.

def tile_step_by_hand(m: torch.Tensor, d: torch.Tensor, acc: torch.Tensor, q: torch.Tensor,
                      k_tile: torch.Tensor, v_tile: torch.Tensor) -> tuple:
    """The solution: the output so far (acc) is rescaled with the sum when the max rises."""
    s = q @ k_tile.T / math.sqrt(q.shape[1])
    m_new = torch.maximum(m, s.max(dim=1, keepdim=True).values)
    p = torch.exp(s - m_new)
    rescale = torch.exp(m - m_new)
    return m_new, d * rescale + p.sum(dim=1, keepdim=True), acc * rescale + p @ v_tile


def attend_in_tiles(step, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    block_k: int) -> torch.Tensor:
    """The bug report's loop: the state starts empty, `step` takes each tile of keys in turn,
    the output is acc / d, once, after the last tile."""
    m = torch.full((q.shape[0], 1), -math.inf)
    d = torch.zeros(q.shape[0], 1)
    acc = torch.zeros(q.shape[0], v.shape[1])
    for start in range(0, k.shape[0], block_k):
        m, d, acc = step(m, d, acc, q, k[start:start + block_k], v[start:start + block_k])
    return acc / d


def _tile_step_reference(m, d, acc, q, k_tile, v_tile):
    """The engine's step (flash.absorb, the one tiled_attention runs)."""
    return absorb(m, d, acc, q @ k_tile.T / math.sqrt(q.shape[1]), v_tile)


def _step_states(seed: int, T: int, L: int, hs: int, block_k: int, scale: float = 1.0) -> list:
    """(m, d, acc, q, k_tile, v_tile) before each tile of a walk whose max rises late."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, hs, generator=g) * scale
    k = torch.randn(L, hs, generator=g)
    k[-1] *= 3.0  # a late key stands out: the max rises after the first tile
    v = torch.randn(L, hs, generator=g)
    m, d, acc = torch.full((T, 1), -math.inf), torch.zeros(T, 1), torch.zeros(T, hs)
    out = []
    for start in range(0, L, block_k):
        k_tile, v_tile = k[start:start + block_k], v[start:start + block_k]
        out.append((m, d, acc, q, k_tile, v_tile))
        m, d, acc = _tile_step_reference(m, d, acc, q, k_tile, v_tile)
    return out


_WALKS = [_step_states(1, 3, 12, 8, 4), _step_states(2, 1, 20, 4, 8, 2.0),
          _step_states(3, 4, 9, 8, 2), _step_states(5, 5, 33, 8, 5, 3.0)]
# interleaved across walks: first tiles (empty state), tiles that raise a max, tiles that don't
TILE_STEP_CASES = [_WALKS[0][2], _WALKS[1][0], _WALKS[2][4], _WALKS[3][6], _WALKS[0][1],
                   _WALKS[2][1], _WALKS[1][2], _WALKS[3][0], _WALKS[2][3]]


def _state(got, m, d, acc, q, k_tile, v_tile):
    hint = ("return the state after this tile, (m, d, acc): tensors of m's, d's and acc's "
            "shapes")
    if not isinstance(got, (list, tuple)) or len(got) != 3 or not all(
            isinstance(t, torch.Tensor) and t.shape == w.shape for t, w in zip(got, (m, d, acc))):
        raise Refused(hint)
    return tuple(t.double() for t in got)


def _same_state(got, want) -> bool:
    return all(torch.allclose(a.double(), b.double(), atol=1e-5, rtol=1e-4)
               for a, b in zip(got, want))


def _as_reported(m, d, acc, q, k_tile, v_tile):
    s = q @ k_tile.T / math.sqrt(q.shape[1])
    m_new = torch.maximum(m, s.max(dim=1, keepdim=True).values)
    p = torch.exp(s - m_new)
    return m_new, d * torch.exp(m - m_new) + p.sum(dim=1, keepdim=True), acc + p @ v_tile


def _normalised_in_step(m, d, acc, q, k_tile, v_tile):
    m_new, d_new, acc_new = tile_step_by_hand(m, d, acc, q, k_tile, v_tile)
    return m_new, d_new, acc_new / d_new


def _acc_only(m, d, acc, q, k_tile, v_tile):
    s = q @ k_tile.T / math.sqrt(q.shape[1])
    m_new = torch.maximum(m, s.max(dim=1, keepdim=True).values)
    p = torch.exp(s - m_new)
    return m_new, d + p.sum(dim=1, keepdim=True), acc * torch.exp(m - m_new) + p @ v_tile


def _unscaled_scores(m, d, acc, q, k_tile, v_tile):
    return tile_step_by_hand(m, d, acc, q * math.sqrt(q.shape[1]), k_tile, v_tile)


def _remembered_keys(answers) -> str:
    """The hint when a new max is not max(m, this tile's row max): not online."""
    for (m, d, acc, q, k_tile, v_tile), (m_new, _, _) in answers:
        top = torch.maximum(m, (q @ k_tile.T / math.sqrt(q.shape[1])).amax(1, keepdim=True))
        if not torch.allclose(m_new, top.double(), atol=1e-5, rtol=1e-5):
            return TILE_STEP_HINTS["remembered"]
    return TILE_STEP_HINTS["otherwise"]


TILE_STEP_HINTS = {
    "remembered": "your new m is not max(m, this tile's largest scores): the step is not "
                  "online. It gets the state (m, d, acc) and one tile of keys, nothing else (the "
                  "check's tiles come from several walks, interleaved): a global max over keys "
                  "kept from earlier calls, or one that ignores the m it is given, is wrong here. "
                  "Keep only m, d and acc between tiles",
    "otherwise": "per tile: s = q kᵀ/√hs; m_new = max(m, row max of s); p = exp(s - m_new); "
                 "d and acc both hold exps against the old m: bring both to m_new, then add "
                 "the tile's Σp and p v",
}

TILE_STEP = Exercise(
    "tile_step_fixed",
    cases=TILE_STEP_CASES,
    describe=lambda m, d, acc, q, k, v: (
        f"{q.shape[0]} queries of {q.shape[1]}, a tile of {k.shape[0]} keys, "
        + ("the first tile (m = -inf, d = 0)" if bool(torch.isinf(m).all())
           else f"m so far {[round(float(x), 3) for x in m[:2, 0]]}")),
    reference=_tile_step_reference,
    returns=_state,
    same=_same_state,
    show=lambda state: (state[0][:2, 0].to(torch.float32), state[1][:2, 0].to(torch.float32),
                        state[2][0, :4].to(torch.float32)),
    mistakes={
        "the bug as reported: when the max rises, the output so far (acc) holds exps taken "
        "against the old max, like the sum: it needs the same exp(old m - new m) rescale":
            _as_reported,
        "acc stays a sum of exps times values, not yet a mean: the loop divides it by d once, "
        "after the last tile (dividing in every step divides again and again)":
            _normalised_in_step,
        "the sum d needs the rescale too: it was summed against the old max, like acc":
            _acc_only,
        "the scores are q·k / sqrt(hs), as in the model": _unscaled_scores,
    },
    otherwise=_remembered_keys,
    forbid=(*KERNELS, *SOFTMAX),
    unchanged="return a new state: the loop's tensors are the kernel's, don't write into them",
    solution=tile_step_by_hand,
)
check_tile_step_fixed = TILE_STEP.check

# --- exercise 5 (design): tile shapes for an on-chip memory budget -----------------------------
# A causal prefill of DESIGN_T queries, one head, float32; the learner picks (block_q, block_k)
# from TILE_SIZES whose working set fits `sram_bytes`, moving as few bytes as the best that fits
# (within TILE_MARGIN), the bytes measured by the engine's tiled_attention (flash.IO).
DESIGN_T = 512
TILE_SIZES = (16, 32, 64, 128, 256)
TILE_MARGIN = 0.02
# round budgets, then budgets exactly at a working set (it fits) and just under one (it does not)
TILE_CASES_DESIGN = [(64, 64 * 1024), (64, 160 * 1024), (128, 96 * 1024), (32, 40 * 1024),
                     (64, 82_944), (64, 82_432), (64, 26_880)]


def on_chip_bytes(block_q: int, block_k: int, hs: int, number: int = 4) -> int:
    """What one program holds at once, as the exercise states it: its query tile and its output
    so far (block_q × hs each), one key tile and one value tile (block_k × hs each), the tile's
    scores (block_q × block_k), and m and d (block_q each), `number` bytes a number."""
    return number * (2 * block_q * hs + 2 * block_k * hs + block_q * block_k + 2 * block_q)


@functools.lru_cache(maxsize=None)
def moved_bytes(block_q: int, block_k: int, hs: int) -> int:
    """Bytes a causal tiled_attention of DESIGN_T queries reads and writes with these tiles,
    measured by the engine (flash.IO) as it runs."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, DESIGN_T, hs, generator=g) for _ in range(3))
    io = IO()
    tiled_attention(q, k, v, True, block_q, block_k, io)
    return io.read + io.written


def scheduled_bytes(block_q: int, block_k: int, hs: int) -> int:
    """The same bytes from the engine's causal schedule (flash.tile_kind) without running the
    kernel: each query tile read and its output written once, the K and V tiles of every pair
    not skipped read (tests/test_checks_ch09.py: equal to moved_bytes for every shape)."""
    T, number, moved = DESIGN_T, 4, 0
    for i in range(-(-T // block_q)):
        rows = min(block_q, T - i * block_q)
        moved += 2 * rows * hs * number
        for j in range(-(-T // block_k)):
            if tile_kind(i, j, block_q, block_k, T, T) != "skipped":
                moved += 2 * min(block_k, T - j * block_k) * hs * number
    return moved


def best_tiles(hs: int, sram_bytes: int) -> tuple[int, int]:
    """The fitting tile shape that moves the fewest bytes (by the schedule; ties: the smaller
    key tile)."""
    fits = [(bq, bk) for bq in TILE_SIZES for bk in TILE_SIZES
            if on_chip_bytes(bq, bk, hs) <= sram_bytes]
    return min(fits, key=lambda shape: (scheduled_bytes(*shape, hs), shape[1]))


def choose_tiles_by_hand(hs: int, sram_bytes: int) -> tuple[int, int]:
    """The solution: each query tile reads every key before it whatever block_k is, so the
    traffic falls with block_q alone; the smallest key tile leaves the most room for it."""
    block_k = TILE_SIZES[0]
    fits = [bq for bq in TILE_SIZES if on_chip_bytes(bq, block_k, hs) <= sram_bytes]
    return max(fits), block_k


CT = {
    "pair": "return (block_q, block_k): two ints from {sizes}",
    "no_scores": "over the budget: the tile's scores are on chip too, block_q × block_k numbers "
                 "(the tile that never goes to main memory is the point of the kernel)",
    "no_acc": "over the budget: the output so far (acc, block_q × hs) stays on chip with the "
              "query tile until the last key tile",
    "half": "over the budget: this kernel is float32, 4 bytes a number, not 2",
    "too_big": "over the budget: count q and acc (block_q × hs each), K and V (block_k × hs "
               "each), the scores (block_q × block_k) and m, d (block_q each), 4 bytes a number",
    "square": "square tiles: block_k does not cut traffic (each query tile reads every key "
              "before it, in whatever tiles); block_q does (K and V are read once per query "
              "tile). Spend the memory on block_q and keep block_k small",
    "wide_k": "the memory went to the key tile: block_k does not cut traffic, block_q does (K "
              "and V are read once per query tile)",
    "room": "a larger block_q fits this budget: the fewer the query tiles, the fewer times K "
            "and V are read",
}


@guarded
def check_choose_tiles(choose_tiles) -> None:
    """choose_tiles(hs, sram_bytes) -> (block_q, block_k): fits, and moves within 2% of the
    fewest bytes a fitting shape moves, measured by tiled_attention."""
    name = "choose_tiles"
    for hs, budget in TILE_CASES_DESIGN:
        case = (f"a causal prefill of {DESIGN_T} tokens, one head of {hs}, float32, "
                f"{budget:,} bytes of on-chip memory")
        with forbid(name, *KERNELS):
            got = call(name, case, choose_tiles, hs, budget)
        pair = ints(2, CT["pair"].format(sizes=TILE_SIZES))
        try:
            bq, bk = pair(got)
        except Refused as r:
            fail(name, case, "(block_q, block_k)", got, r.hint)
        expect(bq in TILE_SIZES and bk in TILE_SIZES, name, case, f"two of {TILE_SIZES}",
               (bq, bk), CT["pair"].format(sizes=TILE_SIZES))
        held = on_chip_bytes(bq, bk, hs)
        if held > budget:
            why = ("no_scores" if held - 4 * bq * bk <= budget else
                   "no_acc" if held - 4 * bq * hs <= budget else
                   "half" if on_chip_bytes(bq, bk, hs, 2) <= budget else "too_big")
            fail(name, case, f"at most {budget:,} bytes on chip", f"{held:,} bytes for "
                 f"block_q={bq}, block_k={bk}", CT[why])
        best_q, best_k = best_tiles(hs, budget)
        mine, fewest = moved_bytes(bq, bk, hs), moved_bytes(best_q, best_k, hs)
        if mine > fewest * (1 + TILE_MARGIN):
            why = "square" if bq == bk else "wide_k" if bk > bq else "room"
            fail(name, case, f"within {100 * TILE_MARGIN:.0f}% of the fewest bytes moved "
                 f"({fewest:,}, block_q={best_q}, block_k={best_k})",
                 f"{mine:,} bytes moved with block_q={bq}, block_k={bk}", CT[why])
    passed(name, len(TILE_CASES_DESIGN))


EXERCISES = (ONLINE_STEP, MERGE, PREDICT, TILE_STEP)
