"""A server: continuous batching over a paged KV cache, with deterministic requests (seed 001,
after LLM-42, arXiv 2601.17768).

One engine loop, one step at a time: (1) requests that have arrived are admitted, first come
first served, while the pool has blocks for their prompt (sharing the blocks of a prefix another
request already computed), and each is prefilled alone; (2) deterministic requests whose window
is full are verified; (3) every other running request advances one token in ONE batched decode
pass, preempting the newest requests (their blocks freed, their tokens kept, to be recomputed on
readmission) when the pool cannot give every row its next slot; (4) finished requests leave and
give their blocks back at once.

The batched pass's numbers depend on the batch, as in real servers (split-KV attention splits by
batch size; BLAS picks kernels by rows). A deterministic request's positions are therefore
replayed alone, `window` rows per pass at boundaries fixed relative to the prompt, and the shared
verify core commits the matching prefix or rolls back: its output is bit-identical whatever the
batch, the arrivals and the preemptions. (It neither uses shared prefix blocks, which another
request's differently shaped pass computed, nor is recomputed in one pass: its prompt is
prefilled alone and its windows replayed as they were.)
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from functools import partial

import torch

from . import validate
from .attention import (
    masked_attention,
    num_kv_splits,
    packed_causal_mask,
    paged_attention,
    splits_of,
)
from .paged import BlockPool, BlockTable, PagedCache, block_hash
from .records import PoolStep, ServeStats, TraceEvent
from .sampling import SamplingParams
from .verify import accept_matching, round_events, verify_and_commit


@dataclass
class Request:
    prompt: list[int]
    max_new_tokens: int
    deterministic: bool = False
    temperature: float = 0.0
    top_k: int | None = None
    seed: int = 0               # sampling is seeded per position: the same request, the same draws
    eos_id: int | None = None
    arrival: int = 0            # the engine step at which it arrives

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


class ServeOutputs(list):
    """One RequestOutput per request, in order, and the block pool they were served from: its
    `log` holds (step, what, block, request) for every block allocated, shared, copied, freed or
    unshared, and every preemption."""
    pool: BlockPool
    pool_steps: list[PoolStep]  # the pool after every engine step, when traced


class _Sequence:
    """One request inside the server: its tokens, its block table, and its progress."""

    def __init__(self, index: int, request: Request, prompt: list[int], verified: bool):
        self.index, self.request, self.prompt, self.verified = index, request, prompt, verified
        self.sampling = request.sampling
        self.seq = list(prompt)
        self.proposals: list[int] = []  # fast-path tokens awaiting verification
        self.table = BlockTable(owner=index)
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
        if self.done:  # nothing left to judge (e.g. max_new_tokens=1: the prefill's token)
            return False
        rows = len(self.seq) - self.window_start(window) + len(self.proposals)
        budget = self.request.max_new_tokens - len(self.new_tokens) - 1  # the verifier adds one
        return (rows == window or len(self.proposals) >= budget
                or self.sampling.eos_id in self.proposals)

    def finish(self) -> None:
        new = self.new_tokens[: self.request.max_new_tokens]
        if self.sampling.eos_id in new:
            new = new[: new.index(self.sampling.eos_id) + 1]
        self.seq = self.prompt + new


def serve(model, requests, window: int = 4, verify: bool = True, trace: bool = False,
          record_logits: bool = False, *, block_size: int = 16, num_blocks: int | None = None,
          prefix_caching: bool = True, max_running: int | None = None) -> ServeOutputs:
    """Serve `requests` (each arriving at its `arrival` step) to completion. The pool holds
    `num_blocks` blocks of `block_size` positions (default: enough for every request at once);
    `prefix_caching` lets a prompt reuse the full blocks another prompt with the same beginning
    computed; `max_running` caps how many requests run at once (vLLM's `max_num_seqs`; default:
    as many as the pool admits). Deterministic requests are verified every `window` positions;
    with `verify=False` every request keeps the fast path's tokens as they come, as a plain
    batched server does."""
    requests = list(requests)
    prompts, num_blocks = validate.serve_call(model, requests, window, block_size, num_blocks)
    if max_running is not None:
        validate.int_at_least("max_running", max_running, hint=" (requests running at once)")
    pool = BlockPool(model.config, num_blocks, block_size, device=model.device, dtype=model.dtype)
    seqs = [_Sequence(i, r, p, verify and r.deterministic)
            for i, (r, p) in enumerate(zip(requests, prompts))]
    waiting = deque(sorted(seqs, key=lambda s: (s.request.arrival, s.index)))
    running: list[_Sequence] = []
    server = _Server(model, pool, window, prefix_caching, record_logits, running, waiting)
    steps: list[PoolStep] = []
    logged = 0
    with torch.inference_mode():
        while waiting or running:
            # 1. Admit what has arrived, first come first served, while its prompt fits (and
            #    fewer than max_running run: admit() puts a newcomer in `running` at once); the
            #    newcomers' prompts are computed together in one packed pass.
            new = []
            while (waiting and waiting[0].request.arrival <= server.step
                   and (max_running is None or len(running) < max_running)
                   and server.admit(waiting[0])):
                new.append(waiting.popleft())
            server.prefill(new)
            running.extend(new)
            # 2. Verify the deterministic requests whose window is full: alone, a fixed shape.
            for s in [s for s in running if s.verified and s.ready_to_verify(window)]:
                server.verify(s)
            # 3. One batched decode pass for everyone else (preempting if the pool is short).
            server.decode([s for s in running if not s.done
                           and not (s.verified and s.ready_to_verify(window))])
            # 4. Finished requests leave; their blocks go back to the pool at once.
            for s in [s for s in running if s.done]:
                server.release(s)
                running.remove(s)
            if trace:
                steps.append(PoolStep(
                    server.step, {s.index: tuple(s.table.blocks) for s in running},
                    {s.index: s.table.length for s in running}, tuple(pool.ref),
                    tuple(e for e in pool.log[logged:])))
                logged = len(pool.log)
            server.step += 1
            if not running and waiting:  # idle until the next arrival
                server.step = max(server.step, waiting[0].request.arrival)
    outputs = ServeOutputs()
    for s in seqs:
        s.finish()
        s.stats.new_tokens = len(s.new_tokens)
        outputs.append(RequestOutput(s.request, s.new_tokens, s.stats,
                                     s.events if trace else None, s.fast_logits))
    outputs.pool, outputs.pool_steps = pool, steps
    return outputs


class _Server:
    """The engine loop's moves on one request or one batch; serve() decides when to make them."""

    def __init__(self, model, pool, window, prefix_caching, record_logits, running, waiting):
        self.model, self.pool, self.window = model, pool, window
        self.prefix_caching, self.record_logits = prefix_caching, record_logits
        self.running, self.waiting, self.step = running, waiting, 0

    def run(self, s: _Sequence, tokens: list[int]) -> torch.Tensor:
        """One pass of one sequence over `tokens`, after its cached positions: (T, vocab)."""
        cache = PagedCache(self.pool, [s.table])
        cache.reserve(len(tokens))
        return self.model(torch.tensor([tokens], device=self.model.device), cache=cache)[0]

    def admit(self, s: _Sequence) -> bool:
        """Take a new (or preempted) request's blocks if the pool has them, keeping a block free
        for each running request to grow into; share the blocks of a prompt prefix the pool
        already holds (or will, by the end of this step's prefill)."""
        bs, pool = self.pool.block_size, self.pool
        known = s.seq if not s.verified else s.prompt  # what must be in the cache to go on
        need = len(known)
        if s.verified:  # a preempted one recomputes its tokens in padded windows (see prefill)
            need += -(-max(0, len(s.seq) - 1 - len(s.prompt)) // self.window) * self.window
        shared = self.shared_prefix(s) if self.prefix_caching and not s.verified else []
        held = sum(pool.ref[b] > 0 for b in shared)  # shared blocks that cost no free block
        headroom = len(self.running)
        if pool.n_free < -(-need // bs) - held + 1 + headroom:
            return False
        pool.step = self.step
        for block in shared:  # another prompt's blocks with the same tokens: K/V reused
            pool.share(block, s.index)
        s.table.blocks, s.table.length = list(shared), len(shared) * bs
        s.stats.reused += s.table.length
        PagedCache(pool, [s.table]).reserve(need - s.table.length)  # held until prefill runs
        self.publish(s)
        self.running.append(s)  # counted in the next admission's headroom
        return True

    def prefill(self, new: list[_Sequence]) -> None:
        """Compute the newcomers' prompts (or a preempted request's tokens): deterministic
        requests alone, as they were computed the first time; the rest in one packed pass."""
        for s in new:
            self.running.remove(s)
        packed = [s for s in new if not s.verified]
        pool, before = self.pool, {s.index: s.table.length for s in new}
        for s in new:
            if s.verified:  # alone, at the shapes it was first computed with: bit-identical
                logits = self.run(s, s.prompt)[-1]
                for start in range(len(s.prompt), len(s.seq) - 1, self.window):  # recompute
                    rows = s.seq[start:start + self.window]
                    self.run(s, rows + [0] * (self.window - len(rows)))
                    PagedCache(pool, [s.table]).crop(start + len(rows))
                if len(s.seq) == len(s.prompt):
                    s.seq.append(s.sampling.choose(logits, len(s.prompt)))
                PagedCache(pool, [s.table]).crop(len(s.seq) - 1)
        if packed:
            past = [s.table.length for s in packed]  # shared prefix blocks: already there
            counts = [len(s.seq) - s.table.length for s in packed]
            ids = [t for s in packed for t in s.seq[s.table.length:]]
            device = self.model.device
            positions = torch.tensor([p for a, n in zip(past, counts) for p in range(a, a + n)],
                                     device=device)
            mask = packed_causal_mask(past, counts, device)
            logits = self.model(torch.tensor([ids], device=device),
                                cache=PagedCache(pool, [s.table for s in packed], counts),
                                positions=positions, attention=partial(masked_attention,
                                                                       mask=mask))[0]
            ends = torch.tensor(counts).cumsum(0) - 1
            for s, row in zip(packed, logits[ends.to(device)]):
                s.seq.append(s.sampling.choose(row, len(s.seq)))
        for s in new:
            fed, first = s.seq[:-1], before[s.index]
            s.events.append(TraceEvent(
                kind="prefill" if len(fed) == len(s.prompt) else "recompute", step=self.step,
                input_ids=tuple(fed), positions=tuple(range(first, len(fed))),
                cache_len_before=first, cache_len_after=s.table.length,
                kv_computed=len(fed) - first, token=s.seq[-1],
                batch=len(packed) if s in packed else 1))

    def shared_prefix(self, s: _Sequence) -> list[int]:
        """The pool's blocks that already hold this prompt's first full blocks (at least one
        prompt token is left to compute: its logits give the first new token)."""
        bs, blocks, h = self.pool.block_size, [], ""
        for i in range((len(s.prompt) - 1) // bs):
            h = block_hash(h, s.prompt[i * bs:(i + 1) * bs])
            if h not in self.pool.by_hash:
                break
            blocks.append(self.pool.by_hash[h])
        return blocks

    def publish(self, s: _Sequence) -> None:
        """Make this prompt's full blocks findable by their hashes, for the prompts to come."""
        bs, h = self.pool.block_size, ""
        for i in range(len(s.prompt) // bs):
            h = block_hash(h, s.prompt[i * bs:(i + 1) * bs])
            block = s.table.blocks[i]
            if h not in self.pool.by_hash:
                self.pool.by_hash[h], self.pool.hash_of[block] = block, h

    def make_room(self, needed, keep: _Sequence) -> None:
        """Preempt the newest running requests but `keep` until `needed()` blocks are free (the
        newest have waited least; recomputing them later costs least)."""
        while self.pool.n_free < needed():
            victim = next(s for s in reversed(self.running) if s is not keep)
            self.preempt(victim)

    def preempt(self, s: _Sequence) -> None:
        self.pool.step = self.step
        self.pool.log.append((self.step, "preempt", -1, s.index))
        s.proposals.clear()  # unverified work is dropped; committed tokens are kept
        self.release(s)
        s.stats.preempted += 1
        s.events.append(TraceEvent(kind="preempt", step=self.step, cache_len_before=len(s.seq) - 1,
                                   cache_len_after=0))
        self.running.remove(s)
        self.waiting.appendleft(s)

    def release(self, s: _Sequence) -> None:
        self.pool.step = self.step
        for block in reversed(s.table.blocks):
            self.pool.release(block, s.index)
        s.table.blocks, s.table.length = [], 0

    def verify(self, s: _Sequence) -> None:
        bs = self.pool.block_size
        self.make_room(lambda: -(-(len(s.seq) + self.window) // bs) - len(s.table.blocks), s)
        self.pool.step = self.step
        rnd = verify_and_commit(
            s.seq, list(s.proposals), PagedCache(self.pool, [s.table]),
            lambda rows, cache: self.run(s, rows),
            partial(accept_matching, sampling=s.sampling, first_position=len(s.seq)),
            start=s.window_start(self.window), rows=self.window)
        s.proposals.clear()
        s.stats.record(rnd)
        s.events.extend(round_events(self.step, rnd, len(s.seq)))

    def decode(self, batch: list[_Sequence]) -> None:
        """One batched decode step: every request in `batch` feeds its newest token."""
        def needed() -> int:
            return PagedCache(self.pool, [s.table for s in batch if s in self.running]
                              ).blocks_needed(1)
        if not batch:
            return
        self.make_room(needed, keep=batch[0])  # the oldest always goes on
        batch = [s for s in batch if s in self.running]
        cache = PagedCache(self.pool, [s.table for s in batch], batched=True)
        self.pool.step = self.step
        cache.reserve(1)
        device = self.model.device
        fed = [(s.seq + s.proposals)[-1] for s in batch]
        positions = [len(s.seq) + len(s.proposals) - 1 for s in batch]  # = each row's length
        lengths = torch.tensor([p + 1 for p in positions], device=device)
        tables = cache.block_tables()
        n_splits = num_kv_splits(len(batch), self.model.config.kv_heads, int(lengths.max()))
        n_splits = splits_of(tables.size(1), self.pool.block_size, n_splits)[2]  # whole tiles
        attention = partial(paged_attention, tables=tables, lengths=lengths, n_splits=n_splits)
        logits = self.model(torch.tensor([[t] for t in fed], device=device), cache=cache,
                            last_only=True, attention=attention)[:, -1]  # (B, vocab)
        for s, row, token_in, pos in zip(batch, logits, fed, positions):
            token = s.sampling.choose(row, pos + 1)
            (s.proposals if s.verified else s.seq).append(token)
            s.stats.fast_steps += 1
            if self.record_logits:
                s.fast_logits.append(row.clone())
            s.events.append(TraceEvent(
                kind="decode", step=self.step, input_ids=(token_in,), positions=(pos,),
                token=token, cache_len_before=pos, cache_len_after=pos + 1, kv_computed=1,
                batch=len(batch), n_splits=n_splits, unverified=s.verified))
