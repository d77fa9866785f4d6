"""Checkers for chapter 09 (the attention kernel that reads the cache), against the engine's
readable kernels (minikv/engine/flash.py), in a few CPU seconds: online_step (the online softmax's
step by hand: one tile into the running max and sum; the step never sees the row, so only an
online solution can pass), merge_partials (the split-KV merge), predict_tiles (predict, then
measure: the tiles a causal FlashAttention computes, masks and skips) and tile_step_fixed (debug:
a step that forgets to rescale its output) are tables; choose_tiles (design: tile shapes for an
on-chip memory budget, the bytes measured by IO) is code, and so is walk_kernel (the paged decode
walk as a Triton kernel, run on a CPU by Triton's interpreter, which lets the check see its loads).
The hints are in hints/ch09.toml."""
from __future__ import annotations

import contextlib
import functools
import math

import torch

from ...engine import flash
from ...engine.flash import IO, Partial, absorb, merge, tile_kind, tiled_attention, walk
from . import Exercise, Refused, call, fail, forbid, guarded, hints, ints, named, parts, passed

H = hints("ch09")
# The engine's kernels and torch's own softmax: the exercises build them
KERNELS = (flash.online_softmax, absorb, flash.combine, merge, tiled_attention, flash.walk,
           flash.flash_decoding, tile_kind)
SOFTMAX = ("softmax", "log_softmax", "logsumexp", "scaled_dot_product_attention")


def _vector(seed: int, n: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale + shift


def _number(x, *case) -> float | None:  # a part of an answer: one number (not a bool)
    plain = isinstance(x, (int, float)) and not isinstance(x, bool)
    one = isinstance(x, torch.Tensor) and x.numel() == 1 and x.is_floating_point()
    return float(x) if plain or one else None


def _shaped_as(which):
    """A part of an answer: a tensor of the shape of `which(*case)`, taken to float64."""
    return lambda t, *case: (t.double() if isinstance(t, torch.Tensor)
                             and t.shape == which(*case).shape else None)


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-6)


def _walked(state: tuple, tiles, step) -> list[tuple]:
    """(*state, *tile) before each tile of a walk whose state the engine's `step` moves on."""
    out = []
    for tile in tiles:
        out.append((*state, *tile))
        state = step(*state, *tile)
    return out


def _online(table: dict, top, close):
    """An `otherwise` for a step: "not online" when a new m is not max(m, this tile's max) (the
    step used scores it was not given: remembered from earlier calls, or it dropped its m)."""
    def hint(answers) -> str:
        remembered = any(not close(got[0], top(*case)) for case, got in answers)
        return table["remembered" if remembered else "otherwise"]
    return hint


def _io(T: int, L: int, block_q: int, block_k: int, hs: int = 4) -> IO:
    """What tiled_attention counts (flash.IO) running a causal pass on random data."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, n, hs, generator=g) for n in (T, L, L))
    io = IO()
    tiled_attention(q, k, v, True, block_q, block_k, io)
    return io


# --- exercise 1: the online softmax, one tile at a time --------------------------------------
# The learner writes the step a kernel runs per tile: (m, d) after the tiles before, and this
# tile's scores, in; (m, d) after it, out. The step never sees the row, so a solution that takes
# the global max first or recomputes each prefix cannot be written; the cases are states from
# several rows, interleaved, so a step that remembers earlier tiles (another row's) is caught.

def online_step_by_hand(m: float, d: float, tile: torch.Tensor, rescale: float = 1.0,
                        shift: bool = True, running: bool = True) -> tuple[float, float]:
    """The solution, as a student writes it: bring the sum so far to the new max, add the tile.
    (The knobs give the usual mistakes: d brought by exp(rescale × (m - new m)), the exps not
    shifted by the new max, a new m that is not the running max.)"""
    m_new = max(m, float(tile.max())) if running else float(tile.max())
    kept = d * math.exp(rescale * (m - m_new)) if d else 0.0
    return m_new, kept + float(torch.exp(tile - m_new if shift else tile).sum())


def _step_reference(m: float, d: float, tile: torch.Tensor) -> tuple[float, float]:
    """The engine's step (flash.absorb, the one tiled_attention runs), in float64."""
    x, f64 = tile.double()[None], dict(dtype=torch.float64)
    m_new, d_new, _ = absorb(torch.tensor([[m]], **f64), torch.tensor([[d]], **f64),
                             torch.zeros(1, 1, **f64), x, torch.zeros(len(tile), 1, **f64))
    return float(m_new), float(d_new)


def _states(x: torch.Tensor, tile: int) -> list[tuple[float, float, torch.Tensor]]:
    """(m, d, tile) before each tile of a row, as the engine's step leaves them."""
    return _walked((-math.inf, 0.0), [(x[i:i + tile],) for i in range(0, len(x), tile)],
                   _step_reference)


_ROWS = [_states(_vector(1, 12), 4), _states(torch.tensor([0.5, 2.0, 1.0, 3.5, -1.0, 0.0]), 2),
         _states(torch.tensor([90.0, 95.0, 100.0, 20.0]), 1), _states(_vector(3, 9) + torch.arange(
             9.0), 4), _states(_vector(5, 11, 1.0, -40.0), 5), _states(_vector(4, 16, 3.0), 16)]
# interleaved across rows, each row's first tile (m = -inf, d = 0) among them, not all first
STEP_CASES = [_ROWS[0][1], _ROWS[1][0], _ROWS[2][2], _ROWS[0][2], _ROWS[3][1], _ROWS[2][0],
              _ROWS[1][1], _ROWS[4][1], _ROWS[2][3], _ROWS[3][2], _ROWS[5][0], _ROWS[1][2]]
S = H["online_step"]
ONLINE_STEP = Exercise(
    "online_step",
    cases=STEP_CASES,
    describe=lambda m, d, tile: (f"m={m:.4g}, d={d:.4g}, a tile of {len(tile)} scores "
                                 f"{[round(float(v), 2) for v in tile[:4]]}"
                                 f"{' ...' if len(tile) > 4 else ''}"),
    reference=_step_reference,
    returns=parts(S["returns"], _number, _number),
    same=lambda got, want: _close(got[0], want[0]) and _close(got[1], want[1]),
    show=lambda pair: (round(pair[0], 4), round(pair[1], 4)),
    mistakes=named(S, no_rescale=lambda m, d, t: online_step_by_hand(m, d, t, rescale=0),
                   no_max=lambda m, d, t: online_step_by_hand(m, d, t, rescale=0, shift=False),
                   tile_max=lambda m, d, t: online_step_by_hand(m, d, t, running=False),
                   inverted=lambda m, d, t: online_step_by_hand(m, d, t, rescale=-1)),
    otherwise=_online(S, lambda m, d, tile: max(m, float(tile.max())),
                      lambda a, b: math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6)),
    forbid=(*KERNELS, *SOFTMAX), unchanged=S["unchanged"], solution=online_step_by_hand)
check_online_step = ONLINE_STEP.check


def run_steps(step, x: torch.Tensor, tile: int) -> list[tuple[float, float]]:
    """A row's scores fed to `step` a tile at a time, as a kernel does: (m, d) after each."""
    m, d, after = -math.inf, 0.0, []
    for start in range(0, len(x), tile):
        m, d = step(m, d, x[start:start + tile])
        after.append((float(m), float(d)))
    return after


# --- exercise 2: merge two partial results ----------------------------------------------------

def merge_by_hand(a: tuple, b: tuple, rescale: bool = True, count: bool = True,
                  divide: bool = True, rescale_sum: bool = True) -> tuple:
    """The solution: each partial's sum counts exps against its own max; bring both to the larger
    max, then weigh the outputs by what they count. (The knobs give the usual mistakes: no
    exp(m - M) factors, weights without the sums, no division, a sum without the factors.)"""
    (out_a, m_a, s_a), (out_b, m_b, s_b) = a, b
    m = max(m_a, m_b)
    e_a, e_b = (math.exp(m_a - m), math.exp(m_b - m)) if rescale else (1.0, 1.0)
    w_a, w_b = (e_a * s_a, e_b * s_b) if count else (e_a, e_b)
    out = w_a * out_a + w_b * out_b
    total = e_a * s_a + e_b * s_b if rescale_sum else s_a + s_b
    return out / (w_a + w_b) if divide else out, m, total


def _partial(seed: int, n: int, hs: int, scale: float, shift: float = 0.0) -> tuple:
    """The partial (out, max, sum) of one query against n keys."""
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


G = H["merge_partials"]
MERGE = Exercise(
    "merge_partials",
    cases=[(_partial(1, 6, 4, 1.0), _partial(2, 5, 4, 1.0, 2.0)),
           (_partial(3, 8, 8, 3.0, 1.0), _partial(4, 8, 8, 3.0)),
           (_partial(5, 1, 4, 1.0), _partial(6, 12, 4, 2.0, -3.0)),
           (_partial(7, 16, 6, 4.0, -20.0), _partial(8, 3, 6, 1.0, -18.0)),
           (_partial(9, 4, 4, 1.0, 5.0), _partial(10, 4, 4, 1.0, -5.0))],
    describe=lambda a, b: (f"a: {len(a[0])} numbers, m={a[1]:.3f}, sum={a[2]:.3f}; "
                           f"b: m={b[1]:.3f}, sum={b[2]:.3f}"),
    reference=_merge_reference,
    returns=parts(G["returns"], _shaped_as(lambda a, b: a[0]), _number, _number),
    same=lambda got, want: (torch.allclose(got[0], want[0].double(), rtol=1e-6, atol=1e-9)
                            and _close(got[1], want[1]) and _close(got[2], want[2])),
    show=lambda r: (r[0].to(torch.float32), round(r[1], 4), round(r[2], 4)),
    mistakes=named(G, by_sums=lambda a, b: merge_by_hand(a, b, rescale=False),
                   by_max_only=lambda a, b: merge_by_hand(a, b, count=False),
                   unnormalised=lambda a, b: merge_by_hand(a, b, divide=False),
                   sum_unscaled=lambda a, b: merge_by_hand(a, b, rescale_sum=False)),
    otherwise=G["otherwise"], forbid=(*KERNELS, *SOFTMAX), unchanged=G["unchanged"],
    solution=merge_by_hand)
check_merge_partials = MERGE.check


# --- exercise 3: predict, then measure: the causal tile schedule ------------------------------

def predict_tiles_by_hand(T: int, L: int, block_q: int, block_k: int, offset: int | None = None,
                          strict: bool = False, floor: bool = False) -> tuple[int, int, int]:
    """The solution: the T queries sit at positions L - T .. L - 1; a key tile is skipped if its
    first key is after the tile's last query, full if its last key is at or before the tile's
    first query, else masked. (The knobs give the usual mistakes: the queries from `offset`, a
    tile that ends at its first query `strict`ly masked, the tiles counted by `floor`.)"""
    offset = L - T if offset is None else offset
    full = masked = skipped = 0
    for i in range(T // block_q if floor else -(-T // block_q)):
        first_q, last_q = offset + i * block_q, offset + min((i + 1) * block_q, T) - 1
        for j in range(L // block_k if floor else -(-L // block_k)):
            first_k, last_k = j * block_k, min((j + 1) * block_k, L) - 1
            if first_k > last_q:
                skipped += 1
            elif last_k < first_q or (not strict and last_k == first_q):
                full += 1
            else:
                masked += 1
    return full, masked, skipped


def measured_tiles(T: int, L: int, block_q: int, block_k: int) -> tuple[int, int, int]:
    """What tiled_attention counts when it runs (IO.tiles), on random data."""
    tiles = _io(T, L, block_q, block_k).tiles
    return tiles["full"], tiles["masked"], tiles["skipped"]


def _by_index(T, L, block_q, block_k):
    nq, nk = -(-T // block_q), -(-L // block_k)
    full = sum(min(i, nk) for i in range(nq))
    masked = sum(1 for i in range(nq) if i < nk)
    return full, masked, nq * nk - full - masked


TILES = H["predict_tiles"]
PREDICT = Exercise(
    "predict_tiles",
    cases=[(8, 8, 4, 4), (16, 16, 4, 8), (12, 20, 4, 4), (10, 10, 4, 4), (6, 30, 3, 8),
           (9, 9, 3, 1), (16, 16, 16, 16), (5, 17, 2, 5), (32, 40, 8, 4)],
    describe=lambda T, L, bq, bk: (f"{T} queries (the last of {L} positions), "
                                   f"block_q={bq}, block_k={bk}"),
    reference=measured_tiles,
    returns=ints(3, TILES["returns"]),
    show=tuple,
    explain=lambda T, L, bq, bk: "(full, masked, skipped), as tiled_attention counted them",
    mistakes=named(TILES, offset=lambda *case: predict_tiles_by_hand(*case, offset=0),
                   strict=lambda *case: predict_tiles_by_hand(*case, strict=True),
                   by_index=_by_index,
                   floor=lambda *case: predict_tiles_by_hand(*case, floor=True)),
    otherwise=TILES["otherwise"], forbid=KERNELS, solution=predict_tiles_by_hand)
check_predict_tiles = PREDICT.check


# --- exercise 4: debug a tiled attention that forgets to rescale ------------------------------
# The learner fixes the step the reported loop calls per tile of keys: the running state of
# every query (m, d, acc) and one tile of keys and values in, the state after it out. The loop
# (in the notebook and here, `attend_in_tiles`) owns the keys and divides once at the end; the
# step never sees the row, so a global max first or a prefix recomputed cannot be written.

def tile_step_by_hand(m: torch.Tensor, d: torch.Tensor, acc: torch.Tensor, q: torch.Tensor,
                      k_tile: torch.Tensor, v_tile: torch.Tensor, rescale_d: bool = True,
                      rescale_acc: bool = True, divide: bool = False,
                      scale: bool = True) -> tuple:
    """The solution: the output so far (acc) is rescaled with the sum when the max rises. (The
    knobs give the usual mistakes: d or acc not rescaled, acc divided by d, unscaled scores.)"""
    s = q @ k_tile.T / (math.sqrt(q.shape[1]) if scale else 1.0)
    m_new = torch.maximum(m, s.max(dim=1, keepdim=True).values)
    p = torch.exp(s - m_new)
    rescale = torch.exp(m - m_new)
    d_new = (d * rescale if rescale_d else d) + p.sum(dim=1, keepdim=True)
    acc_new = (acc * rescale if rescale_acc else acc) + p @ v_tile
    return m_new, d_new, acc_new / d_new if divide else acc_new


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
    tiles = [(q, k[i:i + block_k], v[i:i + block_k]) for i in range(0, L, block_k)]
    return _walked((torch.full((T, 1), -math.inf), torch.zeros(T, 1), torch.zeros(T, hs)),
                   tiles, _tile_step_reference)


_WALKS = [_step_states(1, 3, 12, 8, 4), _step_states(2, 1, 20, 4, 8, 2.0),
          _step_states(3, 4, 9, 8, 2), _step_states(5, 5, 33, 8, 5, 3.0)]
# interleaved across walks: first tiles (empty state), tiles that raise a max, tiles that don't
TILE_STEP_CASES = [_WALKS[0][2], _WALKS[1][0], _WALKS[2][4], _WALKS[3][6], _WALKS[0][1],
                   _WALKS[2][1], _WALKS[1][2], _WALKS[3][0], _WALKS[2][3]]
F = H["tile_step_fixed"]
TILE_STEP = Exercise(
    "tile_step_fixed",
    cases=TILE_STEP_CASES,
    describe=lambda m, d, acc, q, k, v: (
        f"{q.shape[0]} queries of {q.shape[1]}, a tile of {k.shape[0]} keys, "
        + ("the first tile (m = -inf, d = 0)" if bool(torch.isinf(m).all())
           else f"m so far {[round(float(x), 3) for x in m[:2, 0]]}")),
    reference=_tile_step_reference,
    returns=parts(F["returns"], *(_shaped_as(lambda *case, i=i: case[i]) for i in range(3))),
    same=lambda got, want: all(torch.allclose(a.double(), b.double(), atol=1e-5, rtol=1e-4)
                               for a, b in zip(got, want)),
    show=lambda state: (state[0][:2, 0].to(torch.float32), state[1][:2, 0].to(torch.float32),
                        state[2][0, :4].to(torch.float32)),
    mistakes=named(F, as_reported=lambda *case: tile_step_by_hand(*case, rescale_acc=False),
                   normalised=lambda *case: tile_step_by_hand(*case, divide=True),
                   acc_only=lambda *case: tile_step_by_hand(*case, rescale_d=False),
                   unscaled=lambda *case: tile_step_by_hand(*case, scale=False)),
    otherwise=_online(F, lambda m, d, acc, q, k, v: torch.maximum(
        m, (q @ k.T / math.sqrt(q.shape[1])).amax(1, keepdim=True)).double(),
        lambda a, b: torch.allclose(a, b, atol=1e-5, rtol=1e-5)),
    forbid=(*KERNELS, *SOFTMAX), unchanged=F["unchanged"], solution=tile_step_by_hand)
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
    io = _io(DESIGN_T, DESIGN_T, block_q, block_k, hs)
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


CT = H["choose_tiles"]


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
        if bq not in TILE_SIZES or bk not in TILE_SIZES:
            fail(name, case, f"two of {TILE_SIZES}", (bq, bk), CT["pair"].format(sizes=TILE_SIZES))
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


# --- exercise 6: the paged decode walk as a Triton kernel -------------------------------------
# The learner writes the loop body of a Triton kernel, one program per (sequence, query head):
# the sequence's b-th block found through its block table, ONE block of keys and values loaded,
# the online softmax's running max, sum and output moved on. The check launches the kernel on
# three paged layouts (tables out of order, a last partial block whose stale slots hold NaN,
# grouped heads, lengths of 1 and of exactly one block) and compares with the engine's `walk`.
# Without a CUDA GPU it runs under Triton's interpreter (TRITON_INTERPRET=1), which lets the
# check see every load the kernel makes: one that covers more than one block's keys (the whole
# row at once) is refused, and a read outside the given tensors is stopped before it happens. A
# kernel compiled for a GPU runs there and is graded by its output alone.
W = H["walk_kernel"]
# (lengths, page, K/V heads H, query heads nh, hs, seed): each a launch of rows x query heads
WALK_LAYOUTS = [([7, 1, 4, 13, 16], 4, 2, 4, 8, 1), ([20, 8, 3], 8, 1, 2, 16, 2),
                ([9, 2], 2, 2, 2, 4, 3)]
WALK_TOL = 1e-4  # float32 on any CPU, and a GPU's exp: the mistakes are off by 1e-2 and more


def _triton():
    """Triton's package, or None where it is not installed (macOS, Windows, ARM Linux)."""
    try:
        import triton
    except ImportError:
        return None
    return triton


def walk_layout(lengths: list[int], page: int, H: int, nh: int, hs: int, seed: int) -> tuple:
    """(q (B, nh, hs), keys, values (num_blocks, H, page, hs), tables (a list per row), lengths):
    each row's blocks drawn at random from a pool with blocks to spare; the last live key of each
    row points along its queries (the max rises in the row's last block); the slots of a last
    block past its row's length hold NaN, as stale K/V an earlier request left there would."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // page) for n in lengths]
    order = torch.randperm(sum(need) + 3, generator=g).tolist()
    tables = [order[sum(need[:r]):sum(need[:r + 1])] for r in range(len(lengths))]
    keys, values = (torch.randn(len(order), H, page, hs, generator=g) for _ in range(2))
    q = torch.randn(len(lengths), nh, hs, generator=g)
    for r, n in enumerate(lengths):
        block, slot = tables[r][(n - 1) // page], (n - 1) % page
        toward = q[r].view(H, nh // H, hs).mean(1)                               # (H, hs)
        keys[block, :, slot] = 2.5 * toward / toward.norm(dim=-1, keepdim=True) * math.sqrt(hs)
        keys[block, :, slot + 1:] = values[block, :, slot + 1:] = float("nan")
    return q, keys, values, tables, lengths


def walk_reference(q, keys, values, tables, lengths) -> torch.Tensor:
    """Every row's output (B, nh, hs), by the engine's walk (flash.walk), in float64."""
    return torch.stack([walk(q[r].double(), keys.double(), values.double(), tables[r], 0, n,
                             keys.size(2)).out for r, n in enumerate(lengths)]).float()


def walk_by_hand(q, keys, values, tables, lengths, rescale: bool = True, rescale_acc: bool = True,
                 scale: bool = True, by_table: bool = True, mask_scores: bool = True):
    """The kernel's walk in PyTorch, block by block: the solution, and with a knob turned the
    usual mistakes (nothing rescaled when the max rises, or the output alone not; scores not
    divided by √hs; blocks read in storage order, 0, 1, 2, ..., not through the table; the
    loads masked but not the scores, so a stale slot scores 0)."""
    B, nh, hs = q.shape
    H, page = keys.size(1), keys.size(2)
    out = torch.empty(B, nh, hs, dtype=torch.float64)
    for r, n in enumerate(lengths):
        qg = q[r].double().view(H, nh // H, hs)
        m = torch.full((H, nh // H, 1), -math.inf, dtype=torch.float64)
        d, acc = torch.zeros_like(m), torch.zeros_like(qg)
        for b in range(-(-n // page)):
            block = tables[r][b] if by_table else b
            live = b * page + torch.arange(page) < n
            k = torch.where(live[:, None], keys[block].double(), 0.0)         # (H, page, hs)
            v = torch.where(live[:, None], values[block].double(), 0.0)
            s = qg @ k.transpose(-1, -2) / (math.sqrt(hs) if scale else 1.0)   # (H, group, page)
            s = s.masked_fill(~live, -math.inf) if mask_scores else s
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            factor = torch.exp(m - m_new) if rescale else torch.ones_like(m)
            p = torch.exp(s - m_new)
            d = d * factor + p.sum(-1, keepdim=True)
            acc = acc * (factor if rescale_acc else 1.0) + p @ v
            m = m_new
        out[r] = (acc / d).view(nh, hs)
    return out.float()


WALK_MISTAKES = named(W, no_rescale=lambda *c: walk_by_hand(*c, rescale=False),
                      acc_not_rescaled=lambda *c: walk_by_hand(*c, rescale_acc=False),
                      unscaled=lambda *c: walk_by_hand(*c, scale=False),
                      storage_order=lambda *c: walk_by_hand(*c, by_table=False),
                      scores_unmasked=lambda *c: walk_by_hand(*c, mask_scores=False))


def walk_tensors(q: torch.Tensor, tables: list[list[int]], lengths: list[int]) -> tuple:
    """What the launcher hands the kernel besides q and the pool: the block tables as one int32
    tensor (B, width), -1 past a row's last block; the lengths (B,) int32; the output (B, nh,
    hs), NaN until the kernel writes it."""
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32,
                         device=q.device)
    return table, torch.tensor(lengths, dtype=torch.int32, device=q.device), \
        torch.full_like(q, float("nan"))


def run_walk(kernel, q, keys, values, table, lengths, out) -> torch.Tensor:
    """The notebook's launcher: one program per (row, query head)."""
    B, nh, hs = q.shape
    H, page = keys.size(1), keys.size(2)
    kernel[(B, nh)](q, keys, values, table, lengths, out, 1.0 / math.sqrt(hs), q.stride(0),
                    keys.stride(0), keys.stride(1), keys.stride(2), table.stride(0),
                    out.stride(0), GROUP=nh // H, HS=hs, PAGE=page)
    return out


class OutOfBounds(Exception):
    """A load or store the interpreter was about to make outside every tensor the kernel got."""


class Loads:
    """Every load a kernel makes under Triton's interpreter: (program (x, y, z), the unmasked
    byte addresses). Checked as it happens: an address outside the tensors given (`spans`,
    (name, first byte, end)) raises OutOfBounds before the interpreter reads it (on a CPU, a
    read there could crash the Python process; on a GPU it is an illegal memory access)."""

    def __init__(self, spans: list[tuple[str, int, int]]):
        self.spans, self.seen = spans, []

    def _inside(self, addresses, what: str) -> None:
        a = torch.from_numpy(addresses.astype("int64").reshape(-1))
        inside = torch.zeros(a.shape, dtype=torch.bool)
        for _, first, end in self.spans:
            inside |= (a >= first) & (a < end)
        if not bool(inside.all()):
            raise OutOfBounds(f"the kernel {what} an address outside every tensor it was given")

    def __enter__(self):
        from triton.runtime import interpreter
        self.builder = interpreter.interpreter_builder
        load, store = self.builder.create_masked_load, self.builder.create_masked_store

        def watched_load(ptrs, mask, *rest):
            live = ptrs.data[mask.data.astype(bool)] if mask.data.size else ptrs.data
            self._inside(live, "loaded from")
            self.seen.append((tuple(self.builder.grid_idx), live))
            return load(ptrs, mask, *rest)

        def watched_store(ptrs, value, mask, *rest):
            self._inside(ptrs.data[mask.data.astype(bool)], "stored to")
            return store(ptrs, value, mask, *rest)
        self.builder.create_masked_load, self.builder.create_masked_store = \
            watched_load, watched_store
        return self

    def __exit__(self, *exc) -> None:
        del self.builder.create_masked_load, self.builder.create_masked_store  # the class's again

    def of(self, t: torch.Tensor, row: int) -> list[tuple[tuple, torch.Tensor]]:
        """The loads from tensor `t` (a pool of (num_blocks, H, page, hs)), each as the program
        that made it and the (block, head, slot) it read, one row per distinct one."""
        first, size = t.data_ptr(), t.element_size()
        found = []
        for program, addresses in self.seen:
            a = torch.tensor(addresses.astype("int64"))
            inside = a[(a >= first) & (a < first + t.numel() * size)]
            if len(inside):
                index = torch.unique((inside - first) // (size * row))        # (block, h, slot)
                found.append((program, torch.stack([index // (t.size(1) * t.size(2)),
                                                    index // t.size(2) % t.size(1),
                                                    index % t.size(2)], 1)))
        return found


def _not_a_stub(kernel) -> None:
    """The exercise's stub raises NotImplementedError in the loop; a GPU would refuse to compile
    it (no `raise` in a kernel), so it is found in the source first."""
    import inspect

    from ..notebooks import STUB_MESSAGE
    try:
        source = inspect.getsource(getattr(kernel, "fn", kernel))
    except (OSError, TypeError):
        return
    if STUB_MESSAGE in source:
        raise NotImplementedError(STUB_MESSAGE)


def _launch(name: str, case: str, kernel, *args) -> torch.Tensor:
    try:
        return run_walk(kernel, *args)
    except NotImplementedError:
        raise
    except Exception as e:  # noqa: BLE001 - any crash, or the interpreter's wrapping of one
        cause = e.__cause__ if e.__cause__ is not None else e
        if isinstance(cause, NotImplementedError):
            raise cause from None
        if isinstance(cause, OutOfBounds):
            fail(name, case, "loads and stores inside the tensors given", str(cause),
                 W["out_of_bounds"])
        said = str(cause).strip().splitlines()
        fail(name, case, "a kernel that runs", f"{type(cause).__name__}: "
             f"{said[0][:300] if said else ''}",
             W["imported_first"] if "outside of the scope of a kernel" in str(cause) else
             W["raised"])


def _one_block_per_load(name: str, case: str, loads: Loads, pools, page: int) -> None:
    """Refused: a load of keys or values that covers more than one block (the whole row)."""
    for pool in pools:
        for _, read in loads.of(pool, pool.size(3)):
            blocks = len(torch.unique(read[:, 0]))
            if blocks > 1 or len(torch.unique(read[:, 0] * page + read[:, 2])) > page:
                fail(name, case, f"one block ({page} keys) per load", f"one load of "
                     f"{len(read)} keys from {blocks} blocks", W["whole_row"])


def _walk_facts(loads: Loads, keys: torch.Tensor, tables, lengths, group: int) -> str:
    """What the loads show went wrong, under the interpreter: a program that read blocks other
    than its table's, in another order, or the slots past its row's length."""
    page, reads = keys.size(2), {}
    for (row, head, _), read in loads.of(keys, keys.size(3)):
        reads.setdefault((row, head), []).append(read)
    for (row, head), blocks in sorted(reads.items()):
        n, table = lengths[row], tables[row]
        read = [int(p[0, 0]) for p in blocks]
        if read != table:
            return W["table"].format(row=row, head=head, read=read, table=table)
        for p in blocks:
            b = table.index(int(p[0, 0]))
            past = [int(slot) for slot in p[:, 2] if b * page + int(slot) >= n]
            if past:
                return W["stale"].format(row=row, slot=past[0], length=n)
            if bool((p[:, 1] != head // group).any()):
                return W["kv_head"].format(head=head, kv=head // group, read=int(p[0, 1]))
    return ""


@guarded
def check_walk_kernel(kernel) -> None:
    """walk_kernel, a Triton kernel, launched one program per (row, query head) on three paged
    layouts: the engine's walk within 1e-4, and under the interpreter one block per load."""
    name = "walk_kernel"
    if _triton() is None:
        print(W["skipped"])
        return
    _not_a_stub(kernel)
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction
    interpreted = isinstance(kernel, InterpretedFunction)
    if not interpreted and not isinstance(kernel, JITFunction):
        fail(name, "the kernel", "a function decorated with @triton.jit",
             f"a {type(kernel).__module__}.{type(kernel).__name__}", W["not_jit"])
    if not interpreted and not torch.cuda.is_available():
        fail(name, "the kernel", "a kernel the interpreter runs (no CUDA device here)",
             "a kernel compiled for a GPU", W["no_gpu"])
    device = "cpu" if interpreted else "cuda"
    for layout in WALK_LAYOUTS:
        lengths, page, heads, nh, hs, _ = layout
        case = (f"{len(lengths)} rows of lengths {lengths}, blocks of {page}, {nh} query heads "
                f"on {heads} K/V heads of {hs}")
        q, keys, values, tables, _ = walk_layout(*layout)
        args = [t.to(device) for t in (q, keys, values)]
        args += walk_tensors(args[0], tables, lengths)
        spans = [(str(i), t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
                 for i, t in enumerate(args)]
        with Loads(spans) if interpreted else contextlib.nullcontext() as loads:
            out = _launch(name, case, kernel, *args).cpu()
        if interpreted:
            _one_block_per_load(name, case, loads, args[1:3], page)
        want = walk_reference(q, keys, values, tables, lengths)
        if torch.allclose(out, want, atol=WALK_TOL, rtol=WALK_TOL):
            continue
        found = [hint for hint, wrong in WALK_MISTAKES.items()
                 if torch.allclose(out.double(), wrong(q, keys, values, tables, lengths).double(),
                                   atol=WALK_TOL, rtol=WALK_TOL, equal_nan=True)]
        nan = bool(out.isnan().any())
        facts = _walk_facts(loads, args[1], tables, lengths, nh // heads) if interpreted else ""
        hint = found[0] if found else facts or (W["nan"] if nan else W["otherwise"])
        rows = sorted({int(r) for r in torch.nonzero(
            ~torch.isclose(out, want, WALK_TOL, WALK_TOL))[:, 0]})
        fail(name, case, f"the engine's walk (flash.walk) within {WALK_TOL:g}",
             f"NaN in rows {rows}" if nan else
             f"values off by up to {float((out - want).abs().max()):.4g} in rows {rows}", hint)
    passed(name, len(WALK_LAYOUTS))
    if not interpreted:
        print(W["compiled"])
