"""Who runs, step by step: the server's scheduler (nano-vllm's and vLLM's) and its
policy.

The `Scheduler` owns the requests (queues `waiting`, in arrival order, and `running`, in
admission order), the pool's books and the engine step `now`. `schedule()` gives every
running request one piece of work and admits newcomers while they fit; the runner
(serving.py) runs the plan; `postprocess()` commits and frees the finished at once.

A deterministic request (LLM-42's replay) is one policy: its prompt is computed alone,
never from shared blocks nor in chunks, and its fast-path tokens wait as proposals until
its `replay_window` is full; then the window is replayed alone, at a fixed shape.

A policy (`FirstComeFirstServed`, vLLM's default) answers four questions,
`next_waiting`, `fits`, `victim`, `chunk`; a new one subclasses it. Its knobs are
vLLM's: `max_tokens` a step (max_num_batched_tokens) and `chunked_prefill`
(Sarathi-Serve: what a step's decodes leave of the budget goes to chunks of the
prompts).
"""
from __future__ import annotations

from collections import deque

from .paged import BlockPool, BlockTable
from .radix import Hit, Radix, prefix_cache
from .records import PoolStep, RequestOutput, ServeStats, TraceEvent
from .sampling import Request
from .validate import check_flags, check_room, int_at_least, tightest, token_ids


class Sequence:
    """One request inside the server: its tokens, its block table and its progress."""

    def __init__(self, index: int, request, prompt: list[int], replay: bool, proposer=None):
        self.index, self.request, self.prompt = index, request, prompt
        self.sampling = request.sampling
        self.replay = replay            # deterministic: replayed alone, window by window
        self.tokens = list(prompt)      # the prompt, then every committed new token
        self.proposals: list[int] = []  # a replayed request's fast-path tokens, unjudged
        self.table = BlockTable(owner=index)
        self.prefill_end = 0            # positions computed before its next token
        self.chunk = 0                  # of them, how many this step computes
        self.proposer = proposer        # a speculating server's proposer, its own
        self.sent = 0                   # new tokens handed out so far (-1: finished)
        self.stats = ServeStats(prompt_len=len(prompt))
        self.events: list[TraceEvent] = []
        self.fast_logits: list = []     # with record_logits: each fast-path row's logits

    @property
    def new_tokens(self) -> list[int]:
        return self.tokens[len(self.prompt):]

    @property
    def prefilling(self) -> bool:
        """Admitted, its prompt (or a preempted request's tokens) not all computed yet."""
        return self.table.length < self.prefill_end

    @property
    def done(self) -> bool:
        return (len(self.new_tokens) >= self.request.max_new_tokens
                or self.sampling.eos_id in self.new_tokens)

    @property
    def committed(self) -> list[int]:
        """Its new tokens, cut past max_new_tokens or after the EOS."""
        new = self.new_tokens[: self.request.max_new_tokens]
        if self.sampling.eos_id in new:
            new = new[: new.index(self.sampling.eos_id) + 1]
        return new

    # --- deterministic replay: where its windows start, when one is due ---------------
    def window_start(self, window: int) -> int:
        """First position of the replay window holding the last committed token."""
        last = len(self.tokens) - 1 - len(self.prompt)  # counted from the prompt's end
        return len(self.prompt) + last // window * window

    def due(self, window: int) -> bool:
        """Its window is full, or it proposed all it may, or an EOS: replay it now."""
        if not self.replay or self.done:  # nothing to judge (its last token came first)
            return False
        rows = len(self.tokens) - self.window_start(window) + len(self.proposals)
        budget = self.request.max_new_tokens - len(self.new_tokens) - 1  # + the replay's
        return (rows == window or len(self.proposals) >= budget
                or self.sampling.eos_id in self.proposals)

    def prefill_positions(self, window: int) -> int:
        """Positions its table holds once prefilled: its tokens (recomputed after a
        preemption); a replayed one's prompt, then its tokens in whole windows."""
        if not self.replay:
            return len(self.tokens)
        replayed = max(0, len(self.tokens) - 1 - len(self.prompt))
        return len(self.prompt) + -(-replayed // window) * window


def fit(request, cfg, page_size: int, ahead: int, num_blocks: int | None,
        rooms: dict[str, int | None] | None = None) -> tuple:
    """THE fit rule (serve, Engine.add and the HTTP server call it): the request's prompt
    as token ids and the pool blocks it needs alone. Prompt, max_new_tokens and `ahead`
    (the replay window, or what a speculative round writes past its last token) must fit
    the model's context and the `rooms` of its proposer's caches ({name: max_len}); a
    block each page_size positions and one more (a shared block copied on write) must fit
    `num_blocks` (None: a pool still to be sized). ValueError otherwise."""
    prompt = token_ids(request.prompt, cfg.vocab_size)
    int_at_least("max_new_tokens", request.max_new_tokens)
    int_at_least("arrival", request.arrival, 0, hint=" (an engine step)")
    check_flags(deterministic=request.deterministic)
    request.sampling.check_vocab(cfg.vocab_size)
    positions = len(prompt) + request.max_new_tokens + ahead
    limit, whose = tightest(cfg.block_size, rooms or {})
    check_room(positions, limit, f"{len(prompt)} prompt + {request.max_new_tokens} new + "
               f"{ahead} ahead", "max_new_tokens", whose)
    blocks = -(-positions // page_size) + 1
    if num_blocks is not None and blocks > num_blocks:
        raise ValueError(f"it needs more than the pool: {blocks} blocks of {page_size} "
                         f"positions, num_blocks={num_blocks}; lower max_new_tokens")
    return prompt, blocks


class FirstComeFirstServed:
    """Admit in arrival order while the request at the head fits; preempt the newest.
    With `max_tokens`, no step computes more tokens than that (a request that would
    overrun it waits, unless nothing runs); with `chunked_prefill` too, what the decodes
    leave goes to chunks of the prompts, oldest first (a replayed prompt is computed
    whole: its bits must not depend on the chunking)."""

    def __init__(self, max_tokens: int | None = None, chunked_prefill: bool = False):
        if max_tokens is not None:
            int_at_least("max_tokens", max_tokens, hint=" (tokens per step)")
        check_flags(chunked_prefill=chunked_prefill)
        if chunked_prefill and max_tokens is None:
            raise ValueError("chunked_prefill needs max_tokens, the budget it cuts to")
        self.max_tokens, self.chunked_prefill = max_tokens, chunked_prefill

    def __repr__(self) -> str:
        chunked = f", chunked_prefill={self.chunked_prefill}"
        return f"{type(self).__name__}({self.max_tokens}{chunked})"

    def next_waiting(self, sched: Scheduler) -> Sequence | None:
        """The head of the queue, once it has arrived: nobody overtakes it."""
        arrived = sched.waiting and sched.waiting[0].request.arrival <= sched.now
        return sched.waiting[0] if arrived else None

    def fits(self, sched: Scheduler, s: Sequence, blocks: int, tokens: int) -> bool:
        """May `s` come in, taking `blocks` blocks and computing `tokens` tokens? Fewer
        than max_running run; the free blocks hold its own, plus one of headroom for it
        and each running request; the budget has room (a token, for a chunked one)."""
        if sched.max_running is not None and len(sched.running) >= sched.max_running:
            return False
        if sched.free_blocks() < blocks + 1 + len(sched.running):
            return False
        if self.max_tokens is None or not sched.running:  # alone, it runs however long
            return True
        if self.chunked_prefill and not s.replay:
            return sched.step_tokens < self.max_tokens
        return sched.step_tokens + tokens <= self.max_tokens

    def victim(self, sched: Scheduler, keep: Sequence) -> Sequence:
        """The newest running request but `keep`: it waited least, costs least to redo."""
        return next(s for s in reversed(sched.running) if s is not keep)

    def chunk(self, sched: Scheduler, s: Sequence) -> int:
        """Positions of its prefill `s` computes this step: all, or what the budget left."""
        rest = s.prefill_end - s.table.length
        if not self.chunked_prefill or s.replay:
            return rest
        return max(0, min(rest, self.max_tokens - sched.step_tokens))


def check_policy(policy) -> None:
    if policy is not None and not isinstance(policy, FirstComeFirstServed):
        raise TypeError(f"policy must be a scheduling policy (FirstComeFirstServed(256)), "
                        f"not {policy!r:.40}")

class Scheduler:
    """The requests, their queues and the engine step; the policy decides who."""

    def __init__(self, pool: BlockPool, cfg, policy: FirstComeFirstServed | None = None, *,
                 replay_window: int = 4, ahead: int | None = None, rooms: dict | None = None,
                 prefix_caching: bool | Radix = True,
                 max_running: int | None = None, trace: bool = False):
        self.pool, self.cfg = pool, cfg
        self.policy = policy or FirstComeFirstServed()
        self.replay_window = replay_window
        self.ahead = ahead    # speculating: what a round writes past its last token
        self.rooms = rooms    # speculating: the max_len of a proposer's caches, by name
        self.max_running = max_running
        self.prefix = prefix_cache(pool, prefix_caching, cfg)  # what others computed
        self.seqs: dict[int, Sequence] = {}  # every request not yet forgotten
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.now = 0          # the engine step (a request arrives at one)
        self.step_tokens = 0  # tokens this step computes, as they are planned
        self.promised = 0     # free blocks this step's running rows will take
        self.pool_steps: list[PoolStep] | None = [] if trace else None

    # --- the requests -----------------------------------------------------------------
    def check(self, request, index: int | None = None,
              pool: bool = True) -> tuple[list[int], int]:
        """fit() for this server, an error naming the request (a caller may send many):
        its prompt and the blocks it needs (within the pool, with `pool`)."""
        who = "the request" if index is None else f"request {index}"
        if not isinstance(request, Request):
            raise TypeError(f"{who} must be a minikv.Request, not "
                            f"{type(request).__name__}")
        ahead = max(self.replay_window, 1 + (self.ahead or 0))
        try:
            return fit(request, self.cfg, self.pool.page_size, ahead,
                       self.pool.num_blocks if pool else None, self.rooms)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{who}: {e}") from None

    def add(self, request, index: int | None, replay: bool, proposer=None) -> int:
        """Queue `request` as request `index` (None: the first unused) behind those that
        arrive no later; its index."""
        prompt, _ = self.check(request, index)
        if index is None:
            index = next(i for i in range(len(self.seqs) + 1) if i not in self.seqs)
        int_at_least("index", index, 0, " (the caller's number for the request)")
        if index in self.seqs:
            raise ValueError(f"request {index} is already in this engine: give another")
        s = Sequence(index, request, prompt, replay and request.deterministic, proposer)
        later = [k for k, w in enumerate(self.waiting)
                 if w.request.arrival > request.arrival]
        self.waiting.insert(later[0] if later else len(self.waiting), s)
        self.seqs[index] = s
        return index

    def abort(self, index: int) -> None:
        """Out of the queue, or its blocks back at once; a finished request stays as is."""
        if index not in self.seqs:
            raise ValueError(f"no request {index} in this engine")
        s = self.seqs[index]
        s.sent = -1  # nobody waits for it any more
        if s in self.waiting:
            self.waiting.remove(s)
        elif s in self.running:
            self.prefix.leave(s)
            self.pool.free_table(s.table)
            self.running.remove(s)

    def forget(self, index: int) -> None:
        """Drop a finished or aborted request's record (a long-running server's memory)."""
        if index in self.seqs and self.seqs[index].sent >= 0:
            raise ValueError(f"request {index} is still running: abort it first")
        self.seqs.pop(index, None)

    def block_table(self, index: int) -> list[int]:
        return list(self.seqs[index].table.blocks)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def stats(self) -> dict:
        return {"running": len(self.running), "waiting": len(self.waiting),
                "step": self.now, "free_blocks": self.pool.n_free,
                "num_blocks": self.pool.num_blocks}

    def outputs(self) -> dict[int, RequestOutput]:
        """{index: RequestOutput} of every request not forgotten, in index order."""
        outs = {}
        for i, s in sorted(self.seqs.items()):
            s.stats.new_tokens = len(s.committed)
            trace = s.events if self.pool_steps is not None else None
            outs[i] = RequestOutput(s.request, s.committed, s.stats, trace, s.fast_logits)
        return outs

    # --- 1. schedule ------------------------------------------------------------------
    def schedule(self) -> dict[str, list[Sequence]]:
        """The step's plan, in vLLM's order: the running requests' work first, room made
        for it (preempting the newest), then newcomers in what is left. One piece of work
        each: "replay" (a replayed prompt alone, or a full window), "prefill" (whole
        prompts, one packed pass), "chunks" (`s.chunk` tokens each, in the decode pass),
        "decode" (a token each) or "speculate" (a token and its proposals)."""
        self.logged, window, ahead = len(self.pool.log), self.replay_window, self.ahead
        ready = [s for s in self.running if not s.prefilling]
        due = [s for s in ready if s.due(window)]
        decode = [s for s in ready if s not in due]
        self.make_room([(s, len(s.tokens) + window - s.table.length) for s in due]
                       + [(s, 1 + (ahead or 0) * (not s.replay)) for s in decode])
        due, decode = ([s for s in group if s in self.running] for group in (due, decode))
        self.step_tokens = len(due) + len(decode)  # a decode row each
        for s in self.running:
            if s.prefilling:  # a prompt being computed in chunks: its next one
                self.plan_chunk(s)
        self.admit()
        if not self.running and self.waiting[0].request.arrival <= self.now:
            raise RuntimeError(f"{self.policy} admits nothing while nothing runs")
        prompts = [s for s in self.running if s.prefilling and s.chunk]
        whole = [s for s in prompts if not s.replay]
        chunked = self.policy.chunked_prefill
        return {"replay": [s for s in prompts if s.replay] + due,
                "prefill": [] if chunked else whole, "chunks": whole if chunked else [],
                "decode": [s for s in decode if ahead is None or s.replay],
                "speculate": [s for s in decode if ahead is not None and not s.replay]}

    def admission(self, s: Sequence, cached: bool = True) -> tuple[Hit, int, int]:
        """What admitting `s` takes, the pool unchanged: what its prefix finds cached
        (nothing for a replayed one: another pass, of another shape, computed it; nor for
        a proposer that reads the target's features of every position), the free blocks
        it takes (a cached block that is held costs none) and the tokens it computes."""
        positions = s.prefill_positions(self.replay_window)
        reuse = cached and not (s.replay or getattr(s.proposer, "wants_features", False))
        hit = self.prefix.lookup(s) if reuse else Hit()
        blocks = -(-positions // self.pool.page_size) - hit.n_blocks + hit.taken
        return hit, blocks, positions - hit.length

    def admit(self) -> None:
        """Newcomers to `running` while the policy picks one that fits, blocks taken
        (cached ones nobody runs on evicted first, when the pool is short)."""
        while (s := self.policy.next_waiting(self)) is not None:
            hit, blocks, tokens = self.admission(s)
            if (short := blocks + 1 + len(self.running) - self.free_blocks()) > 0:
                self.prefix.evict(short, spare=hit)  # cached blocks nobody runs on go first
                if blocks + 1 - self.free_blocks() > 0 and not self.running:
                    # Alone, it must run, if need be computing what it would have read.
                    hit, blocks, tokens = self.admission(s, cached=False)
                    self.prefix.evict(blocks + 1 - self.free_blocks())
            if not self.policy.fits(self, s, blocks, tokens):
                break
            self.waiting.remove(s)
            self.prefix.take(s, hit)
            s.stats.reused += s.table.length
            self.pool.reserve(s.table, tokens)
            self.running.append(s)
            # Its prefill ends where its next token is chosen: after all its tokens, or, for
            # a replayed one, before the last, which its next window feeds.
            s.prefill_end = (max(len(s.prompt), len(s.tokens) - 1) if s.replay
                             else s.table.length + tokens)
            if self.policy.chunked_prefill and not s.replay:
                self.plan_chunk(s)  # its blocks are published as its chunks compute them
            else:  # hashed blocks findable now: its prefill runs first
                self.prefix.publish(s, s.prefill_end)
                s.chunk = s.prefill_end - s.table.length
                self.step_tokens += s.chunk

    def free_blocks(self) -> int:
        """Free blocks that this step's running rows were not promised."""
        return self.pool.n_free - self.promised

    def plan_chunk(self, s: Sequence) -> None:
        s.chunk = self.policy.chunk(self, s)
        self.step_tokens += s.chunk

    def make_room(self, rows: list[tuple[Sequence, int]]) -> None:
        """Preempt the policy's victims (never the first row's) until the pool has the
        blocks for every row's new positions, then promise them."""
        def needed() -> int:
            return sum(self.pool.blocks_needed(s.table, n) for s, n in rows
                       if s in self.running)
        while (short := needed() - self.pool.n_free) > 0:
            # Cached blocks nobody runs on go first; alone, a request lets go of its own.
            alone = len(self.running) == 1
            if not (self.prefix.evict(short) or alone and self.prefix.evict(short, locked=True)):
                self.preempt(self.policy.victim(self, rows[0][0]))
        self.promised = needed()

    def preempt(self, s: Sequence) -> None:
        """Its blocks go back and it waits first in line, its committed tokens kept (to
        be recomputed on readmission), its unjudged proposals dropped."""
        s.proposals.clear()
        s.prefill_end = s.chunk = 0
        if s.proposer is not None:  # its caches follow the target's: it starts over too
            s.proposer = s.proposer.fresh()
        s.events.append(TraceEvent(kind="preempt", step=self.now, cache_len_after=0,
                                   cache_len_before=len(s.tokens) - 1))
        self.prefix.leave(s)
        self.pool.free_table(s.table, preempted=True)
        s.stats.preempted += 1
        self.running.remove(s)
        self.waiting.appendleft(s)

    # --- 3. postprocess ---------------------------------------------------------------
    def postprocess(self, plan: dict, produced: dict) -> dict[int, tuple[list[int], bool]]:
        """Commit what each row produced (a replayed request's fast-path tokens wait as
        proposals); the finished leave, their blocks back at once. For each request that
        moved on: the tokens it committed this step, and whether it is done."""
        for s, tokens in produced.items():
            if s.replay and s in plan["decode"]:
                s.proposals += tokens
            else:  # committed; a replay has judged every proposal
                s.tokens += tokens
                s.proposals.clear()
        for s in plan["prefill"] + plan["chunks"]:  # their new positions' K/V exist now
            self.prefix.publish(s, s.table.length)
        for s in [s for s in self.running if s.done]:
            self.prefix.leave(s)
            self.pool.free_table(s.table)
            self.running.remove(s)
        if self.pool_steps is not None:
            self.pool_steps.append(PoolStep(
                self.now, {s.index: tuple(s.table.blocks) for s in self.running},
                {s.index: s.table.length for s in self.running}, tuple(self.pool.ref),
                tuple((self.now, *entry) for entry in self.pool.log[self.logged:])))
        self.now += 1
        if not self.running and self.waiting:  # idle until the next arrival
            self.now = max(self.now, self.waiting[0].request.arrival)
        moved = {}
        for s in produced:
            new = s.committed
            if s.sent >= 0 and (len(new) > s.sent or s.done):
                moved[s.index] = (new[s.sent:], s.done)
                s.sent = -1 if s.done else len(new)
        return moved
