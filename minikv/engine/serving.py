"""A server: continuous batching over a paged KV cache, with deterministic requests
(after LLM-42, arXiv 2601.17768).

One engine loop, one step at a time; the Scheduler (scheduler.py) decides who runs, the
Runner here runs the passes: (1) requests that have arrived are admitted, first come
first served, while the pool has blocks for their prompt (sharing the blocks of a prefix
another request already computed), and their prompts are computed in one packed pass; (2)
deterministic requests whose window is full are verified; (3) every other running request
advances one token in ONE batched decode pass, preempting the newest requests (their
blocks freed, their tokens kept, to be recomputed on readmission) when the pool cannot
give every row its next slot; (4) finished requests leave and give their blocks back at
once.

The batched pass's numbers depend on the batch, as in real servers (split-KV attention
splits by batch size; BLAS picks kernels by rows). A deterministic request's positions
are therefore replayed alone, `window` rows per pass at boundaries fixed relative to the
prompt, and the shared verify core commits the matching prefix or rolls back: its output
is bit-identical whatever the batch, the arrivals and the preemptions. (It neither uses
shared prefix blocks, which another request's differently shaped pass computed, nor is
recomputed in one pass: its prompt is prefilled alone and its windows replayed as they
were.)

With `speculative=Speculation(...)` every other running request proposes up to γ tokens a
step (prompt lookup, or a draft model), and step (3)'s pass becomes ONE packed pass that
verifies every row's proposals at once: each row keeps its own matching prefix and the
target's token, and its block table is cropped behind them (the same commit as
speculate's, verify.commit_round). A row's proposals are sure tokens, judged by the
target's own seeded choice, so each request's tokens are the ones it gets alone.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace
from functools import partial

import torch

from .attention import (
    masked_attention,
    num_kv_splits,
    packed_causal_mask,
    paged_attention,
    splits_of,
)
from .lookup import propose_by_lookup
from .paged import BlockPool, PagedCache
from .records import PoolStep, ServeStats, TraceEvent
from .sampling import SamplingParams
from .scheduler import FirstComeFirstServed, Scheduler, Sequence
from .speculative import DraftProposer, as_proposal, check_draft
from .validate import check_flags, check_room, int_at_least, prompt_of_call
from .verify import accept_matching, commit_round, round_events, verify_and_commit


@dataclass
class Request:
    prompt: list[int]
    max_new_tokens: int
    deterministic: bool = False
    temperature: float = 0.0
    top_k: int | None = None
    seed: int = 0               # seeded per position: the same request, the same draws
    eos_id: int | None = None
    arrival: int = 0            # the engine step at which it arrives

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.seed, self.eos_id)

    def checked_prompt(self, model, window: int, i: int) -> list[int]:
        """The prompt as token ids, every field checked against `model` (`i`: which)."""
        prompt = prompt_of_call(model, self.prompt, self.max_new_tokens, self.sampling, 1,
                                f"request {i}: max_new_tokens")
        int_at_least(f"request {i}: arrival", self.arrival, 0, hint=" (an engine step)")
        check_flags(**{f"request {i}: deterministic": self.deterministic})
        n = self.max_new_tokens
        check_room(len(prompt) + n + window, model.config.block_size,
                   f"request {i} ({len(prompt)} + {n} new + {window})", "max_new_tokens or window")
        return prompt


@dataclass(frozen=True)
class Speculation:
    """Speculative decoding inside the server (vLLM's speculative_config): each running
    request proposes up to `gamma` tokens a step, by prompt lookup (`ngram`) or, given a
    `draft` model of the target's vocabulary, by its greedy tokens (one draft cache per
    request, its passes one request at a time)."""
    gamma: int = 4
    draft: object = None
    ngram: int = 3

    def __post_init__(self) -> None:
        int_at_least("Speculation gamma", self.gamma, hint=" (tokens proposed per step)")
        int_at_least("Speculation ngram", self.ngram, hint=" (tokens the lookup matches)")

    def proposer(self):
        """(propose(seq, k), the caches to roll back with the target's), for one request."""
        if self.draft is None:
            return partial(propose_by_lookup, ngram=self.ngram), {}
        draft = DraftProposer(self.draft, SamplingParams(), torch.Generator(self.draft.device))
        return draft, {"draft": draft.cache}


@dataclass
class RequestOutput:
    request: Request
    tokens: list[int]                      # committed new tokens
    stats: ServeStats
    trace: list[TraceEvent] | None
    fast_logits: list[torch.Tensor] = field(default_factory=list)  # if recorded


class ServeOutputs(list):
    """The list of RequestOutputs, one per request in order, with the block pool they
    were served from (its `log` holds (what, block, request) for every block allocated,
    shared, copied, freed or unshared, and every preemption) and, when traced, the pool
    after every engine step."""

    def __init__(self, outputs: list[RequestOutput], pool: BlockPool,
                 pool_steps: list[PoolStep]):
        super().__init__(outputs)
        self.pool = pool
        self.pool_steps = pool_steps


def serve(model, requests, window: int = 4, verify: bool = True, trace: bool = False,
          record_logits: bool = False, *, page_size: int = 16,
          num_blocks: int | None = None, prefix_caching: bool = True,
          max_running: int | None = None, policy: FirstComeFirstServed | None = None,
          block_size: int | None = None,
          speculative: Speculation | None = None) -> ServeOutputs:
    """Serve `requests` (each arriving at its `arrival` step) to completion. The pool
    holds `num_blocks` blocks of `page_size` positions (default: enough for every request
    at once); `prefix_caching` lets a prompt reuse the full blocks another prompt with
    the same beginning computed; `max_running` caps how many requests run at once (vLLM's
    `max_num_seqs`; default: as many as the pool admits); `policy` decides who is
    admitted and who is preempted (default: first come, first served;
    scheduler.TokenBudget caps the tokens of a step; scheduler.ChunkedPrefill spends
    what a step has left on chunks of the prompts, in one pass with the decodes).
    Deterministic requests are verified every `window` positions; with `verify=False`
    every request keeps the fast path's tokens as they come, as a plain batched server
    does. `speculative` lets the other requests propose tokens that one packed pass
    verifies (see the module docstring)."""
    if block_size is not None:  # the old name: config.block_size is the context length
        warnings.warn("serve(block_size=) is deprecated: use page_size= (positions per "
                      "pool block)", DeprecationWarning, stacklevel=2)
        page_size = block_size
    if not hasattr(requests, "__iter__"):
        raise TypeError(f"requests must be a list of minikv.Request, not {requests!r:.30}")
    requests = list(requests)
    check_flags(verify=verify, trace=trace, record_logits=record_logits,
                prefix_caching=prefix_caching)
    prompts = _checked_prompts(model, requests, window, page_size, max_running, policy)
    ahead = max(window, speculative.gamma + 1 if isinstance(speculative, Speculation) else 0)
    num_blocks = _pool_size(requests, prompts, ahead, page_size, num_blocks)
    engine = Engine(model, num_blocks, window=window, verify=verify, trace=trace,
                    record_logits=record_logits, page_size=page_size,
                    prefix_caching=prefix_caching, max_running=max_running, policy=policy,
                    speculative=speculative)
    for i, (r, p) in enumerate(zip(requests, prompts)):  # queued by arrival, then index
        engine.add(r, index=i, prompt=p)
    while engine.has_work():
        engine.step()
    return ServeOutputs([_output(s, trace) for s in engine.seqs.values()], engine.pool,
                        engine.scheduler.pool_steps or [])


class Engine:
    """serve()'s loop one step at a time, for a caller that adds requests while it runs
    and reads their tokens as they come (an HTTP server, a load generator): vLLM's
    LLMEngine (add_request, step, abort_request), nano-vllm's LLMEngine. Not thread-safe:
    one thread owns it (the server's engine thread)."""

    def __init__(self, model, num_blocks: int, *, window: int = 4, verify: bool = True,
                 trace: bool = False, record_logits: bool = False, page_size: int = 16,
                 prefix_caching: bool = True, max_running: int | None = None,
                 policy: FirstComeFirstServed | None = None,
                 speculative: Speculation | None = None):
        _check_settings(window, page_size, max_running, policy)
        _check_speculation(model, speculative, policy)
        int_at_least("num_blocks", num_blocks, hint=" (blocks in the pool)")
        check_flags(verify=verify, trace=trace, record_logits=record_logits,
                    prefix_caching=prefix_caching)
        self.model, self.window, self.verify = model, window, verify
        self.pool = BlockPool(model.config, num_blocks, page_size, device=model.device,
                              dtype=model.dtype)
        self.scheduler = Scheduler(self.pool, (), policy, verify_window=window, trace=trace,
                                   prefix_caching=prefix_caching, max_running=max_running)
        self.runner = Runner(model, self.pool, window, record_logits, speculative)
        self.seqs: dict[int, Sequence] = {}  # every request added, by index
        self.sent: dict[int, int] = {}       # new tokens step() has handed out, per request

    def add(self, request: Request, index: int | None = None,
            prompt: list[int] | None = None) -> int:
        """Queue `request` behind those that arrive no later (Request.arrival: an engine
        step; 0 joins the queue now); its index (`index`: serve's own numbering, and
        `prompt` its already-checked prompt)."""
        index = len(self.seqs) if index is None else index
        if prompt is None:
            if not isinstance(request, Request):
                raise TypeError(f"request must be a minikv.Request, not {type(request).__name__}")
            prompt = request.checked_prompt(self.model, self.window, index)
            _pool_size([request], [prompt], self.window, self.pool.page_size,
                       self.pool.num_blocks)
        s = Sequence(index, request, prompt, self.verify and request.deterministic)
        waiting = self.scheduler.waiting
        later = [k for k, w in enumerate(waiting) if w.request.arrival > request.arrival]
        waiting.insert(later[0] if later else len(waiting), s)
        self.seqs[index], self.sent[index] = s, 0
        return index

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> dict[int, tuple[list[int], bool]]:
        """One engine step; for each request it moved on: the tokens it committed in this
        step (cut at max_new_tokens and the EOS) and whether it is finished."""
        if not self.has_work():
            return {}
        with torch.inference_mode():
            self.scheduler.step(self.runner)
        moved = {}
        for i in list(self.sent):  # not yet finished and handed out, nor aborted
            s = self.seqs[i]
            new = s.committed
            if len(new) > self.sent[i] or s.done:
                moved[i] = (new[self.sent[i]:], s.done)
                self.sent[i] = len(new)
                if s.done:
                    del self.sent[i]
        return moved

    def forget(self, index: int) -> None:
        """Drop a finished or aborted request's record (a long-running server's memory)."""
        if index in self.sent:
            raise ValueError(f"request {index} is still running: abort it first")
        self.seqs.pop(index, None)

    def abort(self, index: int) -> None:
        """Drop a request (its client left): out of the queue, or its blocks back to the
        pool at once. Nothing happens to a request already finished."""
        if index not in self.seqs:
            raise ValueError(f"no request {index} in this engine")
        s = self.seqs[index]
        self.sent.pop(index, None)
        if s in self.scheduler.waiting:
            self.scheduler.waiting.remove(s)
        elif s in self.scheduler.running:
            self.pool.free_table(s.table)
            self.scheduler.running.remove(s)


def _pool_size(requests, prompts, window, page_size, num_blocks) -> int:
    """`num_blocks`, or enough for every request at once; each must fit in it alone."""
    positions = [len(p) + r.max_new_tokens + window for r, p in zip(requests, prompts)]
    sizes = [-(-n // page_size) + 1 for n in positions]  # and a block copied on write
    if num_blocks is None:
        return sum(sizes)
    int_at_least("num_blocks", num_blocks, max(sizes), " (a request needs more than the pool)")
    return num_blocks


def _output(s: Sequence, trace: bool) -> RequestOutput:
    s.finish()
    s.stats.new_tokens = len(s.new_tokens)
    return RequestOutput(s.request, s.new_tokens, s.stats, s.events if trace else None,
                         s.fast_logits)


class Runner:
    """The passes an engine step runs on the model and the pool: the newcomers' prefill,
    a deterministic request's verification, the batched decode. It moves sequences'
    tokens and tables on; who runs is the Scheduler's business."""

    def __init__(self, model, pool: BlockPool, verify_window: int, record_logits: bool,
                 speculation: Speculation | None = None):
        self.model = model
        self.pool = pool
        self.verify_window = verify_window
        self.record_logits = record_logits
        self.speculation = speculation

    def run(self, s: Sequence, tokens: list[int]) -> torch.Tensor:
        """One sequence's pass over `tokens`, after its cached positions: (T, vocab)."""
        self.pool.reserve(s.table, len(tokens))
        ids = torch.tensor([tokens], device=self.model.device)
        return self.model(ids, cache=PagedCache(self.pool, [s.table]))[0]

    def prefill(self, new: list[Sequence], step: int) -> None:
        """Compute the newcomers' prompts (or a preempted request's tokens):
        deterministic requests alone, as they were computed the first time; the rest in
        one packed pass."""
        before = [s.table.length for s in new]  # shared prefix blocks: already there
        packed = [s for s in new if not s.deterministic]
        for s in new:
            if s.deterministic:
                self.replay(s)
        if packed:
            self.packed_prefill(packed)
        for s, first in zip(new, before):
            self.prefilled(s, step, first, 1 if s.deterministic else len(packed))

    def prefilled(self, s: Sequence, step: int, first: int, batch: int) -> None:
        """The event of a pass that computed `s`'s positions from `first` to its cache's
        length: its prompt (or a chunk of it), or a preempted request's tokens; the token
        it gave, once the prompt is whole."""
        fed = s.tokens[:s.table.length]
        kind = ("chunk" if s.prefilling else
                "prefill" if len(fed) == len(s.prompt) else "recompute")
        s.events.append(TraceEvent(
            kind=kind, step=step, input_ids=tuple(fed), positions=tuple(range(first, len(fed))),
            cache_len_before=first, cache_len_after=s.table.length, kv_computed=len(fed) - first,
            token=None if s.prefilling else s.tokens[-1], batch=batch))

    def replay(self, s: Sequence) -> None:
        """A deterministic request's prompt, alone, then (readmitted after a preemption)
        its windows, each padded to the shape it was verified with: the same bits as the
        first time."""
        window = self.verify_window
        logits = self.run(s, s.prompt)[-1]
        for start in range(len(s.prompt), len(s.tokens) - 1, window):
            rows = s.tokens[start:start + window]
            self.run(s, rows + [0] * (window - len(rows)))
            self.pool.crop(s.table, start + len(rows))
        if len(s.tokens) == len(s.prompt):
            s.tokens.append(s.sampling.choose(logits, len(s.prompt)))
        self.pool.crop(s.table, len(s.tokens) - 1)

    def packed_prefill(self, seqs: list[Sequence]) -> None:
        """Every sequence's uncached tokens in one row, each seeing only its own
        positions; each one's first new token from the logits of its last."""
        counts = [len(s.tokens) - s.table.length for s in seqs]
        for s, row in zip(seqs, self.packed(seqs, counts)):
            s.tokens.append(s.sampling.choose(row, len(s.tokens)))

    def packed(self, seqs: list[Sequence], counts: list[int],
               every_row: bool = False) -> torch.Tensor:
        """One pass of one row: the next counts[i] uncached tokens of seqs[i] (its
        proposals after its tokens), each sequence seeing only its own positions (a packed
        causal mask, no padding); the logits of each one's last token, (len(seqs), vocab),
        or with `every_row` of every token, (sum(counts), vocab)."""
        past = [s.table.length for s in seqs]
        for s, n in zip(seqs, counts):  # a decode row's slot (a prompt's were taken at admission)
            self.pool.reserve(s.table, n)
        ids = [t for s, a, n in zip(seqs, past, counts)
               for t in (s.tokens + s.proposals)[a:a + n]]
        device = self.model.device
        positions = [p for a, n in zip(past, counts) for p in range(a, a + n)]
        mask = packed_causal_mask(past, counts, device)
        cache = PagedCache(self.pool, [s.table for s in seqs], packed=counts)
        logits = self.model(torch.tensor([ids], device=device), cache=cache,
                            positions=torch.tensor(positions, device=device),
                            attention=partial(masked_attention, mask=mask))[0]
        if every_row:
            return logits
        ends = torch.tensor(counts).cumsum(0) - 1
        return logits[ends.to(device)]

    def mixed(self, decoding: list[Sequence], chunked: list[Sequence], step: int) -> None:
        """Chunked prefill's one pass (Sarathi-Serve): a row for each decoding request's
        newest token, then each prefilling request's chunk (`s.chunk` tokens), packed as
        packed_prefill packs prompts. Decodes get their next token; a chunk only if it
        ends its prompt. Each full block a chunk computed is published for prefix
        caching: its K/V exists now."""
        rows = decoding + chunked
        if not rows:
            return
        firsts = [s.table.length for s in rows]
        logits = self.packed(rows, [1] * len(decoding) + [s.chunk for s in chunked])
        for s, row in zip(decoding, logits):
            self.decoded(s, row, step, len(rows), 1)  # dense attention: no split-KV
        for s, row, first in zip(chunked, logits[len(decoding):], firsts[len(decoding):]):
            self.pool.publish(s.prompt, s.table, upto=s.table.length)
            s.stats.prefill_chunks += 1
            if not s.prefilling:  # the chunk that ends its prompt: its first new token
                s.tokens.append(s.sampling.choose(row, len(s.tokens)))
            self.prefilled(s, step, first, len(rows))
            s.chunk = 0

    def verify(self, s: Sequence, step: int) -> None:
        """Replay the request's window alone, at its fixed shape: its proposals are kept
        up to the first the replay disagrees with, then the replay's own token; the rest
        rolled back."""
        rnd = verify_and_commit(
            s.tokens, list(s.proposals), PagedCache(self.pool, [s.table]),
            lambda rows, cache: self.run(s, rows),
            partial(accept_matching, sampling=s.sampling, first_position=len(s.tokens)),
            start=s.window_start(self.verify_window), rows=self.verify_window)
        s.proposals.clear()
        s.stats.record(rnd)
        s.events.extend(round_events(step, rnd, len(s.tokens)))

    def speculate(self, batch: list[Sequence], step: int) -> None:
        """Speculation in the batch: every row proposes up to γ tokens, ONE packed pass
        scores each row's last token and proposals, and each row commits its own matching
        prefix and the target's token, its table cropped behind them (ragged: each row
        keeps what it earned)."""
        if not batch:
            return
        # 1. Each row proposes (its own proposer, made on its first step).
        for s in batch:
            if s.proposer is None:
                s.proposer = self.speculation.proposer()
            k = min(self.speculation.gamma, s.request.max_new_tokens - len(s.new_tokens) - 1)
            s.proposals = as_proposal(s.proposer[0](s.tokens, k), k, None).tokens
        # 2. ONE pass over every row's last token and proposals.
        counts = [1 + len(s.proposals) for s in batch]
        logits = self.packed(batch, counts, every_row=True).split(counts)
        # 3. Each row: judge, commit, roll back its own table (and its draft's cache).
        for s, rows in zip(batch, logits):
            proposals, s.proposals = s.proposals, []
            accept = partial(accept_matching, sampling=s.sampling,
                             first_position=len(s.tokens))
            caches = {"verifier": PagedCache(self.pool, [s.table]), **s.proposer[1]}
            rnd = commit_round(s.tokens, proposals, rows, accept, caches,
                               start=len(s.tokens) - 1, replayed=len(rows))
            s.stats.record(rnd)
            s.stats.fast_steps += 1
            s.events.extend(replace(e, batch=len(batch)) if e.kind == "verify" else e
                            for e in round_events(step, rnd, len(s.tokens)))

    def decode(self, batch: list[Sequence], step: int) -> None:
        """One batched pass: every request in `batch` feeds its newest token (a
        deterministic one's newest proposal) and gets its next."""
        if not batch:
            return
        for s in batch:
            self.pool.reserve(s.table, 1)
        cache = PagedCache(self.pool, [s.table for s in batch], batched=True)
        fed = [(s.tokens + s.proposals)[-1] for s in batch]
        positions = [len(s.tokens) + len(s.proposals) - 1 for s in batch]  # = its length
        attention, n_splits = self.decode_attention(cache, positions)
        ids = torch.tensor([[t] for t in fed], device=self.model.device)
        logits = self.model(ids, cache=cache, last_only=True, attention=attention)[:, -1]
        for s, row in zip(batch, logits):
            self.decoded(s, row, step, len(batch), n_splits)

    def decoded(self, s: Sequence, row: torch.Tensor, step: int, batch: int,
                n_splits: int) -> None:
        """A decode row's outcome: its next token (a deterministic request's next
        proposal), chosen from `row`, and its event."""
        token_in = (s.tokens + s.proposals)[-1]
        pos = len(s.tokens) + len(s.proposals) - 1
        token = s.sampling.choose(row, pos + 1)
        (s.proposals if s.deterministic else s.tokens).append(token)
        s.stats.fast_steps += 1
        if self.record_logits:
            s.fast_logits.append(row.clone())
        s.events.append(TraceEvent(
            kind="decode", step=step, input_ids=(token_in,), positions=(pos,),
            token=token, cache_len_before=pos, cache_len_after=pos + 1,
            kv_computed=1, batch=batch, n_splits=n_splits, unverified=s.deterministic))

    def decode_attention(self, cache: PagedCache, positions: list[int]) -> tuple:
        """The decode pass's attention, read through the block tables, split-KV as a GPU
        kernel would split it for this batch (so a row's numbers depend on the batch);
        its splits."""
        lengths = torch.tensor([p + 1 for p in positions], device=self.model.device)
        tables = cache.block_tables()
        n_splits = num_kv_splits(len(positions), self.model.config.kv_heads,
                                 int(lengths.max()))
        # whole tiles of keys per split, as the kernel reads them
        n_splits = splits_of(tables.size(1), self.pool.page_size, n_splits)[2]
        attention = partial(paged_attention, tables=tables, lengths=lengths,
                            n_splits=n_splits)
        return attention, n_splits


# --- checks: raise before anything runs ---------------------------------------------
def _check_speculation(model, speculative, policy) -> None:
    if speculative is not None and not isinstance(speculative, Speculation):
        raise TypeError(f"speculative must be a minikv.Speculation (Speculation(gamma=4)) or "
                        f"None, not {type(speculative).__name__}")
    if speculative is not None and policy is not None and policy.chunked_prefill:
        raise ValueError("speculative serving does not run with ChunkedPrefill yet: pick one")
    if speculative is not None and speculative.draft is not None:
        check_draft(model, speculative.draft)  # before any request runs


def _check_settings(window, page_size, max_running, policy) -> None:
    int_at_least("window", window, hint=" (positions verified per pass)")
    int_at_least("page_size", page_size, hint=" (positions per pool block)")
    if max_running is not None:
        int_at_least("max_running", max_running, hint=" (requests running at once)")
    if policy is not None and not isinstance(policy, FirstComeFirstServed):
        raise TypeError(f"policy must be a scheduling policy (TokenBudget(256)), not {policy}")


def _checked_prompts(model, requests: list[Request], window, page_size, max_running,
                     policy) -> list[list[int]]:
    """Each request's prompt as token ids, once the whole call is known to be right."""
    _check_settings(window, page_size, max_running, policy)
    if not requests:
        raise ValueError("no requests to serve")
    for i, r in enumerate(requests):
        if not isinstance(r, Request):
            raise TypeError(f"request {i} must be a minikv.Request, not {type(r).__name__}")
    return [r.checked_prompt(model, window, i) for i, r in enumerate(requests)]
