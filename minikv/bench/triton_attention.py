"""Chapter 09's two loops as GPU kernels, in Triton: FlashAttention's forward pass (one program
per tile of queries and head, walking the key tiles with the online softmax) and PagedAttention's
decode (one program per request and query head, walking its block table a page at a time).
The algorithm is `engine/flash.py`'s, line for line: here each program runs on one of the GPU's
streaming multiprocessors, its tile of scores in registers and on-chip memory, the T x L scores
never written to the GPU's main memory.

Triton and a CUDA GPU are needed: requirements.txt brings Triton on Linux x86-64 (chapter 09's
exercise runs a kernel on a CPU through its interpreter), CI has no GPU;
`tests/test_triton_attention.py` checks both kernels where a GPU is, and
`benchmarks/attention/bench_gpu.py` times them against PyTorch's attention.
"""
from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton here: the kernels cannot be defined, and say so when called
    triton = None


def _need_triton() -> None:
    if triton is None:
        raise ImportError("minikv.bench.triton_attention needs Triton and a CUDA GPU "
                          "(pip install triton); the chapter's kernels in readable PyTorch are "
                          "in minikv.engine.flash and run anywhere")


if triton is not None:
    @triton.jit
    def _flash_forward(Q, K, V, Out, scale, T, L,
                       stride_qh, stride_qt, stride_kh, stride_kt, stride_oh, stride_ot,
                       HS: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
                       CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
        # one program: BLOCK_Q queries of one (batch, head); q/k/v rows are contiguous in hs
        tile, bh = tl.program_id(0), tl.program_id(1)
        rows = tile * BLOCK_Q + tl.arange(0, BLOCK_Q)                # query index in 0..T-1
        dims = tl.arange(0, HS)
        q = tl.load(Q + bh * stride_qh + rows[:, None] * stride_qt + dims[None, :],
                    mask=rows[:, None] < T, other=0.0)
        m = tl.full([BLOCK_Q], float("-inf"), tl.float32)            # running max
        denom = tl.zeros([BLOCK_Q], tl.float32)                      # running sum of exps
        acc = tl.zeros([BLOCK_Q, HS], tl.float32)                    # running sum of exps x v
        q_pos = L - T + rows                                         # the queries are the last T
        last_q = L                         # a key tile is read if it starts by the last query
        if CAUSAL:
            last_q = L - T + (tile + 1) * BLOCK_Q - 1
        for start in range(0, L, BLOCK_K):
            if start <= last_q:            # a tile wholly after every query is never loaded
                m, denom, acc = _absorb_tile(q, K + bh * stride_kh, V + bh * stride_kh, m, denom,
                                             acc, start, q_pos, L, scale, stride_kt, HS, BLOCK_K,
                                             CAUSAL, PRECISION)
        out = acc / tl.where(denom == 0.0, 1.0, denom)[:, None]
        tl.store(Out + bh * stride_oh + rows[:, None] * stride_ot + dims[None, :],
                 out.to(Out.dtype.element_ty), mask=rows[:, None] < T)

    @triton.jit
    def _absorb_tile(q, K, V, m, denom, acc, start, q_pos, L, scale, stride_kt,
                     HS: tl.constexpr, BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr,
                     PRECISION: tl.constexpr):
        # one key tile into the running state (engine.flash.absorb)
        dims = tl.arange(0, HS)
        cols = start + tl.arange(0, BLOCK_K)
        k = tl.load(K + cols[:, None] * stride_kt + dims[None, :], mask=cols[:, None] < L,
                    other=0.0)
        v = tl.load(V + cols[:, None] * stride_kt + dims[None, :], mask=cols[:, None] < L,
                    other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # (BLOCK_Q, BLOCK_K)
        seen = cols[None, :] < L
        if CAUSAL:  # the tiles the diagonal crosses: a query sees keys at or before it
            seen = seen & (cols[None, :] <= q_pos[:, None])
        s = tl.where(seen, s, float("-inf"))
        # the online softmax: a larger max rescales what was summed so far
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees nothing yet
        rescale = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        denom = denom * rescale + tl.sum(p, 1)
        acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        return m_new, denom, acc

    @triton.jit
    def _paged_decode(Q, Keys, Values, Tables, Lengths, Out, scale, n_blocks,
                      stride_qb, stride_kb, stride_kh, stride_kp, stride_tb, stride_ob,
                      GROUP: tl.constexpr, HS: tl.constexpr, PAGE: tl.constexpr):
        # one program: one request's query for one head, walking its block table page by page
        row, head = tl.program_id(0), tl.program_id(1)
        kv_head = head // GROUP                                       # grouped-query attention
        dims = tl.arange(0, HS)
        q = tl.load(Q + row * stride_qb + head * HS + dims).to(tl.float32)
        length = tl.load(Lengths + row)
        m = tl.full([1], float("-inf"), tl.float32)
        denom = tl.zeros([1], tl.float32)
        acc = tl.zeros([HS], tl.float32)
        for b in range(0, n_blocks):
            if b * PAGE < length:
                m, denom, acc = _absorb_page(q, Keys, Values, Tables, m, denom, acc, row, b,
                                             kv_head, length, scale, stride_kb, stride_kh,
                                             stride_kp, stride_tb, HS, PAGE)
        tl.store(Out + row * stride_ob + head * HS + dims,
                 (acc / denom).to(Out.dtype.element_ty))

    @triton.jit
    def _absorb_page(q, Keys, Values, Tables, m, denom, acc, row, b, kv_head, length, scale,
                     stride_kb, stride_kh, stride_kp, stride_tb, HS: tl.constexpr,
                     PAGE: tl.constexpr):
        # one page of a row's keys into the running state, found through the block table
        dims = tl.arange(0, HS)
        slots = tl.arange(0, PAGE)
        block = tl.load(Tables + row * stride_tb + b)                 # the block table lookup
        base = block.to(tl.int64) * stride_kb + kv_head * stride_kh
        live = b * PAGE + slots < length   # slots past the row's length hold stale K/V: never read
        k = tl.load(Keys + base + slots[:, None] * stride_kp + dims[None, :], mask=live[:, None],
                    other=0.0).to(tl.float32)
        v = tl.load(Values + base + slots[:, None] * stride_kp + dims[None, :], mask=live[:, None],
                    other=0.0).to(tl.float32)
        s = tl.sum(q[None, :] * k, 1) * scale                         # (PAGE,)
        s = tl.where(live, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 0))
        rescale = tl.exp(m - m_new)
        p = tl.exp(s - m_new)
        return m_new, denom * rescale + tl.sum(p, 0), acc * rescale + tl.sum(p[:, None] * v, 0)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                    block_q: int = 64, block_k: int = 64) -> torch.Tensor:
    """FlashAttention's forward pass on the GPU: q (B, nh, T, hs), k and v (B, nh, L, hs), the T
    queries the last T of the L positions (as engine.flash.tiled_attention). hs a power of two
    in 16..128; fp16, bf16 or fp32."""
    _need_triton()
    B, nh, T, hs = q.shape
    L = k.size(2)
    if hs not in (16, 32, 64, 128) or k.shape != v.shape or T > L:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}: hs must be 16, 32, 64 or 128 "
                         "and the queries the last of the keys' positions")
    q, k, v = (x.contiguous().view(B * nh, -1, hs) for x in (q, k, v))
    out = torch.empty_like(q)
    grid = (triton.cdiv(T, block_q), B * nh)
    _flash_forward[grid](q, k, v, out, 1.0 / math.sqrt(hs), T, L,
                         q.stride(0), q.stride(1), k.stride(0), k.stride(1), out.stride(0),
                         out.stride(1), HS=hs, BLOCK_Q=block_q, BLOCK_K=block_k, CAUSAL=causal,
                         # fp32 in full (IEEE) precision, not TensorFloat-32's 10 fraction bits
                         PRECISION="ieee" if q.dtype == torch.float32 else "tf32")
    return out.view(B, nh, T, hs)


def paged_decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 tables: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """PagedAttention's decode on the GPU, the arguments of engine.attention.paged_attention:
    q (B, nh, 1, hs); keys, values a layer's pool (num_blocks, H, page, hs); tables (B, nb),
    -1 past a row's last block; lengths (B,). One program per (row, query head), no split."""
    _need_triton()
    B, nh, _, hs = q.shape
    H, page = keys.size(1), keys.size(2)
    q = q.contiguous().view(B, nh * hs)
    keys, values = keys.contiguous(), values.contiguous()
    tables = tables.to(torch.int32).contiguous()
    out = torch.empty_like(q)
    _paged_decode[(B, nh)](q, keys, values, tables, lengths.to(torch.int32).contiguous(), out,
                           1.0 / math.sqrt(hs), tables.size(1), q.stride(0), keys.stride(0),
                           keys.stride(1), keys.stride(2), tables.stride(0), out.stride(0),
                           GROUP=nh // H, HS=hs, PAGE=page)
    return out.view(B, nh, 1, hs)
