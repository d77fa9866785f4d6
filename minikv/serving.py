"""A small batched server with deterministic requests (seed 001, after LLM-42, arXiv 2601.17768).

Fast path: every active request advances one token per step in ONE batched forward pass. Its numbers
depend on who else is in the batch, through two mechanisms real servers have:
  * split-KV decode attention (FlashDecoding, vLLM's PagedAttention v2) cuts each request's keys into
    as many chunks as it takes to keep the GPU busy, so the chunk count follows the batch size, and
    per-chunk results are kept in the model's dtype;
  * the matmuls see a different number of rows, and BLAS picks kernels (and summation orders) by shape.
Verifier: for a deterministic request, every `window` positions are replayed alone (batch 1) in one pass
of exactly `window` rows, at window boundaries fixed relative to the prompt. Every committed number is
thus computed by the same-shaped call at the same row, whatever the batch: bit-identical output. The
shared verify-and-rollback core commits the matching prefix, or rolls back at the first mismatch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F

from .cache import KVCache
from .config import GPTConfig
from .generate import as_token_list
from .sampling import check_sampling_args
from .trace import TraceEvent
from .verify import VerifyStats, greedy_or_sampled, judge_by_match, round_events, verify_and_commit

GPU_WORKERS = 132  # streaming multiprocessors on an H100: split-KV kernels aim to keep this many busy


def num_kv_splits(batch_size: int, n_head: int, seq_len: int, min_chunk: int = 8) -> int:
    """FlashDecoding's heuristic: split the keys until batch x heads x splits fills the GPU."""
    return max(1, min(math.ceil(GPU_WORKERS / (batch_size * n_head)), math.ceil(seq_len / min_chunk)))


def split_kv_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor,
                       n_splits: int) -> torch.Tensor:
    """Decode attention over right-padded keys (B, nh, L, hs), row b seeing its first lengths[b] keys.

    Each split computes a softmax-weighted partial output (rounded to the model's dtype) plus its max
    and sum; the partials are then merged exactly as one softmax would be, up to rounding.
    """
    B, nh, T, hs = q.shape
    assert T == 1, "split-KV attention is for decode steps: one new token per request"
    L = k.size(2)
    chunk = math.ceil(L / n_splits)
    pad = chunk * n_splits - L
    k, v = (F.pad(t, (0, 0, 0, pad)).view(B, nh, n_splits, chunk, hs) for t in (k, v))
    scores = (q.unsqueeze(2) @ k.transpose(-1, -2)).float() / math.sqrt(hs)        # (B, nh, S, 1, chunk)
    key_pos = torch.arange(n_splits * chunk, device=q.device).view(n_splits, 1, chunk)
    scores = scores.masked_fill(key_pos >= lengths.view(B, 1, 1, 1, 1), float("-inf"))
    m = scores.amax(-1, keepdim=True)                                                 # per-split max
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)                      # fully padded splits
    p = torch.exp(scores - m_safe)
    l = p.sum(-1, keepdim=True)                                                       # per-split sum
    partial_out = ((p @ v.float()) / l.clamp(min=1e-30)).to(q.dtype)                  # stored in model dtype
    weight = torch.exp(m - m.amax(2, keepdim=True)) * l                               # merge the splits
    out = (weight * partial_out.float()).sum(2) / weight.sum(2)
    return out.to(q.dtype)                                                            # (B, nh, 1, hs)


class RaggedCaches:
    """Each request's own KVCache, stepped together: `update` returns keys right-padded to the longest."""

    def __init__(self, caches: list[KVCache]):
        self.caches = caches

    def check_fits(self, cfg: GPTConfig, batch_size: int, n_new: int, device, dtype) -> None:
        if batch_size != len(self.caches):
            raise ValueError(f"batch of {batch_size} rows for {len(self.caches)} request caches")
        for cache in self.caches:
            cache.check_fits(cfg, 1, n_new, device, dtype)

    def get_seq_length(self) -> int:
        raise ValueError("requests in a ragged batch have different lengths: pass positions= explicitly")

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        ks, vs = zip(*(c.update(key[b:b + 1], value[b:b + 1], layer_idx) for b, c in enumerate(self.caches)))
        longest = max(k.size(2) for k in ks)
        pad = lambda t: F.pad(t, (0, 0, 0, longest - t.size(2)))  # noqa: E731
        return torch.cat([pad(k) for k in ks]), torch.cat([pad(v) for v in vs])


@dataclass
class Request:
    prompt: list[int]
    max_new_tokens: int
    deterministic: bool = False
    temperature: float = 0.0
    top_k: int | None = None
    seed: int = 0               # sampling is seeded per position: the same request means the same draws
    eos_id: int | None = None


@dataclass
class ServeStats(VerifyStats):
    prompt_len: int = 0
    new_tokens: int = 0
    fast_steps: int = 0         # batched decode steps this request took part in


@dataclass
class RequestOutput:
    request: Request
    tokens: list[int]                      # committed new tokens
    stats: ServeStats
    trace: list[TraceEvent] | None
    fast_logits: list[torch.Tensor] = field(default_factory=list)  # per fast step, when record_logits


class _State:
    def __init__(self, model, request: Request, window: int, verified: bool):
        self.request = request
        self.prompt = as_token_list(request.prompt, model.config.vocab_size)
        self.seq = list(self.prompt)
        self.proposals: list[int] = []  # fast-path tokens awaiting verification
        self.verified = verified
        self.cache = KVCache.for_model(model, max_len=len(self.prompt) + request.max_new_tokens + window)
        self.choose = greedy_or_sampled(request.temperature, request.top_k, request.seed, model.device)
        self.stats = ServeStats(prompt_len=len(self.prompt))
        self.events: list[TraceEvent] = []
        self.fast_logits: list[torch.Tensor] = []

    @property
    def new_tokens(self) -> list[int]:
        return self.seq[len(self.prompt):]

    @property
    def done(self) -> bool:
        eos = self.request.eos_id
        return len(self.new_tokens) >= self.request.max_new_tokens or (eos is not None and eos in self.new_tokens)

    def window_start(self, window: int) -> int:
        """First position of the fixed window holding the last committed token."""
        return len(self.prompt) + (len(self.seq) - 1 - len(self.prompt)) // window * window

    def ready_to_verify(self, window: int) -> bool:
        rows = len(self.seq) - self.window_start(window) + len(self.proposals)
        budget = self.request.max_new_tokens - len(self.new_tokens) - 1  # the verifier adds one token itself
        eos = self.request.eos_id
        return rows == window or len(self.proposals) >= budget or (eos is not None and eos in self.proposals)

    def finish(self) -> None:
        eos = self.request.eos_id
        new = self.new_tokens[: self.request.max_new_tokens]
        if eos is not None and eos in new:
            new = new[: new.index(eos) + 1]
        self.seq = self.prompt + new


def check_requests(model, requests: list[Request], window: int) -> None:
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"window must be an int >= 1 (positions verified per pass), got {window!r}")
    if not requests:
        raise ValueError("no requests to serve")
    for i, r in enumerate(requests):
        as_token_list(r.prompt, model.config.vocab_size)
        check_sampling_args(r.temperature, r.top_k)
        if not isinstance(r.max_new_tokens, int) or r.max_new_tokens < 1:
            raise ValueError(f"request {i}: max_new_tokens must be an int >= 1, got {r.max_new_tokens!r}")
        needed = len(r.prompt) + r.max_new_tokens + window
        if needed > model.config.block_size:
            raise ValueError(f"request {i}: {len(r.prompt)} prompt + {r.max_new_tokens} new + {window} window rows "
                             f"needs {needed} cache positions > block_size={model.config.block_size}; "
                             f"lower max_new_tokens or the window")


def serve(model, requests: list[Request], window: int = 4, verify: bool = True, trace: bool = False,
          record_logits: bool = False) -> list[RequestOutput]:
    """Run `requests` to completion together; deterministic ones are verified every `window` positions.

    With `verify=False` every request takes the fast path's tokens as they come: what a plain batched
    server does, and what makes the deterministic request's output depend on its companions.
    """
    check_requests(model, requests, window)
    device = model.device
    states = [_State(model, r, window, verified=verify and r.deterministic) for r in requests]

    def verifier(rows: list[int], cache: KVCache) -> torch.Tensor:
        return model(torch.tensor([rows], device=device), cache=cache)[0]  # batch 1, exactly `window` rows

    with torch.inference_mode():
        for st in states:  # prefill alone: it depends on the request only
            logits = model(torch.tensor([st.prompt], device=device), cache=st.cache, last_only=True)[0, -1]
            st.seq.append(st.choose(logits, len(st.seq)))
            st.events.append(TraceEvent(step=0, kind="prefill", input_ids=tuple(st.prompt),
                                        positions=tuple(range(len(st.prompt))), cache_len_before=0,
                                        cache_len_after=len(st.prompt), kv_computed=len(st.prompt), token=st.seq[-1]))
        step = 1
        while active := [st for st in states if not st.done]:
            for st in active:
                if st.verified and st.ready_to_verify(window):
                    _verify(st, window, verifier, step)
            batch = [st for st in active if not st.done and not (st.verified and st.ready_to_verify(window))]
            if batch:
                _fast_step(model, batch, step, record_logits)
            step += 1
    outputs = []
    for st in states:
        st.finish()
        st.stats.new_tokens = len(st.new_tokens)
        outputs.append(RequestOutput(st.request, st.new_tokens, st.stats, st.events if trace else None, st.fast_logits))
    return outputs


def _fast_step(model, batch: list[_State], step: int, record_logits: bool) -> None:
    """One batched decode step: every request in `batch` feeds its newest token."""
    device = model.device
    fed = [(st.seq + st.proposals)[-1] for st in batch]
    positions = [len(st.seq) + len(st.proposals) - 1 for st in batch]
    lengths = torch.tensor([p + 1 for p in positions], device=device)
    n_splits = num_kv_splits(len(batch), model.config.n_head, int(lengths.max()))
    logits = model(torch.tensor([[t] for t in fed], device=device), cache=RaggedCaches([st.cache for st in batch]),
                   positions=torch.tensor([[p] for p in positions], device=device), last_only=True,
                   attention=partial(split_kv_attention, lengths=lengths, n_splits=n_splits))[:, -1]
    for st, row, token_in, pos in zip(batch, logits, fed, positions):
        token = st.choose(row, pos + 1)
        (st.proposals if st.verified else st.seq).append(token)
        st.stats.fast_steps += 1
        if record_logits:
            st.fast_logits.append(row.clone())
        st.events.append(TraceEvent(step=step, kind="decode", input_ids=(token_in,), positions=(pos,),
                                    cache_len_before=pos, cache_len_after=pos + 1, kv_computed=1, token=token,
                                    detail={"batch": len(batch), "n_splits": n_splits, "unverified": st.verified}))


def _verify(st: _State, window: int, verifier, step: int) -> None:
    rnd = verify_and_commit(st.seq, list(st.proposals), st.cache, verifier, judge_by_match(st.choose, len(st.seq)),
                            start=st.window_start(window), rows=window)
    proposed = len(st.proposals)
    st.proposals.clear()
    st.stats.rounds += 1
    st.stats.proposed += proposed
    st.stats.accepted += rnd.verdict.accepted
    st.stats.rejected += proposed - rnd.verdict.accepted
    st.stats.rollbacks += rnd.rolled_back
    st.events.extend(round_events(step, rnd, len(st.seq)))
