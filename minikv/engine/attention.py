"""The attention functions the decoders swap into `GPT.forward(attention=...)`. The
model's own, `causal_attention`, stays in model.py beside its `# KV-CACHE` line; every
other one is here: a left-padded batch (batch.py), packed prompts (serving.py), a decode
batch read through block tables with split-KV (serving.py), and a sink-and-window mask
(window.py). Each takes q (B, nh, T, hs) and the keys and values the cache gave back, and
returns (B, nh, T, hs)."""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

from .flash import combine, splits_of
from .rope import turn
from .validate import int_at_least, number_in

# (q, k, v) -> attention output: what GPT.forward calls in every layer
Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """PyTorch's attention kernel; with fewer K/V heads than query heads (grouped-query
    attention), each K/V head is read by its group of n_head / n_kv_head query heads."""
    if k.size(1) != q.size(1):
        kwargs["enable_gqa"] = True
    return F.scaled_dot_product_attention(q, k, v, **kwargs)


# --- a left-padded batch (batch.py) ----------------------------------------------------
def padded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     pad: torch.Tensor) -> torch.Tensor:
    """Causal attention over a left-padded batch: query i of row b sees keys up to its
    own column, except row b's first pad[b] keys (its padding). k, v: (B, nh, L, hs)."""
    T, L = q.size(-2), k.size(-2)
    causal = torch.ones(T, L, dtype=torch.bool, device=q.device).tril(diagonal=L - T)  # (T, L)
    real = torch.arange(L, device=q.device) >= pad.view(-1, 1)                       # (B, L)
    allowed = causal & real[:, None, :]                                               # (B, T, L)
    return sdpa(q, k, v, attn_mask=allowed[:, None])


# --- prompts packed into one row (serving.py's prefill) --------------------------------
def packed_causal_mask(past: list[int], counts: list[int], device,
                       inner: list | None = None) -> torch.Tensor:
    """(sum counts, sum (past + counts)) booleans for a packed pass: sequence i's
    counts[i] new tokens see its own past[i] cached positions and their own earlier
    tokens, nothing else; or, among themselves, what inner[i] (counts[i], counts[i])
    allows (a token tree's mask, tree.tree_mask), where it is not None."""
    blocks = [torch.ones(n, p + n, dtype=torch.bool, device=device).tril(p)
              for p, n in zip(past, counts)]
    for block, p, mask in zip(blocks, past, inner or []):
        if mask is not None:
            block[:, p:] = mask
    return torch.block_diag(*blocks)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     mask: torch.Tensor) -> torch.Tensor:
    """Attention where query i sees key j iff mask[i, j] (e.g. a packed_causal_mask)."""
    return sdpa(q, k, v, attn_mask=mask)


# --- a decode batch read through block tables (serving.py's decode) --------------------
GPU_WORKERS = 132  # streaming multiprocessors of an H100: split-KV aims to keep them all busy


def num_kv_splits(batch_size: int, n_head: int, seq_len: int) -> int:
    """FlashDecoding's heuristic: split the keys (at least 8 a chunk) until batch x heads
    x splits fills the GPU."""
    return max(1, min(math.ceil(GPU_WORKERS / (batch_size * n_head)), math.ceil(seq_len / 8)))


def paged_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    tables: torch.Tensor, lengths: torch.Tensor, n_splits: int,
                    real: tuple | None = None) -> torch.Tensor:
    """Decode attention read through block tables, as vLLM's PagedAttention kernel does.
    q (B, nh, 1, hs): a query per row; keys, values: a layer's pool (num_blocks, H, page,
    hs), a K/V head per nh / H query heads; tables (B, nb): each row's blocks, -1 past
    its last; lengths (B,): the positions each row sees. Split-KV (FlashDecoding): the
    longest row's key tiles are cut into n_splits runs, each giving a partial softmax
    (rounded to the model's dtype), its max and its sum, merged as one softmax would be,
    up to rounding (so a row's result depends on the batch). `real`: (rows, js) of the real
    blocks, if the caller knows them (a GPU then never stops to read the tables back)."""
    B, nh, _, hs = q.shape
    H, page, hv = keys.size(1), keys.size(2), values.size(-1)  # hv: MLA's values are narrower
    group = nh // H                                                  # query heads per K/V head
    tile, per_split, S = splits_of(tables.size(1), page, n_splits)
    tiles_per_block = page // tile
    acc = torch.promote_types(q.dtype, torch.float32)                # the softmax in >= fp32
    # 1. Every real block of every row, no padding rows: its row, its index in the row.
    row, j = (tables >= 0).nonzero(as_tuple=True) if real is None else real
    kb, vb = keys[tables[row, j]], values[tables[row, j]]            # (N, H, page, hs)
    # 2. Scores of each block's keys, masked past the row's length.
    q_groups = q.view(B, H, group, hs)[row]                          # (N, H, g, hs)
    scores_b = (q_groups @ kb.transpose(-1, -2)).to(acc) / math.sqrt(hs)  # (N, H, g, page)
    past_end = j[:, None] * page + torch.arange(page, device=q.device) >= lengths[row, None]
    scores_b = scores_b.masked_fill(past_end[:, None, None], float("-inf"))
    # 3. Lay the blocks' tiles out per row; cut each row into S splits of whole tiles.
    tile_idx = j[:, None] * tiles_per_block + torch.arange(tiles_per_block, device=q.device)
    scores = scores_b.new_full((B, S * per_split, H, group, tile), float("-inf"))
    scores[row[:, None], tile_idx] = (scores_b.view(-1, H, group, tiles_per_block, tile)
                                      .permute(0, 3, 1, 2, 4))
    scores = scores.view(B, S, per_split, H, group, tile)
    # 4. Each split's softmax: its max, its sum, its partial output.
    split_max = scores.amax(dim=(2, 5), keepdim=True)
    split_max = torch.where(torch.isinf(split_max), 0.0, split_max)  # a split of padding only
    probs = torch.exp(scores - split_max)
    split_sum = probs.sum(dim=(2, 5), keepdim=True).squeeze(2)       # (B, S, H, g, 1)
    probs = probs.view(B, S * per_split, H, group, tile)[row[:, None], tile_idx]
    pv = probs.permute(0, 2, 1, 3, 4) @ vb.view(-1, H, tiles_per_block, tile, hv).to(acc)
    out = pv.new_zeros(B, S * per_split, H, group, hv)
    out[row[:, None], tile_idx] = pv.permute(0, 2, 1, 3, 4)          # (N, nt, H, g, hs) placed
    out = (out.view(B, S, per_split, H, group, hv).sum(2) / split_sum.clamp(min=1e-30)).to(q.dtype)
    # 5. Merge the splits as one softmax would (flash.combine): each weighs exp(its max - max)
    #    x its sum.
    out = combine(out.to(acc), split_max.squeeze(2), split_sum, dim=1).out  # (B, H, g, hs)
    return out.reshape(B, nh, 1, hv).to(q.dtype)


def split_kv_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor,
                       n_splits: int) -> torch.Tensor:
    """Split-KV decode attention over right-padded dense keys (B, nh, L, hs), row b
    seeing its first lengths[b]: paged_attention with each split one block of
    ceil(L / n_splits) keys."""
    B, nh, L, _ = k.shape
    chunk = math.ceil(L / n_splits)

    def as_blocks(t: torch.Tensor) -> torch.Tensor:  # (B, nh, L, w) -> (B * splits, nh, chunk, w)
        t = F.pad(t, (0, 0, 0, chunk * n_splits - L)).view(B, nh, n_splits, chunk, t.size(-1))
        return t.transpose(1, 2).reshape(B * n_splits, nh, chunk, t.size(-1))
    tables = torch.arange(B * n_splits, device=q.device).view(B, n_splits)
    return paged_attention(q, as_blocks(k), as_blocks(v), tables, lengths, n_splits)


# --- sinks and a sliding window, one full pass (window.py) -----------------------------
def window_attention(sinks: int, window: int, reindex_theta: float | None = None) -> Attention:
    """Attention for one full pass, no cache, that gives every token what feeding the
    text one token per pass through a SinkWindowCache(sinks, window) gives it: query t
    sees key j iff j <= t and (j < sinks or j >= t - window). (The cache evicts after a
    pass, so the last `window` positions and the new token are there together.) Many
    texts measured at once. `reindex_theta`: a rotary model's cache that numbers its
    positions by slot (rope="reindex" or "rerotate", theta its rope_theta); q and k
    come turned by their true positions."""
    int_at_least("sinks", sinks, 0)
    int_at_least("window", window)
    if reindex_theta is not None:  # None: true positions
        number_in("reindex_theta", reindex_theta, 1, hint=" (the model's rope_theta)")

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if q.size(-2) != k.size(-2):
            raise ValueError("one full pass without a cache only: stream with a SinkWindowCache")
        t = torch.arange(q.size(-2), device=q.device)[:, None]  # queries
        j = torch.arange(k.size(-2), device=q.device)[None, :]  # keys
        sees = (j <= t) & ((j < sinks) | (j >= t - window))
        if reindex_theta is None:
            return sdpa(q, k, v, attn_mask=sees)
        # By slot, query t sits at slot min(t, sinks + window): a window key moved down as
        # many slots as the query did, so their distance stands; a sink did not move, so
        # the query sees it from its slot, t - slot positions nearer than it truly is.
        k, v = (x.repeat_interleave(q.size(1) // x.size(1), dim=1) for x in (k, v))
        slot = t[:, 0].clamp(max=sinks + window)
        q_at_slot = turn(q, slot - t[:, 0], reindex_theta)  # turned back to its slot
        scores = torch.where(j < sinks, q_at_slot @ k.transpose(-1, -2), q @ k.transpose(-1, -2))
        scores = (scores / math.sqrt(q.size(-1))).masked_fill(~sees, float("-inf"))
        return scores.softmax(-1).to(v.dtype) @ v
    return attention
