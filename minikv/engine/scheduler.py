"""Who runs, step by step: the server's scheduler (nano-vllm's `Scheduler`) and its
policies.

The `Scheduler` owns the queues, `waiting` (in arrival order) and `running` (in admission
order), and the engine step `now`. Each `step()` asks the runner (serving.py) for four
things, in order: the newcomers' prefill, the verification of deterministic requests
whose window is full, one batched decode pass, and the release of what finished. It keeps
the books through the pool: a newcomer's blocks are taken at admission, so the next
admission sees them gone.

With chunked prefill (`ChunkedPrefill`, Sarathi-Serve's stall-free batching, the default
of vLLM and SGLang) a step is instead ONE pass: a row for each decoding request's newest
token, then the next chunk of each prompt still being prefilled, as many tokens as the
step's budget has left. A long prompt then neither waits for an emptier step nor stalls
the decodes running beside it: every step costs about the same.

The policy answers three questions (`FirstComeFirstServed`, vLLM's default; a new policy
subclasses it and overrides any of them):
- `next_waiting`: which waiting request is considered next (admission stops at None);
- `fits`: may it be admitted now (room in the pool, caps, budgets);
- `victim`: which running request is preempted when the pool cannot give every row its
  slot.

`TokenBudget` adds a per-step token budget (vLLM's max_num_batched_tokens), and
`ChunkedPrefill` spends what a step has left of it on chunks of the prompts; a policy
says how many of a prompt's tokens a step computes (`chunk`).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from .paged import BlockPool, BlockTable
from .records import PoolStep, ServeStats, TraceEvent
from .validate import int_at_least


class Sequence:
    """One request inside the server: its tokens, its block table and its progress."""

    def __init__(self, index: int, request, prompt: list[int], deterministic: bool):
        self.index = index
        self.request = request
        self.prompt = prompt
        self.deterministic = deterministic  # verified: the same tokens in any batch
        self.sampling = request.sampling
        self.tokens = list(prompt)          # the prompt, then every committed new token
        self.proposals: list[int] = []      # fast-path tokens awaiting verification
        self.table = BlockTable(owner=index)
        self.prefill_end = 0                # positions its prefill computes before a token
        self.chunk = 0                      # of them, how many this step computes
        self.stats = ServeStats(prompt_len=len(prompt))
        self.events: list[TraceEvent] = []
        self.fast_logits: list[torch.Tensor] = []
        self.proposer = None                # a speculative server's (propose, its caches)

    @property
    def new_tokens(self) -> list[int]:
        return self.tokens[len(self.prompt):]

    @property
    def prefilling(self) -> bool:
        """Admitted, its prompt (or a preempted request's tokens) not all computed yet: it
        samples no token until the chunk that ends it."""
        return self.table.length < self.prefill_end

    @property
    def done(self) -> bool:
        return (len(self.new_tokens) >= self.request.max_new_tokens
                or self.sampling.eos_id in self.new_tokens)

    def window_start(self, window: int) -> int:
        """First position of the fixed window holding the last committed token."""
        last = len(self.tokens) - 1 - len(self.prompt)  # counted from the prompt's end
        return len(self.prompt) + last // window * window

    def ready_to_verify(self, window: int) -> bool:
        """Its window is full, or it proposed all it may, or an EOS: verify it now."""
        if self.done:  # nothing to judge (say max_new_tokens=1: the prefill's token)
            return False
        rows = len(self.tokens) - self.window_start(window) + len(self.proposals)
        # the proposals it may still make: the verifier adds a token of its own
        budget = self.request.max_new_tokens - len(self.new_tokens) - 1
        return (rows == window or len(self.proposals) >= budget
                or self.sampling.eos_id in self.proposals)

    def prefill_positions(self, window: int) -> int:
        """Positions its table holds once prefilled: its tokens (a preempted request's
        too, to be recomputed); a deterministic one replays its prompt, then its new
        tokens in whole padded windows."""
        if not self.deterministic:
            return len(self.tokens)
        replayed = max(0, len(self.tokens) - 1 - len(self.prompt))
        return len(self.prompt) + -(-replayed // window) * window

    @property
    def committed(self) -> list[int]:
        """Its new tokens, cut past max_new_tokens or after the EOS."""
        new = self.new_tokens[: self.request.max_new_tokens]
        if self.sampling.eos_id in new:
            new = new[: new.index(self.sampling.eos_id) + 1]
        return new

    def finish(self) -> None:
        """Cut what was produced past max_new_tokens or the EOS."""
        self.tokens = self.prompt + self.committed


@dataclass(frozen=True)
class Admission:
    """What admitting a request takes: the cached blocks its prompt reuses, the free
    blocks it takes (its positions' blocks, less the shared ones a running request
    holds), the positions its table then holds, and the tokens its prefill computes."""
    shared: list[int]
    blocks: int
    positions: int
    tokens: int


class FirstComeFirstServed:
    """Admit in arrival order while the request at the head fits; preempt the newest."""

    chunked_prefill = False  # a step: the newcomers' whole prompts, then a decode pass

    def next_waiting(self, sched: Scheduler) -> Sequence | None:
        """The head of the queue, once it has arrived: nobody overtakes it."""
        arrived = sched.waiting and sched.waiting[0].request.arrival <= sched.now
        return sched.waiting[0] if arrived else None

    def fits(self, sched: Scheduler, s: Sequence, admission: Admission) -> bool:
        """Fewer than max_running run, and the pool has its blocks plus a block of
        headroom for it and for each running request (each may start one at its next
        decode)."""
        if sched.max_running is not None and len(sched.running) >= sched.max_running:
            return False
        return sched.pool.n_free >= admission.blocks + 1 + len(sched.running)

    def victim(self, sched: Scheduler, keep: Sequence) -> Sequence:
        """The newest running request but `keep`: it has waited least, and it costs
        least to recompute."""
        return next(s for s in reversed(sched.running) if s is not keep)

    def chunk(self, sched: Scheduler, s: Sequence) -> int:
        """How many of the positions `s` has still to prefill this step computes: all."""
        return s.prefill_end - s.table.length


class TokenBudget(FirstComeFirstServed):
    """First come, first served under a budget of `max_tokens` tokens per engine step
    (vLLM's max_num_batched_tokens): one for each running request's decode, and each
    newcomer's prefill tokens. A request that would overrun the step waits for a later
    one, unless nothing runs (then it runs alone, however long, so that no request waits
    forever). Chunked prefill would instead spend what is left of the budget on a chunk
    of its prompt."""

    def __init__(self, max_tokens: int):
        self.max_tokens = int_at_least("max_tokens", max_tokens, hint=" (per step)")

    def fits(self, sched: Scheduler, s: Sequence, admission: Admission) -> bool:
        # its prefill's tokens and its decode row, on top of the step's
        within = sched.step_tokens + admission.tokens + 1 <= self.max_tokens
        return (within or not sched.running) and super().fits(sched, s, admission)


class ChunkedPrefill(TokenBudget):
    """Chunked prefill under a budget of `max_tokens` tokens per step (Sarathi-Serve;
    vLLM's enable_chunked_prefill): each step is one pass that spends the budget on a
    token for every decoding request first, then on the next chunk of each prompt being
    prefilled, oldest first; a newcomer is admitted while the step has a token left (and
    the pool its blocks), its prompt computed a chunk a step. A deterministic request's
    prompt is still computed whole and alone (its bits must not depend on the chunking),
    so it is admitted as under TokenBudget."""

    chunked_prefill = True

    def fits(self, sched: Scheduler, s: Sequence, admission: Admission) -> bool:
        if s.deterministic:
            return super().fits(sched, s, admission)
        room = sched.step_tokens < self.max_tokens
        return (room or not sched.running) and FirstComeFirstServed.fits(self, sched, s,
                                                                         admission)

    def chunk(self, sched: Scheduler, s: Sequence) -> int:
        """What the step's budget has left, up to the rest of its prompt (none when the
        decodes took it all: they finish, and the prompt goes on)."""
        left = self.max_tokens - sched.step_tokens
        return max(0, min(s.prefill_end - s.table.length, left))


class Scheduler:
    """The queues, the engine step, and the step's order; the policy decides who."""

    def __init__(self, pool: BlockPool, seqs=(),
                 policy: FirstComeFirstServed | None = None, *, verify_window: int = 4,
                 prefix_caching: bool = True, max_running: int | None = None,
                 trace: bool = False):
        self.pool = pool
        self.policy = policy or FirstComeFirstServed()
        self.verify_window = verify_window
        self.prefix_caching = prefix_caching
        self.max_running = max_running
        self.waiting = deque(sorted(seqs, key=lambda s: (s.request.arrival, s.index)))
        self.running: list[Sequence] = []
        self.now = 0          # the engine step (a request arrives at one)
        self.step_tokens = 0  # tokens this step computes, as admission counts them
        self.pool_steps: list[PoolStep] | None = [] if trace else None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self, runner) -> None:
        """One engine step: schedule, run (the runner's passes), postprocess."""
        logged = len(self.pool.log)
        # 1. Admit what has arrived and fits; the newcomers' prompts are computed.
        new = self.admit()
        if not self.running and self.waiting[0].request.arrival <= self.now:
            raise RuntimeError(f"{self.policy} admits nothing while nothing runs: let one in")
        chunked = self.policy.chunked_prefill
        runner.prefill([s for s in new if s.deterministic or not chunked], self.now)
        # 2. Verify the deterministic requests whose window is full: alone, fixed shapes.
        for s in self.to_verify():
            runner.verify(s, self.now)
        # 3. One batched decode pass for every other running request; with chunked
        #    prefill, the same pass also computes the step's prompt chunks.
        if chunked:
            decoding = self.to_decode()  # may preempt: chunks only for those still here
            runner.mixed(decoding, [s for s in self.running if s.prefilling and s.chunk],
                         self.now)
        elif runner.speculation is not None:  # room for the last token and γ proposals
            batch = self.to_decode(1 + runner.speculation.gamma)
            runner.decode([s for s in batch if s.deterministic], self.now)
            runner.speculate([s for s in batch if not s.deterministic], self.now)
        else:
            runner.decode(self.to_decode(), self.now)
        # 4. Finished requests leave; their blocks go back to the pool at once.
        for s in [s for s in self.running if s.done]:
            self.pool.free_table(s.table)
            self.running.remove(s)
        if self.pool_steps is not None:
            self.pool_steps.append(self.snapshot(logged))
        self.now += 1
        if not self.running and self.waiting:  # idle until the next arrival
            self.now = max(self.now, self.waiting[0].request.arrival)

    # --- admission --------------------------------------------------------------------
    def admit(self) -> list[Sequence]:
        """Move waiting requests to `running` while the policy picks one that fits,
        taking their blocks at once (held until their prefill runs). The step's tokens
        are counted as they are planned: a decode row for each running request, then the
        chunk each prompt being prefilled computes."""
        prefilling = [s for s in self.running if s.prefilling]
        self.step_tokens = len(self.running) - len(prefilling)  # a decode row each
        for s in prefilling:
            self.plan_chunk(s)
        new = []
        while (s := self.policy.next_waiting(self)) is not None:
            admission = self.admission(s)
            if not self.policy.fits(self, s, admission):
                break
            self.take(s, admission)
            new.append(s)
        return new

    def admission(self, s: Sequence) -> Admission:
        """What admitting `s` would take, the pool unchanged. A deterministic request
        shares no block: another request's pass, of another shape, computed those."""
        page = self.pool.page_size
        positions = s.prefill_positions(self.verify_window)
        reuse = self.prefix_caching and not s.deterministic
        shared = self.pool.cached_prefix(s.prompt) if reuse else []
        held = sum(self.pool.ref[b] > 0 for b in shared)  # cost no free block
        return Admission(shared, -(-positions // page) - held, positions,
                         positions - len(shared) * page)

    def take(self, s: Sequence, admission: Admission) -> None:
        self.waiting.remove(s)
        for block in admission.shared:  # K/V another prompt with these tokens computed
            self.pool.share(block, s.index)
        s.table.blocks = list(admission.shared)
        s.table.length = len(admission.shared) * self.pool.page_size
        s.stats.reused += s.table.length
        self.pool.reserve(s.table, admission.positions - s.table.length)
        self.running.append(s)  # counted in the next admission's headroom
        if self.policy.chunked_prefill and not s.deterministic:
            s.prefill_end = len(s.tokens)  # computed a chunk a step, then its first token
            self.plan_chunk(s)  # its blocks are published as its chunks fill them
        else:  # its whole prefill this step, and a decode row after it
            self.pool.publish(s.prompt, s.table)  # findable now: its prefill runs first
            self.step_tokens += admission.tokens + 1

    def plan_chunk(self, s: Sequence) -> None:
        """The chunk of its prompt `s` computes this step, as the policy allots it."""
        s.chunk = self.policy.chunk(self, s)
        self.step_tokens += s.chunk

    # --- what runs --------------------------------------------------------------------
    def to_verify(self):
        """The deterministic requests whose window is full, each once the pool has room
        for its replay (lazily: the one before may free blocks, or preempt it)."""
        window = self.verify_window
        due = [s for s in self.running if s.deterministic and s.ready_to_verify(window)]
        for s in due:
            if s in self.running:
                self.make_room([s], len(s.tokens) + window - s.table.length, keep=s)
                yield s

    def to_decode(self, n_new: int = 1) -> list[Sequence]:
        """Every other unfinished running request, once the pool has `n_new` slots for
        each one's next positions (the oldest always goes on)."""
        window = self.verify_window
        batch = [s for s in self.running if not s.done and not s.prefilling
                 and not (s.deterministic and s.ready_to_verify(window))]
        if batch:
            self.make_room(batch, n_new, keep=batch[0])
        return [s for s in batch if s in self.running]

    # --- preemption -------------------------------------------------------------------
    def make_room(self, seqs: list[Sequence], n_new: int, keep: Sequence) -> None:
        """Preempt the policy's victims (never `keep`) until the pool has the blocks for
        n_new more positions in each of `seqs` still running."""
        def needed() -> int:
            return sum(self.pool.blocks_needed(s.table, n_new) for s in seqs
                       if s in self.running)
        while self.pool.n_free < needed():
            self.preempt(self.policy.victim(self, keep))

    def preempt(self, s: Sequence) -> None:
        """Its blocks go back and it waits first in line; its committed tokens are kept,
        to be recomputed on readmission, its unverified proposals dropped."""
        s.proposals.clear()
        s.prefill_end = s.chunk = 0
        s.events.append(TraceEvent(kind="preempt", step=self.now, cache_len_after=0,
                                   cache_len_before=len(s.tokens) - 1))
        self.pool.free_table(s.table, preempted=True)
        s.stats.preempted += 1
        self.running.remove(s)
        self.waiting.appendleft(s)

    def snapshot(self, logged: int) -> PoolStep:
        """The pool after this step, and what the step did to it (the log from `logged`
        on)."""
        return PoolStep(self.now, {s.index: tuple(s.table.blocks) for s in self.running},
                        {s.index: s.table.length for s in self.running},
                        tuple(self.pool.ref),
                        tuple((self.now, *entry) for entry in self.pool.log[logged:]))
