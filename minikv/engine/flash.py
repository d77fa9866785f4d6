"""The attention kernel that reads the cache, as a GPU runs it, in readable PyTorch.

A GPU kernel never holds a query's scores against all its keys: it reads the keys a tile at a
time from the GPU's main memory into a small fast memory, and keeps, per query, three running
numbers instead: the largest score so far (m), the sum of exp(score - m) so far (the
softmax's denominator), and the output so far. Rescaled by exp(m_old - m_new) whenever a
larger score turns up, they give the softmax exactly, in one pass over the keys
(`online_softmax`; Milakov & Gimelshein 2018). Three kernels are built on it here, slow on
purpose (loops a GPU runs in parallel run one after another), each equal to a fast one up to
rounding:

- `tiled_attention`: FlashAttention (Dao et al. 2022): queries and keys in tiles, the T x T
  score matrix never made; `naive_attention` makes it. Both count what they move (`IO`).
- `walk`: one decode query reading its block table page by page, tile by tile (vLLM's
  PagedAttention): the engine's `attention.paged_attention` computed one row at a time.
- `flash_decoding`: the keys split into runs walked side by side, each giving a `Partial`,
  merged by `combine`: the split-KV merge paged_attention does (its step 5 calls `combine`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .validate import int_at_least

KEYS_PER_TILE = 8  # the kernel reads keys in tiles; a split holds whole tiles


def splits_of(n_blocks: int, page_size: int, n_splits: int) -> tuple[int, int, int]:
    """Keys per tile, tiles per split and how many splits, when the longest row holds
    n_blocks pages: at most n_splits runs of whole tiles, as even as can be."""
    tile = math.gcd(page_size, KEYS_PER_TILE)
    n_tiles = n_blocks * page_size // tile
    per_split = -(-n_tiles // max(1, min(n_splits, n_tiles)))
    return tile, per_split, -(-n_tiles // per_split)


# --- the online softmax ---------------------------------------------------------------
def online_softmax(x: torch.Tensor, tile: int = KEYS_PER_TILE) -> tuple[torch.Tensor, ...]:
    """softmax over x's last dimension from ONE pass over its tiles for the max m and the
    denominator, the sum of exp(x - m) (a larger max met later rescales the sum so far by
    exp(m_old - m_new)), then exp(x - m) / denominator. Returns (probabilities, m,
    denominator); m and the denominator keep a last dimension of 1."""
    int_at_least("tile", tile, hint=" (scores read per step)")
    m = x.new_full((*x.shape[:-1], 1), float("-inf"))
    denom = x.new_zeros(m.shape)
    for start in range(0, x.size(-1), tile):
        t = x[..., start:start + tile]
        m_new = torch.maximum(m, t.amax(-1, keepdim=True))
        denom = denom * torch.exp(m - m_new) + torch.exp(t - m_new).sum(-1, keepdim=True)
        m = m_new
    return torch.exp(x - m) / denom, m, denom


def absorb(m: torch.Tensor, denom: torch.Tensor, acc: torch.Tensor, s: torch.Tensor,
           v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One tile into a kernel's running state: its scores s (..., n) and values v (..., n, hs)
    into the max m, the denominator and the unnormalised output acc (..., hs) of the tiles
    before. Returns the new (m, denom, acc); the output so far is acc / denom."""
    m_new = torch.maximum(m, s.amax(-1, keepdim=True))
    rescale = torch.exp(m - m_new)      # what was summed against the old max, brought to the new
    p = torch.exp(s - m_new)
    return m_new, denom * rescale + p.sum(-1, keepdim=True), acc * rescale + p @ v


# --- a partial result, and the merge ---------------------------------------------------
@dataclass
class Partial:
    """Attention over some of a query's keys, as a kernel keeps it: `out`, the softmax-weighted
    mean of their values (..., hs); `max`, their largest score (..., 1); `sum`, the sum of
    exp(score - max) over them (..., 1). Partials over disjoint keys merge (`combine`) into
    the partial over all of them. No keys at all: out 0, max 0, sum 0 (it then weighs 0)."""
    out: torch.Tensor
    max: torch.Tensor
    sum: torch.Tensor


def combine(out: torch.Tensor, max: torch.Tensor, sum: torch.Tensor, dim: int) -> Partial:
    """Partials stacked along `dim` merged into one, as one softmax over all their keys:
    partial i had its exps taken against its own max, so its sum counts exp(max_i - M) x
    sum_i against the largest max M, and its output weighs that much."""
    top = max.amax(dim, keepdim=True)
    weight = torch.exp(max - top) * sum               # each partial's share, against M
    total = weight.sum(dim)
    return Partial((weight * out).sum(dim) / total, top.squeeze(dim), total)


def merge(a: Partial, b: Partial) -> Partial:
    """Two partials over disjoint keys -> the partial over both."""
    return combine(*(torch.stack([x, y]) for x, y in ((a.out, b.out), (a.max, b.max),
                                                       (a.sum, b.sum))), dim=0)


# --- what a kernel moves --------------------------------------------------------------
@dataclass
class IO:
    """What an attention kernel moves between the GPU's main memory (HBM) and its fast
    on-chip memory, counted as it runs: bytes read and written, the most bytes of scores
    it holds at once, and its (query tile, key tile) pairs computed whole, computed with a
    mask (they cross the causal diagonal) and skipped (wholly in the future)."""
    read: int = 0
    written: int = 0
    peak_scores: int = 0
    tiles: dict = field(default_factory=lambda: {"full": 0, "masked": 0, "skipped": 0})

    def load(self, *tensors: torch.Tensor) -> None:
        self.read += sum(t.numel() * t.element_size() for t in tensors)

    def store(self, t: torch.Tensor) -> None:
        self.written += t.numel() * t.element_size()

    def hold(self, scores: torch.Tensor) -> None:
        self.peak_scores = max(self.peak_scores, scores.numel() * scores.element_size())


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                    io: IO | None = None) -> torch.Tensor:
    """Attention as written on paper, the way a framework runs it op by op: the scores S =
    q kᵀ/√hs (T x L) are written to main memory, read back for the softmax, its P written and
    read back for P v. q (B, nh, T, hs), k and v (B, nh, L, hs); the T queries are the last T
    of the L positions."""
    io = io if io is not None else IO()
    T, L = q.size(-2), k.size(-2)
    check_tiles(q, k, v, 1, 1)
    io.load(q, k)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))                 # (B, nh, T, L)
    if causal:
        future = torch.ones(T, L, dtype=torch.bool, device=q.device).triu(L - T + 1)
        scores = scores.masked_fill(future, float("-inf"))
    io.hold(scores)
    io.store(scores)
    io.load(scores)
    probs = scores.softmax(-1)
    io.store(probs)
    io.load(probs, v)
    out = probs @ v
    io.store(out)
    return out


# --- FlashAttention: queries and keys in tiles ----------------------------------------
def tile_kind(i: int, j: int, block_q: int, block_k: int, T: int, L: int) -> str:
    """Query tile i against key tile j under the causal mask, the T queries being the last T
    of L positions: "skipped" if every key is after every query, "full" if every key is at or
    before every query, else "masked" (the diagonal crosses it)."""
    first_q = L - T + i * block_q                        # positions of the tile's queries
    last_q = L - T + min((i + 1) * block_q, T) - 1
    first_k, last_k = j * block_k, min((j + 1) * block_k, L) - 1
    if first_k > last_q:
        return "skipped"
    return "full" if last_k <= first_q else "masked"


def tiled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                    block_q: int = 64, block_k: int = 64, io: IO | None = None) -> torch.Tensor:
    """FlashAttention's forward pass: for each tile of block_q queries, read the keys and
    values tile by tile and keep the online softmax's running max, sum and (unnormalised)
    output; write the output once. No tensor of scores larger than block_q x block_k per head
    is ever made. Shapes as naive_attention's."""
    io = io if io is not None else IO()
    T, L, hs = q.size(-2), k.size(-2), q.size(-1)
    check_tiles(q, k, v, block_q, block_k)
    out = torch.empty_like(q)
    for i in range(-(-T // block_q)):
        rows = slice(i * block_q, (i + 1) * block_q)
        q_tile = q[..., rows, :]
        io.load(q_tile)
        m = q_tile.new_full((*q_tile.shape[:-1], 1), float("-inf"))  # running max
        denom = q_tile.new_zeros(m.shape)                             # running sum of exps
        acc = torch.zeros_like(q_tile)                                # running sum of exps x v
        for j in range(-(-L // block_k)):
            kind = tile_kind(i, j, block_q, block_k, T, L) if causal else "full"
            io.tiles[kind] += 1
            if kind == "skipped":
                continue  # 1. a tile wholly in the future: never read
            cols = slice(j * block_k, (j + 1) * block_k)
            k_tile, v_tile = k[..., cols, :], v[..., cols, :]
            io.load(k_tile, v_tile)
            # 2. this tile's scores, masked where the diagonal crosses it
            s = q_tile @ k_tile.transpose(-1, -2) / math.sqrt(hs)           # (.., bq, bk)
            if kind == "masked":
                q_pos = L - T + torch.arange(rows.start, rows.start + s.size(-2), device=q.device)
                k_pos = torch.arange(cols.start, cols.start + s.size(-1), device=q.device)
                s = s.masked_fill(k_pos > q_pos[:, None], float("-inf"))
            io.hold(s)
            # 3. the online softmax: a larger max rescales what was summed so far
            m, denom, acc = absorb(m, denom, acc, s, v_tile)
        out[..., rows, :] = acc / denom                  # 4. normalise once, write once
        io.store(out[..., rows, :])
    return out


# --- a decode query walking its block table (PagedAttention), and FlashDecoding --------
@dataclass
class WalkStep:
    """One tile of a walk: where its keys were read (block, first slot, how many, their first
    position) and the running max, sum and output after it, per query head."""
    block: int
    slot: int
    n: int
    position: int
    max: torch.Tensor
    sum: torch.Tensor
    out: torch.Tensor


def walk(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, table: list[int],
         start: int, end: int, tile: int = KEYS_PER_TILE,
         steps: list[WalkStep] | None = None) -> Partial:
    """One decode query q (nh, hs) against positions start..end-1 of its sequence, read
    through its block table (a list of block ids) from a layer's pool (num_blocks, H, page,
    hs) tile by tile, with the online softmax: one program of a PagedAttention kernel. Query
    head h reads K/V head h // (nh / H). `steps`, if given, gets a WalkStep per tile."""
    nh, hs = q.shape
    H, page = keys.size(1), keys.size(2)
    int_at_least("tile", tile, hint=" (keys read per step)")
    int_at_least("end", end, start, " (one past the last position read)",
                 len(table) * page + 1)
    tile = math.gcd(page, tile)                     # a tile never straddles two pages
    acc_dtype = torch.promote_types(q.dtype, torch.float32)
    qg = q.view(H, nh // H, hs).to(acc_dtype)                           # (H, group, hs)
    m = qg.new_full((H, nh // H, 1), float("-inf"))
    denom, acc = qg.new_zeros(m.shape), torch.zeros_like(qg)
    for position in range(start, end, tile):
        # 1. the tile's page and slots, from the block table
        block, slot = table[position // page], position % page
        n = min(tile, end - position)
        k_tile = keys[block, :, slot:slot + n].to(acc_dtype)               # (H, n, hs)
        v_tile = values[block, :, slot:slot + n].to(acc_dtype)
        # 2. scores, then the online softmax (as tiled_attention's step 3)
        s = qg @ k_tile.transpose(-1, -2) / math.sqrt(hs)                   # (H, group, n)
        m, denom, acc = absorb(m, denom, acc, s, v_tile)
        if steps is not None:
            steps.append(WalkStep(block, slot, n, position, m.view(nh).clone(),
                                  denom.view(nh).clone(), (acc / denom).view(nh, hs)))
    if start >= end:  # no keys: a partial that weighs nothing when merged
        return Partial(acc.view(nh, hs), m.new_zeros(nh, 1), denom.view(nh, 1))
    return Partial((acc / denom).view(nh, hs), m.view(nh, 1), denom.view(nh, 1))


def flash_decoding(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   table: list[int], length: int, n_splits: int) -> Partial:
    """FlashDecoding (Dao et al. 2023): the row's key tiles cut into at most n_splits runs of
    whole tiles (as paged_attention cuts them, `splits_of`), each walked on its own (on a GPU,
    side by side), their partials merged. With one split it is one walk."""
    tile, per_split, n = splits_of(len(table), keys.size(2), n_splits)
    edges = [min(s * per_split * tile, length) for s in range(n + 1)]  # a split may be empty
    parts = [walk(q, keys, values, table, a, b, tile) for a, b in zip(edges, edges[1:])]
    return combine(*(torch.stack([getattr(p, f) for p in parts]) for f in ("out", "max", "sum")),
                   dim=0)


def check_tiles(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_q: int,
                block_k: int) -> None:
    int_at_least("block_q", block_q, hint=" (queries per tile)")
    int_at_least("block_k", block_k, hint=" (keys per tile)")
    if q.dim() != 4 or k.shape != v.shape or k.shape[:2] + k.shape[3:] != q.shape[:2] + q.shape[3:]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: give "
                         "(B, nh, T, hs) queries and (B, nh, L, hs) keys and values")
    if q.size(-2) > k.size(-2):
        raise ValueError(f"{q.size(-2)} queries but {k.size(-2)} keys: the queries are the last "
                         "of the positions the keys hold")
