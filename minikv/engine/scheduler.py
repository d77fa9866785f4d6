"""Who runs, step by step: the server's scheduler (nano-vllm's `Scheduler`) and its
policies.

The `Scheduler` owns the queues, `waiting` (in arrival order) and `running` (in admission
order), and the engine step `now`. Each `step()` asks the runner (serving.py) for four
things, in order: the newcomers' prefill, the verification of deterministic requests
whose window is full, one batched decode pass, and the release of what finished. It keeps
the books through the pool: a newcomer's blocks are taken at admission, so the next
admission sees them gone.

The policy answers three questions (`FirstComeFirstServed`, vLLM's default; a new policy
subclasses it and overrides any of them):
- `next_waiting`: which waiting request is considered next (admission stops at None);
- `fits`: may it be admitted now (room in the pool, caps, budgets);
- `victim`: which running request is preempted when the pool cannot give every row its
  slot.

`TokenBudget` adds a per-step token budget (vLLM's max_num_batched_tokens): the budget
that chunked prefill spends on chunks of a long prompt.
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
        self.stats = ServeStats(prompt_len=len(prompt))
        self.events: list[TraceEvent] = []
        self.fast_logits: list[torch.Tensor] = []

    @property
    def new_tokens(self) -> list[int]:
        return self.tokens[len(self.prompt):]

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

    def finish(self) -> None:
        """Cut what was produced past max_new_tokens or the EOS."""
        new = self.new_tokens[: self.request.max_new_tokens]
        if self.sampling.eos_id in new:
            new = new[: new.index(self.sampling.eos_id) + 1]
        self.tokens = self.prompt + new


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
        runner.prefill(new, self.now)
        # 2. Verify the deterministic requests whose window is full: alone, fixed shapes.
        for s in self.to_verify():
            runner.verify(s, self.now)
        # 3. One batched decode pass for every other running request.
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
        taking their blocks at once (held until their prefill runs)."""
        self.step_tokens = len(self.running)  # a decode row each
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
        self.pool.publish(s.prompt, s.table)  # findable now: its prefill runs this step
        self.running.append(s)  # counted in the next admission's headroom
        self.step_tokens += admission.tokens + 1

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

    def to_decode(self) -> list[Sequence]:
        """Every other unfinished running request, once the pool has a slot for each
        one's next position (the oldest always goes on)."""
        window = self.verify_window
        batch = [s for s in self.running
                 if not s.done and not (s.deterministic and s.ready_to_verify(window))]
        if batch:
            self.make_room(batch, 1, keep=batch[0])
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
