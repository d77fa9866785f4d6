"""Eviction by attention score (engine/evict.py) against chapter 07's sinks + window, at equal
budgets, on the coin-flip questions, whose flip clauses say which positions hold the state.

How a question is read (the same for every policy): the prompt but its last token in one pass,
after which the cache evicts down to its budget, then the last token (the ":" of "A:") as a decode
step reading only what was kept; its greedy next token is the answer. Read in one pass, the
answer would come before any eviction, and SnapKV compresses only once its prompt is read, so the
prompt's last token is the first decode step. `streamed=True` feeds every token in a pass of its
own instead, so every query reads only what the policy kept so far (H2O's own evaluation, and
chapter 07's window): SnapKV, whose prompt would then be one token, is left out of it.

Equal budgets: every policy holds `budget` positions per layer once the prompt is read:
- "window": 4 sinks + the last budget - 4 (chapter 07's SinkWindowCache, one row at a time);
- "h2o": budget // 2 heavy hitters + the rest recent (the paper's even split);
- "snapkv": an observation window of the last 6 positions, " What's the state? A" (the question
  the prompt ends with, as SnapKV's window is), + budget - 6 voted, pooled over 5 neighbours
  (the paper's code's kernel).
"full" is the plain cache, for reference.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from ..engine import H2OCache, KVCache, SinkWindowCache, SnapKVCache
from ..engine.evict import ScoredCache
from ..engine.validate import int_at_least, one_of
from . import corpus

POLICIES = ("full", "window", "h2o", "snapkv")
SINKS, OBSERVED, KERNEL = 4, 6, 5


def make_cache(policy: str, model, budget: int | None, batch_size: int = 1):
    """An empty cache of `policy` that keeps `budget` positions per layer (above); "full"
    keeps everything (its budget is None)."""
    if one_of("policy", policy, POLICIES) == "full":
        return KVCache.for_model(model, batch_size)
    int_at_least("budget", budget, OBSERVED + 1 if policy == "snapkv" else SINKS + 1)
    if policy == "window":
        if batch_size != 1:
            raise ValueError("a SinkWindowCache holds one row: read a batch one row at a time")
        return SinkWindowCache.for_model(model, sinks=SINKS, window=budget - SINKS)
    if policy == "h2o":
        return H2OCache.for_model(model, budget // 2, budget - budget // 2, batch_size)
    return SnapKVCache.for_model(model, budget - OBSERVED, OBSERVED, KERNEL, "avg", batch_size)


def through(cache) -> dict:
    """The model's keyword arguments for a pass through `cache`: a cache that evicts by score
    reads the weights its own attention computes."""
    return {"cache": cache, **({"attention": cache.attention}
                               if isinstance(cache, ScoredCache) else {})}


def read(model, ids: torch.Tensor, cache, streamed: bool = False) -> torch.Tensor:
    """The last position's logits (B, vocab) for ids (B, T) read through `cache`: all but the
    last token in one pass, then the last (or, `streamed`, one token per pass)."""
    T = ids.shape[1]
    cuts = list(range(T + 1)) if streamed else [0, T - 1, T]
    with torch.inference_mode():
        for start, end in zip(cuts, cuts[1:]):
            if end > start:  # a one-token question has no prompt before its last token
                logits = model(ids[:, start:end], last_only=True, **through(cache))
    return logits[:, -1]


def answers(model, ids: torch.Tensor, policy: str, budget: int | None,
            streamed: bool = False) -> list[int]:
    """The greedy next token of every row of ids (B, T) read under `policy`."""
    if policy == "window":  # one row per cache
        rows = [read(model, ids[b:b + 1], make_cache(policy, model, budget), streamed)
                for b in range(ids.shape[0])]
        return torch.cat(rows).argmax(-1).tolist()
    cache = make_cache(policy, model, budget, ids.shape[0])
    return read(model, ids, cache, streamed).argmax(-1).tolist()


@torch.no_grad()
def eviction_accuracy(model, tok, budgets=(24, 48), n_per_count: int = 25, seed: int = 0,
                      policies=POLICIES, streamed: bool = False,
                      questions: list[corpus.CoinFlip] | None = None) -> dict:
    """{(policy, budget): {people: accuracy}} on the held-out coin flips (or `questions`), 1..8
    people, each policy at each budget ("full" once, under budget None)."""
    if streamed and "snapkv" in policies:
        raise ValueError("SnapKV compresses its prompt: read with streamed=False")
    for policy in policies:
        one_of("policy", policy, POLICIES)
    if questions is None:
        questions = corpus.coin_flip_eval(n_per_count, seed=seed)
    by_length = defaultdict(list)  # same-length questions are read as one batch
    for q in questions:
        by_length[len(tok.encode(q.prompt()))].append(q)
    runs = [(p, None if p == "full" else b) for p in policies for b in budgets]
    correct = {run: defaultdict(int) for run in dict.fromkeys(runs)}
    total = defaultdict(int)
    for qs in by_length.values():
        ids = torch.tensor([tok.encode(q.prompt()) for q in qs], device=model.device)
        want = [tok.encode(" " + q.answer)[0] for q in qs]
        for q in qs:
            total[len(q.steps)] += 1
        for policy, budget in correct:
            got = answers(model, ids, policy, budget, streamed)
            for q, g, w in zip(qs, got, want):
                correct[policy, budget][len(q.steps)] += g == w
    return {run: {n: c[n] / total[n] for n in sorted(total)} for run, c in correct.items()}


@dataclass
class FlipMarks:
    """Token positions in a coin-flip prompt: the start state's word, each person's clause
    ("Alice flips": name and verb) and each clause's verb alone ("flips", "doesn't flip")."""
    start: list[int]
    clauses: list[list[int]]
    verbs: list[list[int]]


def flip_marks(question: corpus.CoinFlip, tok) -> FlipMarks:
    """Where the state lives in the prompt's tokens, found by bytes (a name's character can
    span several tokens): CoinFlip.prefix(i) ends where person i's clause ends."""
    ends, spans, at = [], [], 0
    for t in tok.encode(question.prompt()):
        at += len(tok.decode_bytes([t]))
        ends.append(at)
    for t, end in enumerate(ends):
        spans.append((ends[t - 1] if t else 0, end))

    def tokens(a: int, b: int) -> list[int]:  # the tokens overlapping bytes [a, b)
        return [t for t, (s, e) in enumerate(spans) if s < b and e > a]
    end = [len(question.prefix(i).encode()) for i in range(len(question.steps) + 1)]
    start = tokens(end[0] - len(question.start), end[0])
    clauses, verbs = [], []
    for i, (_, flips) in enumerate(question.steps, 1):
        opening = len((". " if i == 1 else ", then ").encode())
        clauses.append(tokens(end[i - 1] + opening, end[i]))
        verbs.append(tokens(end[i] - len("flips" if flips else "doesn't flip"), end[i]))
    return FlipMarks(start, clauses, verbs)


@torch.no_grad()
def kept_positions(model, tok, question: corpus.CoinFlip, budget: int,
                   policies=POLICIES) -> dict[str, list[list[int]]]:
    """{policy: the positions each layer holds when the question's last token is read} (the
    prompt but that token read in one pass, then evicted: what `eviction_accuracy` measures)."""
    ids = torch.tensor([tok.encode(question.prompt())[:-1]], device=model.device)
    kept = {}
    for policy in policies:
        cache = make_cache(policy, model, budget)
        model(ids, **through(cache))  # the prompt but its last token: the answer's read next
        if isinstance(cache, ScoredCache):
            kept[policy] = cache.kept()
        else:  # the window keeps the same positions in every layer; the full cache all
            held = getattr(cache, "positions", range(cache.get_seq_length()))
            kept[policy] = [list(held)] * model.config.n_layer
    return kept


def coverage(kept: list[list[int]], positions: list[int]) -> float:
    """The share of (layer, position) pairs a policy keeps, of `positions` in every layer."""
    return sum(p in set(layer) for layer in kept for p in positions) / (len(kept) * len(positions))
