"""A batched server with deterministic requests (seed 001, after LLM-42, arXiv 2601.17768). Fast
path: each request advances one token per step in ONE batched pass, whose numbers depend on the
batch as in real servers (split-KV attention splits by batch size; BLAS picks kernels by rows).
Verifier: a deterministic request's positions are replayed alone, `window` rows per pass at
boundaries fixed relative to the prompt, so every committed number comes from the same-shaped
call whatever the batch; the shared verify core commits the matching prefix or rolls back."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F

from . import validate
from .cache import Cache, KVCache
from .config import GPTConfig
from .records import ServeStats, TraceEvent
from .sampling import SamplingParams
from .verify import accept_matching, round_events, verify_and_commit

GPU_WORKERS = 132  # streaming multiprocessors of an H100: split-KV aims to keep them all busy


def num_kv_splits(batch_size: int, n_head: int, seq_len: int) -> int:
    """FlashDecoding's heuristic: split the keys (at least 8 a chunk) until batch x heads x
    splits fills the GPU."""
    return max(1, min(math.ceil(GPU_WORKERS / (batch_size * n_head)), math.ceil(seq_len / 8)))


def split_kv_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor,
                       n_splits: int) -> torch.Tensor:
    """Decode attention over right-padded keys (B, nh, L, hs), row b seeing its first lengths[b]:
    each split computes a partial softmax output (rounded to the model's dtype), its max and its
    sum, and the partials are merged as one softmax would be, up to rounding."""
    B, nh, T, hs = q.shape
    assert T == 1, "split-KV attention is for decode steps: one new token per request"
    L = k.size(2)
    chunk = math.ceil(L / n_splits)
    pad = chunk * n_splits - L
    k, v = (F.pad(t, (0, 0, 0, pad)).view(B, nh, n_splits, chunk, hs) for t in (k, v))
    scores = (q.unsqueeze(2) @ k.transpose(-1, -2)).float() / math.sqrt(hs)  # (B, nh, S, 1, chunk)
    key_pos = torch.arange(n_splits * chunk, device=q.device).view(n_splits, 1, chunk)
    scores = scores.masked_fill(key_pos >= lengths.view(B, 1, 1, 1, 1), float("-inf"))
    m = scores.amax(-1, keepdim=True)                                  # per-split max
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)       # fully padded splits
    p = torch.exp(scores - m_safe)
    l = p.sum(-1, keepdim=True)                                        # per-split sum  # noqa: E741
    partial_out = ((p @ v.float()) / l.clamp(min=1e-30)).to(q.dtype)   # kept in the model dtype
    weight = torch.exp(m - m.amax(2, keepdim=True)) * l                # merge the splits
    out = (weight * partial_out.float()).sum(2) / weight.sum(2)
    return out.to(q.dtype)                                             # (B, nh, 1, hs)


class RaggedCaches(Cache):
    """Each request's own KVCache, stepped together in one batched pass: row b continues from its
    own length, and `update` returns keys right-padded to the longest row."""

    def __init__(self, caches: list[KVCache]):
        self.caches = caches

    def get_seq_length(self, layer_idx: int = 0) -> torch.Tensor:
        """(B, 1): each row's cached length, so each row's positions continue from its own."""
        lengths = [[c.get_seq_length(layer_idx)] for c in self.caches]
        return torch.tensor(lengths, device=self.caches[0].device)

    def check_fits(self, cfg: GPTConfig, batch_size: int, n_new: int, device, dtype) -> None:
        if batch_size != len(self.caches):
            raise ValueError(f"batch of {batch_size} rows for {len(self.caches)} request caches")
        for cache in self.caches:
            cache.check_fits(cfg, 1, n_new, device, dtype)

    def update(self, key: torch.Tensor, value: torch.Tensor,
               layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        ks, vs = zip(*(c.update(key[b:b + 1], value[b:b + 1], layer_idx)
                       for b, c in enumerate(self.caches)))
        longest = max(k.size(2) for k in ks)
        return tuple(torch.cat([F.pad(t, (0, 0, 0, longest - t.size(2))) for t in ts])
                     for ts in (ks, vs))  # 2 x (B, nh, longest, hs)


@dataclass
class Request:
    prompt: list[int]
    max_new_tokens: int
    deterministic: bool = False
    temperature: float = 0.0
    top_k: int | None = None
    seed: int = 0               # sampling is seeded per position: the same request, the same draws
    eos_id: int | None = None

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.seed, self.eos_id)


@dataclass
class RequestOutput:
    request: Request
    tokens: list[int]                      # committed new tokens
    stats: ServeStats
    trace: list[TraceEvent] | None
    fast_logits: list[torch.Tensor] = field(default_factory=list)  # per fast step, when recorded


class _State:
    def __init__(self, model, request: Request, prompt: list[int], window: int, verified: bool):
        self.request, self.prompt, self.verified = request, prompt, verified
        self.sampling = request.sampling
        self.seq = list(prompt)
        self.proposals: list[int] = []  # fast-path tokens awaiting verification
        self.cache = KVCache.for_model(model, max_len=len(prompt) + request.max_new_tokens + window)
        self.stats = ServeStats(prompt_len=len(prompt))
        self.events: list[TraceEvent] = []
        self.fast_logits: list[torch.Tensor] = []

    @property
    def new_tokens(self) -> list[int]:
        return self.seq[len(self.prompt):]

    @property
    def done(self) -> bool:
        return (len(self.new_tokens) >= self.request.max_new_tokens
                or self.sampling.eos_id in self.new_tokens)

    def window_start(self, window: int) -> int:
        """First position of the fixed window holding the last committed token."""
        return len(self.prompt) + (len(self.seq) - 1 - len(self.prompt)) // window * window

    def ready_to_verify(self, window: int) -> bool:
        rows = len(self.seq) - self.window_start(window) + len(self.proposals)
        budget = self.request.max_new_tokens - len(self.new_tokens) - 1  # the verifier adds one
        return (rows == window or len(self.proposals) >= budget
                or self.sampling.eos_id in self.proposals)

    def finish(self) -> None:
        new = self.new_tokens[: self.request.max_new_tokens]
        if self.sampling.eos_id in new:
            new = new[: new.index(self.sampling.eos_id) + 1]
        self.seq = self.prompt + new


def serve(model, requests: list[Request], window: int = 4, verify: bool = True,
          trace: bool = False, record_logits: bool = False) -> list[RequestOutput]:
    """Run `requests` to completion together; deterministic ones are verified every `window`
    positions. With `verify=False` every request keeps the fast path's tokens as they come, as a
    plain batched server does: then its output depends on its companions."""
    requests = list(requests)
    prompts = validate.serve_call(model, requests, window)
    device = model.device
    states = [_State(model, r, p, window, verified=verify and r.deterministic)
              for r, p in zip(requests, prompts)]

    def verifier(rows: list[int], cache: KVCache) -> torch.Tensor:
        return model(torch.tensor([rows], device=device), cache=cache)[0]  # batch 1, `window` rows

    with torch.inference_mode():
        for st in states:  # prefill alone: it depends on the request only
            logits = model(torch.tensor([st.prompt], device=device), cache=st.cache,
                           last_only=True)[0, -1]
            st.seq.append(st.sampling.choose(logits, len(st.seq)))
            n = len(st.prompt)
            st.events.append(TraceEvent(kind="prefill", step=0, input_ids=tuple(st.prompt),
                                        positions=tuple(range(n)), cache_len_after=n,
                                        kv_computed=n, token=st.seq[-1]))
        step = 1
        while active := [st for st in states if not st.done]:
            for st in active:
                if st.verified and st.ready_to_verify(window):
                    _verify(st, window, verifier, step)
            batch = [st for st in active
                     if not st.done and not (st.verified and st.ready_to_verify(window))]
            if batch:
                _fast_step(model, batch, step, record_logits)
            step += 1
    outputs = []
    for st in states:
        st.finish()
        st.stats.new_tokens = len(st.new_tokens)
        outputs.append(RequestOutput(st.request, st.new_tokens, st.stats,
                                     st.events if trace else None, st.fast_logits))
    return outputs


def _fast_step(model, batch: list[_State], step: int, record_logits: bool) -> None:
    """One batched decode step: every request in `batch` feeds its newest token."""
    device = model.device
    fed = [(st.seq + st.proposals)[-1] for st in batch]
    positions = [len(st.seq) + len(st.proposals) - 1 for st in batch]  # = each row's cache length
    lengths = torch.tensor([p + 1 for p in positions], device=device)
    n_splits = num_kv_splits(len(batch), model.config.n_head, int(lengths.max()))
    attention = partial(split_kv_attention, lengths=lengths, n_splits=n_splits)
    logits = model(torch.tensor([[t] for t in fed], device=device),
                   cache=RaggedCaches([st.cache for st in batch]), last_only=True,
                   attention=attention)[:, -1]  # (B, vocab)
    for st, row, token_in, pos in zip(batch, logits, fed, positions):
        token = st.sampling.choose(row, pos + 1)
        (st.proposals if st.verified else st.seq).append(token)
        st.stats.fast_steps += 1
        if record_logits:
            st.fast_logits.append(row.clone())
        st.events.append(TraceEvent(
            kind="decode", step=step, input_ids=(token_in,), positions=(pos,), token=token,
            cache_len_before=pos, cache_len_after=pos + 1, kv_computed=1, batch=len(batch),
            n_splits=n_splits, unverified=st.verified))


def _verify(st: _State, window: int, verifier, step: int) -> None:
    accept = partial(accept_matching, sampling=st.sampling, first_position=len(st.seq))
    rnd = verify_and_commit(st.seq, list(st.proposals), st.cache, verifier, accept,
                            start=st.window_start(window), rows=window)
    st.proposals.clear()
    st.stats.record(rnd)
    st.events.extend(round_events(step, rnd, len(st.seq)))
