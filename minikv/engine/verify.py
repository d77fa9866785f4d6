"""Verify and roll back: the one core of speculative decoding and deterministic requests.
Someone cheap proposes tokens (a draft model, or a fast batched pass); an authority (the
target, or a batch-invariant replay) scores them all in ONE pass; an accept rule keeps a
prefix of them, then the authority's own token (a correction, or a bonus after the last
proposal); and every KV cache is cropped back to the last committed token."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from .cache import KVCache
from .records import TraceEvent
from .sampling import SamplingParams


@dataclass(frozen=True)
class Verdict:
    accepted: int  # leading proposals the authority agrees with
    token: int     # the authority's token right after them: a correction, or the bonus


# --- accept rules: (logits of the proposed positions + 1, proposals) -> Verdict ----------------
def accept_matching(logits: torch.Tensor, proposals: list[int], sampling: SamplingParams,
                    first_position: int) -> Verdict:
    """Keep proposals while each equals the authority's own choice at its position: its argmax
    when greedy, or its seeded draw (`SamplingParams.choose`). Row i of `logits` (γ + 1, vocab)
    scores the position of proposal i; the last row gives the bonus."""
    for i, proposed in enumerate(proposals):
        mine = sampling.choose(logits[i], first_position + i)
        if mine != proposed:
            return Verdict(i, mine)
    n = len(proposals)
    return Verdict(n, sampling.choose(logits[n], first_position + n))


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)): what the target still wants after the draft's proposal was refused."""
    residual = (p - q).clamp(min=0)
    return residual / residual.sum()


def accept_by_rejection_sampling(logits: torch.Tensor, proposals: list[int],
                                 draft_probs: torch.Tensor, sampling: SamplingParams,
                                 generator: torch.Generator) -> Verdict:
    """Speculative sampling (Leviathan et al. 2023): the committed tokens follow the target's
    distribution p exactly, whatever the draft's q. Accept proposal x with probability
    min(1, p(x) / q(x)); on the first refusal draw from norm(max(0, p - q)); after γ acceptances
    draw the bonus token from p."""
    p = sampling.probabilities(logits)  # (γ + 1, vocab)
    u = torch.rand(len(proposals), generator=generator, device=p.device)
    for i, x in enumerate(proposals):
        if u[i] * draft_probs[i, x] >= p[i, x]:  # u >= p/q, without dividing by zero: refused
            residual = residual_distribution(p[i], draft_probs[i])
            return Verdict(i, int(torch.multinomial(residual, 1, generator=generator)))
    return Verdict(len(proposals), int(torch.multinomial(p[-1], 1, generator=generator)))


# --- the core ----------------------------------------------------------------------------------
# (rows of token ids, cache) -> logits (len(rows), vocab): the authority's single pass.
Verifier = Callable[[list[int], KVCache], torch.Tensor]
# (logits, proposals) -> Verdict: an accept rule with its other arguments bound.
AcceptRule = Callable[[torch.Tensor, list[int]], Verdict]


@dataclass
class Round:
    """What one verification did, for stats and traces."""
    start: int                  # position of the first row the authority replayed
    replayed: int               # rows in the authority's pass (K/V vectors it computed per layer)
    proposals: list[int]
    verdict: Verdict
    cache_lens: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> before, after

    @property
    def rolled_back(self) -> bool:
        return any(before > after for before, after in self.cache_lens.values())


def verify_and_commit(sequence: list[int], proposals: list[int], cache: KVCache,
                      verifier: Verifier, accept: AcceptRule, *, start: int | None = None,
                      rows: int | None = None, pad_id: int = 0,
                      other_caches: dict[str, KVCache] | None = None) -> Round:
    """Verify `proposals` (for the positions after `sequence`), commit into `sequence`, roll the
    caches back. The last token of `sequence` is committed but not yet in `cache`; the authority
    replays positions `start` (default: that token) to the last proposal in one pass, padded to
    `rows` rows when a fixed shape is wanted."""
    start = len(sequence) - 1 if start is None else start
    inputs = sequence[start:] + proposals
    if rows is not None and len(inputs) > rows:
        raise ValueError(f"{len(inputs)} rows to verify exceed the fixed window of {rows}")
    # 1. Crop the authority's cache to `start`, so every entry its pass writes is its own.
    cache.crop(min(cache.get_seq_length(), start))
    # 2. ONE pass over the replayed rows; padding rows only fix the pass's shape, then go.
    padded = inputs + [pad_id] * ((rows or len(inputs)) - len(inputs))
    logits = verifier(padded, cache)
    cache.crop(start + len(inputs))
    # 3. Judge: row `first` is the output at the last committed token, which scores proposal 1.
    first = len(sequence) - 1 - start
    verdict = accept(logits[first:len(inputs)], proposals)
    # 4. Commit the accepted proposals and the authority's own token.
    sequence.extend(proposals[:verdict.accepted] + [verdict.token])
    # 5. Roll back: keep K/V up to the last committed token (it is fed next round), not beyond.
    lens = {}
    for name, c in {"verifier": cache, **(other_caches or {})}.items():
        before = c.get_seq_length()
        c.crop(min(before, len(sequence) - 1))
        lens[name] = (before, c.get_seq_length())
    return Round(start=start, replayed=len(padded), proposals=list(proposals), verdict=verdict,
                 cache_lens=lens)


def round_events(step: int, rnd: Round, sequence_len: int) -> list[TraceEvent]:
    """A round as trace events: verify, rollback (when a cache shrank), commit."""
    first = sequence_len - rnd.verdict.accepted - 1  # position of the first proposal
    n_ok, n = rnd.verdict.accepted, len(rnd.proposals)
    rejected = tuple(range(first + n_ok, first + n))
    lens = dict(rnd.cache_lens)
    before, after = lens["verifier"]
    events = [TraceEvent(
        kind="verify", step=step, input_ids=tuple(rnd.proposals), token=rnd.verdict.token,
        positions=tuple(range(first, first + n)), cache_len_before=rnd.start,
        cache_len_after=before, kv_computed=rnd.replayed,
        accepted=tuple(range(first, first + n_ok)), rejected=rejected)]
    if rnd.rolled_back:
        events.append(TraceEvent(kind="rollback", step=step, positions=rejected, caches=lens,
                                 cache_len_before=before, cache_len_after=after))
    events.append(TraceEvent(
        kind="commit", step=step, input_ids=tuple(rnd.proposals[:n_ok]) + (rnd.verdict.token,),
        positions=tuple(range(first, sequence_len)), cache_len_before=after,
        cache_len_after=after, token=rnd.verdict.token, rolled_back=rnd.rolled_back,
        sequence_len=sequence_len))
    return events
