"""A server: continuous batching over a paged KV cache, with deterministic requests
(after LLM-42, arXiv 2601.17768) and speculation in the batch. `Engine.step` is
nano-vllm's three calls: the Scheduler plans, the `Runner` runs the plan's passes, the
Scheduler commits. A step's passes:

- replay: a deterministic request alone, at fixed shapes (its prompt, or its window of
  fast-path tokens judged by the verify core): its output is the same in any batch;
- prefill: the newcomers' prompts packed in one row, each seeing only its own positions;
- decode: the others' next tokens in ONE pass read through the block tables, split-KV sized
  to the batch (a row's numbers depend on it, as in real servers), or replayed as a CUDA
  graph (Engine(graphs=), static.py); with chunked prefill, in the prompts' chunks' pass;
- speculate: each row proposes (a chain or a tree), ONE packed pass scores them all,
  each commits its matching prefix and the target's token: every request gets its plain
  tokens.
"""
from __future__ import annotations

from dataclasses import replace
from functools import partial

import torch

from .attention import masked_attention, num_kv_splits, packed_causal_mask, paged_attention
from .cache import upload
from .flash import splits_of
from .lookup import PromptLookup
from .paged import BlockPool, PagedBatch, PagedCache
from .radix import Radix, check_prefix_caching
from .records import ServeOutputs, TraceEvent
from .sampling import Request, SamplingParams, choose_rows
from .scheduler import FirstComeFirstServed, Scheduler, Sequence, check_policy
from .speculative import DraftProposer, Speculation, as_proposal, check_speculation
from .static import GraphDecode
from .tree import tree_mask, tree_positions
from .validate import check_flags, check_model, check_room, int_at_least
from .verify import accept_matching, commit_round, round_events, verify_and_commit


def serve(model, requests, replay_window: int = 4, replay: bool = True,
          trace: bool = False, record_logits: bool = False, *, page_size: int = 16,
          num_blocks: int | None = None, prefix_caching: bool | Radix = True,
          max_running: int | None = None, policy: FirstComeFirstServed | None = None,
          speculative: Speculation | None = None) -> ServeOutputs:
    """Serve `requests` (each arriving at its `arrival` step) to completion, over a pool
    of `num_blocks` blocks of `page_size` positions (default: room for all at once).
    `prefix_caching`: a prompt reuses the blocks of its beginning another computed
    (True: found by hash, chapter 06; Radix(): in a radix tree, kept past its request);
    `max_running` caps the batch; `policy` admits and preempts (scheduler.py);
    deterministic requests are replayed every `replay_window` positions (`replay=False`:
    never); `speculative`: the others propose tokens that a packed pass verifies."""
    if not hasattr(requests, "__iter__"):
        raise TypeError(f"requests must be a list of minikv.Request, not {requests!r:.30}")
    requests = list(requests)
    if not requests:
        raise ValueError("no requests to serve")
    engine = Engine(model, 1 if num_blocks is None else num_blocks,
                    replay_window=replay_window, replay=replay, trace=trace,
                    record_logits=record_logits, page_size=page_size,
                    prefix_caching=prefix_caching, max_running=max_running, policy=policy,
                    speculative=speculative)
    if num_blocks is None:  # room for every request at once: the blocks each one needs
        needs = [engine.check(r, i, pool=False)[1] for i, r in enumerate(requests)]
        engine._new_pool(sum(needs))
    for i, r in enumerate(requests):
        engine.add(r, index=i)
    while engine.has_work():
        engine.step()
    outputs = list(engine.outputs().values())
    return ServeOutputs(outputs, engine.pool, engine.pool_steps())


class Engine:
    """serve()'s loop a step at a time, for a caller that adds requests as they come and
    reads their tokens as they are made (an HTTP server, a load generator): vLLM's and
    nano-vllm's LLMEngine. One thread owns it."""

    def __init__(self, model, num_blocks: int, *, replay_window: int = 4,
                 replay: bool = True, trace: bool = False, record_logits: bool = False,
                 page_size: int = 16, prefix_caching: bool | Radix = True,
                 max_running: int | None = None, policy: FirstComeFirstServed | None = None,
                 speculative: Speculation | None = None, graphs: tuple | None = None):
        _check_settings(model, num_blocks, replay_window, page_size, max_running, prefix_caching,
                        replay=replay, trace=trace, record_logits=record_logits)
        check_policy(policy)
        check_speculation(model, speculative, policy)
        self.model, self.replay, self.page_size, self.graphs = model, replay, page_size, graphs
        self.runner = Runner(model, replay_window, record_logits, speculative)
        proposer = self.runner.proposer()  # a round writes γ past its token, or a tree
        self.settings = dict(
            policy=policy, replay_window=replay_window, prefix_caching=prefix_caching,
            max_running=max_running, trace=trace,
            ahead=proposer and proposer.max_tokens(speculative.gamma),
            rooms={name: c.max_len for name, c in (proposer.caches if proposer else {}).items()})
        self._new_pool(num_blocks)

    def _new_pool(self, num_blocks: int) -> None:
        """A pool of `num_blocks` blocks, and a scheduler over it (serve: before any add)."""
        self.pool = self.runner.pool = BlockPool(
            self.model.config, num_blocks, self.page_size, device=self.model.device,
            dtype=self.model.dtype)
        self.scheduler = Scheduler(self.pool, self.model.config, **self.settings)
        if self.graphs is not None:  # decode replayed, a CUDA graph a batch size (static.py)
            self.runner.graphs = GraphDecode(self.model, self.pool, self.graphs)

    def check(self, request: Request, index: int | None = None, *,
              pool: bool = True) -> tuple:
        """The fit rule (scheduler.fit) for a caller that checks a request before adding
        it: its prompt as ids and the blocks it needs (in the pool), or a clear error."""
        return self.scheduler.check(request, index, pool)

    def add(self, request: Request, index: int | None = None) -> int:
        """Queue `request` behind those that arrive no later (`arrival`: an engine step);
        its index (`index`: the caller's own numbering, refused if in use)."""
        return self.scheduler.add(request, index, self.replay, self.runner.proposer())

    def step(self) -> dict[int, tuple[list[int], bool]]:
        """One step; for each request that moved on: its new tokens, and if it is done."""
        if not self.has_work():
            return {}
        plan = self.scheduler.schedule()
        produced = self.runner.run(plan, self.scheduler.now)
        return self.scheduler.postprocess(plan, produced)

    # --- the Scheduler's, as a front end needs them -----------------------------------
    def abort(self, index: int) -> None:
        self.scheduler.abort(index)

    def forget(self, index: int) -> None:
        self.scheduler.forget(index)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def stats(self) -> dict:
        return self.scheduler.stats() | {"max_running": self.settings["max_running"]}

    def block_table(self, index: int) -> list[int]:
        return self.scheduler.block_table(index)

    def outputs(self) -> dict:
        return self.scheduler.outputs()

    def pool_steps(self) -> list:
        return self.scheduler.pool_steps or []


class Runner:
    """The passes of a step on the model and the pool (nano-vllm's ModelRunner): it runs
    the plan, records each row's events and rounds, and says what each row produced."""

    def __init__(self, model, replay_window: int, record_logits: bool,
                 speculation: Speculation | None):
        self.model, self.pool = model, None  # the Engine's pool
        self.replay_window, self.record_logits = replay_window, record_logits
        self.speculation, self.graphs = speculation, None

    def proposer(self):
        """A request's own proposer: the one given, fresh; a draft's, greedy; or lookup."""
        spec = self.speculation
        if spec is None:
            return None
        if spec.proposer is not None:
            return spec.proposer.fresh()
        if spec.draft is not None:
            return DraftProposer(spec.draft, SamplingParams())
        return PromptLookup(spec.ngram)

    def run(self, plan: dict, step: int) -> dict[Sequence, list[int]]:
        """The plan's passes; each row's tokens (a replayed request's decode: a proposal)."""
        out = {}
        with torch.inference_mode():
            for s in plan["replay"]:
                out[s] = (self.replay_prompt if s.prefilling else self.replay)(s, step)
            out |= self.prefill(plan["prefill"], step)
            if plan["chunks"]:  # chunked prefill: the decodes ride in the chunks' pass
                out |= self.prefill(plan["chunks"], step, decoding=plan["decode"])
            else:
                out |= self.decode(plan["decode"], step)
            out |= self.speculate(plan["speculate"], step)
        return out

    # --- a deterministic request: alone, at fixed shapes ------------------------------
    def alone(self, s: Sequence, tokens: list[int]) -> torch.Tensor:
        """One sequence's pass over `tokens`, after its cached positions: (T, vocab)."""
        self.pool.reserve(s.table, len(tokens))
        ids = torch.tensor([tokens], device=self.model.device)
        return self.model(ids, cache=PagedCache(self.pool, [s.table]))[0]

    def replay_prompt(self, s: Sequence, step: int) -> list[int]:
        """Its prompt alone, then (after a preemption) its windows, each padded to the
        shape it was replayed with, for the same bits; its first token."""
        window = self.replay_window
        logits = self.alone(s, s.prompt)[-1]
        for start in range(len(s.prompt), len(s.tokens) - 1, window):
            rows = s.tokens[start:start + window]
            self.alone(s, rows + [0] * (window - len(rows)))
            self.pool.crop(s.table, start + len(rows))
        fresh = len(s.tokens) == len(s.prompt)  # else its tokens were recomputed
        new = [s.sampling.choose(logits, len(s.prompt))] if fresh else []
        self.pool.crop(s.table, len(s.tokens) + len(new) - 1)
        self.prefilled(s, step, 0, 1, new[0] if new else None)
        return new

    def replay(self, s: Sequence, step: int) -> list[int]:
        """Its window replayed alone at its fixed shape: the proposals the replay agrees
        with and its own token are committed, the rest rolled back."""
        seq = list(s.tokens)
        rnd = verify_and_commit(
            seq, list(s.proposals), PagedCache(self.pool, [s.table]),
            lambda rows, cache: self.alone(s, rows),
            partial(accept_matching, sampling=s.sampling, first_position=len(seq)),
            start=s.window_start(self.replay_window), rows=self.replay_window)
        s.stats.record(rnd)
        s.events += round_events(step, rnd, len(seq))
        return seq[len(s.tokens):]

    # --- the batch --------------------------------------------------------------------
    def packed(self, seqs: list[Sequence], inputs: list[list[int]],
               every_row: bool = False, trees: list | None = None) -> torch.Tensor:
        """ONE pass of one row: inputs[i] after seqs[i]'s positions, each seeing only
        its own (a tree's nodes kept apart by trees[i], its parents), no padding; the
        logits of each last input (of every input, with `every_row`). A proposer that
        reads the target's features is handed its rows'."""
        device, trees = self.model.device, trees or [None] * len(seqs)
        past, counts = [s.table.length for s in seqs], [len(x) for x in inputs]
        for s, n in zip(seqs, counts):  # a decode row's slot (a prompt's: at admission)
            self.pool.reserve(s.table, n)
        positions = [p for a, n, parents in zip(past, counts, trees)
                     for p in (range(a, a + n) if parents is None
                               else [a, *tree_positions(parents, a)])]
        masks = [None if p is None else tree_mask(p).to(device) for p in trees]
        mask = packed_causal_mask(past, counts, device, masks)
        ids = upload([[t for x in inputs for t in x]], device)  # behind the mask's kernels
        kwargs = dict(cache=PagedCache(self.pool, [s.table for s in seqs], counts),
                      positions=upload(positions, device),
                      attention=partial(masked_attention, mask=mask))
        wants = [getattr(s.proposer, "wants_features", False) for s in seqs]
        if any(wants):  # a head on the target's features: its rows' features
            f = self.model.features(ids, **kwargs)[0]
            for s, a, rows, want in zip(seqs, past, f.split(counts), wants):
                if want:
                    s.proposer.take_features(a, rows)
            logits = self.model.lm_head(f)
        else:
            logits = self.model(ids, **kwargs)[0]  # (sum counts, vocab)
        ends = upload(counts, device).cumsum(0) - 1  # queued behind the pass, not waited for
        return logits if every_row else logits[ends]

    def prefill(self, prompts: list[Sequence], step: int,
                decoding: list[Sequence] | None = None) -> dict[Sequence, list[int]]:
        """ONE packed pass over each prompt's next `s.chunk` tokens, after (chunked
        prefill) the `decoding` rows' newest tokens. A prompt gets a token if its prefill
        ends."""
        chunked, decoding = decoding is not None, decoding or []
        rows, firsts = decoding + prompts, [s.table.length for s in prompts]
        if not rows:
            return {}
        logits = self.packed(rows, [(s.tokens + s.proposals)[-1:] for s in decoding]
                             + [s.tokens[s.table.length:][:s.chunk] for s in prompts])
        tokens = chosen(rows, logits)  # a prompt still prefilling drops its own
        out = {s: [self.decoded(s, row, step, len(rows), 1, token)]
               for s, row, token in zip(decoding, logits, tokens)}
        for s, first, token in zip(prompts, firsts, tokens[len(decoding):]):
            if chunked:
                s.stats.prefill_chunks += 1
            out[s] = [] if s.prefilling else [token]
            self.prefilled(s, step, first, len(rows), (out[s] or [None])[0])
        return out

    def decode(self, batch: list[Sequence], step: int) -> dict[Sequence, list[int]]:
        """One batched pass: each row feeds its newest token (a replayed request's newest
        proposal) and gets its next, attention read through the block tables."""
        if not batch:
            return {}
        for s in batch:
            self.pool.reserve(s.table, 1)
        tables, fed = [s.table for s in batch], [(s.tokens + s.proposals)[-1] for s in batch]
        graphs = self.graphs is not None and self.graphs.fits(tables)  # static.py: replayed
        logits, splits = (self.graphs(tables, fed), 1) if graphs else self.split_kv(batch, fed)
        tokens = chosen(batch, logits)  # every row's token: ONE read-back, not B
        return {s: [self.decoded(s, row, step, len(batch), splits, token)]
                for s, row, token in zip(batch, logits, tokens)}

    def split_kv(self, batch: list[Sequence], fed: list[int]) -> tuple[torch.Tensor, int]:
        """The decode pass eagerly: logits (B, vocab), split-KV as sized to the batch."""
        cache, device = PagedBatch(self.pool, [s.table for s in batch]), self.model.device
        ends = [len(s.tokens) + len(s.proposals) for s in batch]  # each row's new length
        tables = cache.block_tables()  # whole tiles of keys per split, as a kernel reads
        splits = num_kv_splits(len(batch), self.model.config.kv_shape[0], max(ends))
        splits = splits_of(tables.size(1), self.pool.page_size, splits)[2]
        lengths = torch.tensor(ends, device=device)
        real = [(b, j) for b, s in enumerate(batch) for j in range(len(s.table.blocks))]
        attention = partial(paged_attention, tables=tables, lengths=lengths, n_splits=splits,
                            real=tuple(torch.tensor(real, device=device).T))  # no read-back
        ids = torch.tensor(fed, device=device)[:, None]
        logits = self.model(ids, cache=cache, positions=(lengths - 1)[:, None],
                            last_only=True, attention=attention)[:, -1]
        return logits, splits

    def speculate(self, batch: list[Sequence], step: int) -> dict[Sequence, list[int]]:
        """Every row proposes up to γ tokens (a tree γ deep), ONE packed pass scores them
        all, and each commits its matching prefix (a tree's path) and the target's token,
        its table and its proposer's caches rolled back behind them: ragged, each keeps
        what it earned."""
        if not batch:
            return {}
        # 1. Each row proposes, with its own proposer.
        proposals = []
        for s in batch:
            left = s.request.max_new_tokens - len(s.new_tokens) - 1  # the target adds one
            k = min(self.speculation.gamma, left)
            proposal = as_proposal(s.proposer(s.tokens, k), k, s.proposer.max_tokens(k))
            proposals.append(proposal)
        # 2. ONE pass over every row's last token and proposals.
        inputs = [s.tokens[-1:] + p.tokens for s, p in zip(batch, proposals)]
        trees = [p.parents for p in proposals]
        logits = self.packed(batch, inputs, every_row=True, trees=trees)
        # 3. Each row: judge, commit, roll back its table and its proposer's caches.
        out = {}
        for s, p, rows in zip(batch, proposals, logits.split([len(x) for x in inputs])):
            seq = list(s.tokens)
            accept = partial(accept_matching, sampling=s.sampling,
                             first_position=len(seq), parents=p.parents)
            caches = {"verifier": PagedCache(self.pool, [s.table]), **s.proposer.caches}
            rnd = commit_round(seq, p.tokens, rows, accept, caches, start=len(seq) - 1,
                               replayed=len(rows), parents=p.parents)
            s.stats.record(rnd)
            s.stats.fast_steps += 1
            s.events += [replace(e, batch=len(batch)) if e.kind == "verify" else e
                         for e in round_events(step, rnd, len(seq))]
            out[s] = seq[len(s.tokens):]
        return out

    # --- what a row did, for the trace ------------------------------------------------
    def decoded(self, s: Sequence, row: torch.Tensor, step: int, batch: int,
                splits: int, token: int) -> int:
        """A decode row's event; its token, chosen already (chosen)."""
        fed = s.tokens + s.proposals
        s.stats.fast_steps += 1
        if self.record_logits:
            s.fast_logits.append(row.clone())
        s.events.append(TraceEvent(
            kind="decode", step=step, input_ids=(fed[-1],), positions=(len(fed) - 1,),
            token=token, cache_len_before=len(fed) - 1, cache_len_after=len(fed),
            kv_computed=1, batch=batch, n_splits=splits, unverified=s.replay))
        return token

    def prefilled(self, s: Sequence, step: int, first: int, batch: int, token) -> None:
        """The event of a pass over `s`'s positions from `first` on: its prompt, a chunk
        of it, or a preempted request's tokens; the token it gave."""
        fed = s.tokens[:s.table.length]
        kind = ("chunk" if s.prefilling else
                "prefill" if len(fed) == len(s.prompt) else "recompute")
        s.events.append(TraceEvent(
            kind=kind, step=step, input_ids=tuple(fed), token=token, batch=batch,
            positions=tuple(range(first, len(fed))), cache_len_before=first,
            cache_len_after=len(fed), kv_computed=len(fed) - first))


def chosen(seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
    """Each row's token, as its request chooses at its next position, read back at once."""
    return choose_rows([s.sampling for s in seqs], logits,
                       [len(s.tokens) + len(s.proposals) for s in seqs])


# --- checks: raise before anything is allocated ------------------------------------
def _check_settings(model, num_blocks, replay_window, page_size, max_running, prefix_caching,
                    **flags) -> None:
    """serve()'s and Engine's numbers and flags, before anything is allocated."""
    check_model("model", model)
    int_at_least("num_blocks", num_blocks, hint=" (blocks in the pool)")
    int_at_least("replay_window", replay_window, hint=" (positions replayed per pass)")
    check_room(replay_window + 1, model.config.block_size, "a replay window", "replay_window")
    int_at_least("page_size", page_size, hint=" (positions per pool block)")
    if max_running is not None:
        int_at_least("max_running", max_running, hint=" (requests running at once)")
    check_flags(**flags)
    check_prefix_caching(prefix_caching)
