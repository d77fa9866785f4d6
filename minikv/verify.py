"""Verify and roll back: the one loop behind speculative decoding (seed 004) and deterministic requests (seed 001).

Someone cheap proposes tokens (a draft model, or a fast batched pass). An authority (the target model,
or a batch-invariant replay) scores all of them in ONE forward pass. The proposals it agrees with are
committed, then the authority's own token at the first disagreement (or after the last proposal, the
"bonus"), and every KV cache is cropped back to the last committed token. When all match, nothing is
cropped: no rollback.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from .cache import KVCache
from .sampling import probabilities, sample
from .trace import TraceEvent

# (rows of token ids, cache) -> logits (len(rows), vocab): the authority's single pass.
Verifier = Callable[[list[int], KVCache], torch.Tensor]
# (logits for the proposed positions + 1, proposals) -> Verdict
Judge = Callable[[torch.Tensor, list[int]], "Verdict"]


@dataclass(frozen=True)
class Verdict:
    accepted: int  # leading proposals the authority agrees with
    token: int     # the authority's token right after them: a correction, or the bonus when all match


@dataclass
class VerifyStats:
    rounds: int = 0     # verification passes
    proposed: int = 0
    accepted: int = 0
    rejected: int = 0   # proposals thrown away (the first mismatch and everything after it)
    rollbacks: int = 0  # rounds that had to crop a cache

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / max(self.proposed, 1)


def judge_by_match(choose: Callable[[torch.Tensor, int], int], first_position: int) -> Judge:
    """Accept while the authority's own choice equals the proposal (greedy, or seeded per position).

    `choose(logits_row, position)` is how the authority picks the token at `position`.
    """
    def judge(logits: torch.Tensor, proposals: list[int]) -> Verdict:
        for i, proposed in enumerate(proposals):
            mine = choose(logits[i], first_position + i)
            if mine != proposed:
                return Verdict(i, mine)
        return Verdict(len(proposals), choose(logits[len(proposals)], first_position + len(proposals)))
    return judge


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)): what the target still wants after the draft's proposal was turned down."""
    residual = (p - q).clamp(min=0)
    return residual / residual.sum()


def judge_by_rejection(draft_probs: torch.Tensor, temperature: float, top_k: int | None,
                       generator: torch.Generator) -> Judge:
    """Speculative sampling (Leviathan et al. 2023): the committed tokens follow the target's distribution.

    Accept proposal x with probability min(1, p(x) / q(x)); on rejection draw from norm(max(0, p - q));
    after γ acceptances draw the bonus token from p.
    """
    def judge(logits: torch.Tensor, proposals: list[int]) -> Verdict:
        p = probabilities(logits, temperature, top_k)  # (γ + 1, vocab)
        u = torch.rand(len(proposals), generator=generator, device=p.device)
        for i, x in enumerate(proposals):
            if u[i] * draft_probs[i, x] < p[i, x]:  # u < p/q, without dividing by zero
                continue
            return Verdict(i, int(torch.multinomial(residual_distribution(p[i], draft_probs[i]), 1, generator=generator)))
        return Verdict(len(proposals), int(torch.multinomial(p[-1], 1, generator=generator)))
    return judge


def greedy_or_sampled(temperature: float, top_k: int | None, seed: int, device: torch.device) -> Callable[[torch.Tensor, int], int]:
    """The token at a position, as a pure function of (logits, position): argmax, or a draw from a
    generator seeded by (seed, position), so "the same request" gives the same token wherever it runs."""
    def choose(logits: torch.Tensor, position: int) -> int:
        if temperature == 0:
            return int(logits.argmax())
        generator = torch.Generator(device=device).manual_seed(seed * 1_000_003 + position)
        return int(sample(logits, temperature, top_k, generator))
    return choose


@dataclass
class Round:
    """What one verification did, for traces and widgets."""
    start: int                      # position of the first row the authority replayed
    replayed: int                   # rows in the authority's pass (K/V vectors it computed per layer)
    proposals: list[int]
    verdict: Verdict
    cache_lens: dict = field(default_factory=dict)  # name -> (before crop, after crop)

    @property
    def rolled_back(self) -> bool:
        return any(before > after for before, after in self.cache_lens.values())


def verify_and_commit(sequence: list[int], proposals: list[int], cache: KVCache, verifier: Verifier, judge: Judge,
                      *, start: int | None = None, rows: int | None = None, pad_id: int = 0,
                      other_caches: dict[str, KVCache] | None = None) -> Round:
    """Verify `proposals` (for the positions after `sequence`), commit into `sequence`, roll caches back.

    The last token of `sequence` is committed but not yet in `cache`. The authority replays positions
    `start` (default: that last token) up to the last proposal in one pass, padded to `rows` rows when a
    fixed shape is wanted. `cache` is first cropped to `start`, so the entries it rewrites are the
    authority's own, never the proposer's.
    """
    start = len(sequence) - 1 if start is None else start
    inputs = sequence[start:] + proposals
    if rows is not None and len(inputs) > rows:
        raise ValueError(f"{len(inputs)} rows to verify exceed the fixed window of {rows}")
    cache.crop(min(cache.get_seq_length(), start))
    replay = inputs + [pad_id] * ((rows or len(inputs)) - len(inputs))
    logits = verifier(replay, cache)
    cache.crop(start + len(inputs))  # padding rows only fixed the pass's shape: their K/V go at once
    first = len(sequence) - 1 - start  # the row whose output is judged against the first proposal
    verdict = judge(logits[first:len(inputs)], proposals)
    sequence.extend(proposals[:verdict.accepted] + [verdict.token])
    lens = {}
    for name, c in {"verifier": cache, **(other_caches or {})}.items():
        before = c.get_seq_length()
        c.crop(min(before, len(sequence) - 1))  # keep K/V up to the last committed token, not beyond
        lens[name] = (before, c.get_seq_length())
    return Round(start=start, replayed=len(replay), proposals=list(proposals), verdict=verdict, cache_lens=lens)


def round_events(step: int, rnd: Round, sequence_len: int) -> list[TraceEvent]:
    """Trace events of a round: verify (accepted / rejected positions), rollback when a cache shrank, commit."""
    first_pos = sequence_len - rnd.verdict.accepted - 1  # position of the first proposal
    accepted = list(range(first_pos, first_pos + rnd.verdict.accepted))
    rejected = list(range(first_pos + rnd.verdict.accepted, first_pos + len(rnd.proposals)))
    before, after = rnd.cache_lens["verifier"]
    events = [TraceEvent(step=step, kind="verify", input_ids=tuple(rnd.proposals),
                         positions=tuple(range(first_pos, first_pos + len(rnd.proposals))),
                         cache_len_before=rnd.start, cache_len_after=before, kv_computed=rnd.replayed,
                         token=rnd.verdict.token, detail={"accepted": accepted, "rejected": rejected, "replay_start": rnd.start})]
    if rnd.rolled_back:
        events.append(TraceEvent(step=step, kind="rollback", input_ids=(), positions=tuple(rejected),
                                 cache_len_before=before, cache_len_after=after, kv_computed=0,
                                 detail={"caches": dict(rnd.cache_lens)}))
    events.append(TraceEvent(step=step, kind="commit", input_ids=tuple(rnd.proposals[:rnd.verdict.accepted]) +
                             (rnd.verdict.token,), positions=tuple(range(first_pos, sequence_len)),
                             cache_len_before=after, cache_len_after=after, kv_computed=0, token=rnd.verdict.token,
                             detail={"rollback": rnd.rolled_back,
                                     "sequence_len": sequence_len}))
    return events
