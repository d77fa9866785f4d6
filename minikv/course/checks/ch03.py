"""Checkers for chapter 03 (seed 000, the KV cache inside reasoning: coin flips). Expectations are
measured at run time: cuts by the tokenizer, answers asked from scratch, K/V work by KVCounter,
passes by PassCounter, caches against a one-pass prefill; on the shipped models and random ones.
Exercises: clause_cuts (a table), intermediate_answers (one cache, rolled back),
shared_prefix_answers (forks), predict_differing_slots, FixedForkCache, choose_fork_plan."""
from __future__ import annotations

import random

import torch

from ...engine import GPT, KVCache, KVCounter, generate
from ..checkpoint import load_course_model
from ..corpus import CoinFlip, coin_flip_eval
from ..tokenizer import load_tokenizer
from . import (
    CheckFailed,
    EngineCalled,
    Exercise,
    PassCounter,
    Refused,
    as_int,
    call,
    call_hinted,
    expect,
    fail,
    forbid,
    guarded,
    int_list,
    kind,
    passed,
    prediction,
    tiny_model,
)

NEAR_TIE = 1e-3  # top-two logits closer than this: either token is accepted (kernels' rounding)
_RNG = random.Random(31)
QUESTIONS = coin_flip_eval(2, seed=30) + [  # held out, 1 to 8 people (two each); nobody; long names
    CoinFlip("tails", ()), CoinFlip("tails", (("Maximilian", True), ("Anastasia-Rose", False),
                                              ("Bo", True))),
    CoinFlip("heads", tuple((name, _RNG.random() < 0.5) for name in (
        "Wilhelmina", "Xiomara", "Oluwaseun", "Jean-Baptiste", "Siobhan")))]


def _promise(tok, q: CoinFlip) -> tuple[list[int], list[int], list[int]]:
    """(statement, cuts, suffix) tokens, once clauses end on token boundaries (the corpus's job)."""
    n = len(q.steps)
    statement, suffix = tok.encode(q.prefix(n)), tok.encode(q.question(0)[len(q.prefix(0)):])
    cuts = [len(tok.encode(q.prefix(i))) for i in range(n + 1)]
    for i, cut in enumerate(cuts):
        if (statement[:cut] != tok.encode(q.prefix(i))
                or tok.encode(q.question(i)) != statement[:cut] + suffix):
            raise RuntimeError(f"the corpus broke chapter 03's promise: {q.prefix(i)!r} does not "
                               f"end on a token boundary of {q.prompt()!r}")
    return statement, cuts, suffix


# --- exercise 1: where the states live ----------------------------------------------------------

_Q = {q.prompt(): q for q in QUESTIONS[:3] + [CoinFlip("tails", (
    ("Emma Blackman", True), ("Mr. Papas", False), ("Bo", True)))] + QUESTIONS[3:]}


def clause_cuts(tok, prompt) -> list[int]:
    """[len(tok.encode(question.prefix(i))) for i = 0..n], the chapter's promise checked."""
    return _promise(tok, _Q[prompt])[1]


def _per_cut(length):  # a wrong clause_cuts: length(tok, question, i) for each cut i
    return lambda tok, prompt: [length(tok, _Q[prompt], i)
                                for i in range(len(_Q[prompt].steps) + 1)]


def _cut_list(got, *case) -> list[int]:
    floats = "float" in str(getattr(got, "dtype", "")) or (
        isinstance(got, (list, tuple)) and len(got) > 0 and all(isinstance(v, float) for v in got))
    if int_list(got) is None:
        raise Refused("cache lengths are ints: 6.0 is not 6; count tokens with len(...), an int"
                      if floats else "return a list of ints, one cache length per cut"
                      + ("" if got is None else " (did you forget to return it?)"))
    return int_list(got)


def _cuts_hint(answers) -> str:
    """The first wrong answer explained: a '.' in a name, the count of cuts, where it cuts."""
    (tok, prompt), cuts = next((case, got) for case, got in answers if got != clause_cuts(*case))
    q, want, ids = _Q[prompt], clause_cuts(tok, prompt), tok.encode(prompt)
    n, dotted = len(q.steps), [who for who, _ in q.steps if "." in who]
    hint = ("the cut after person i is the cache's length once the prompt's tokens up to the end "
            "of that clause are in it")
    if dotted:
        hint = (f"a name can contain a '.' ({dotted[0]!r}): a clause ends at ', then ' or at the "
                f"question's '. What's the state?', not at every '.'")
    if len(cuts) != n + 1:
        hint = f"one cut per step: i = 0 (the start sentence) up to n = {n}, so {n + 1} ints"
        if dotted and len(cuts) > n + 1:
            hint += (f"; a name can contain a '.' ({dotted[0]!r}), and it ends no clause: a "
                     f"clause ends at ', then ' or at the question's '. What's the state?'")
    bad = next((i for i, (c, w) in enumerate(zip(cuts, want)) if c != w), None)
    if bad is not None and 0 <= cuts[bad] <= len(ids):
        hint += (f" (your cut {bad} keeps the prompt's first {cuts[bad]} tokens, "
                 f"{tok.decode(ids[:cuts[bad]])!r}; the clause ends at {q.prefix(bad)!r})")
    return hint


CUTS = Exercise(
    "clause_cuts", cases=[(load_tokenizer(), prompt) for prompt in _Q], reference=clause_cuts,
    describe=lambda tok, prompt: (f"{prompt!r} ({len(_Q[prompt].steps)} "
                                  f"{'person' if len(_Q[prompt].steps) == 1 else 'people'})"),
    returns=_cut_list, otherwise=_cuts_hint, mistakes={
        "index 0 is the cut after the start sentence, before anyone: n + 1 cuts":
            lambda tok, prompt: clause_cuts(tok, prompt)[1:],
        "the last cut is after the last person: i runs over 0..n, n + 1 cuts":
            lambda tok, prompt: clause_cuts(tok, prompt)[:-1],
        "these are character counts (len of the text): a cache holds one slot per TOKEN; count "
        "tok.encode(...)": _per_cut(lambda tok, q, i: len(q.prefix(i))),
        "these are word counts: a cache holds one slot per TOKEN, and a word can be several "
        "tokens (\"'s\", long names); count tok.encode(...)":
            _per_cut(lambda tok, q, i: len(q.prefix(i).split())),
        "off by one: these are the positions of each clause's last token; the cache's length "
        "after it is one more": lambda tok, prompt: [c - 1 for c in clause_cuts(tok, prompt)],
        "off by one: you counted the token after the clause (the ',' or '.'), which belongs to "
        "what comes next": lambda tok, prompt: [c + 1 for c in clause_cuts(tok, prompt)],
        "these are the lengths of whole questions, the suffix \". What's the state? A:\" "
        "included: the cut is before the suffix":
            _per_cut(lambda tok, q, i: len(tok.encode(q.question(i)))),
        "you added up each clause's own tokens but not the separators between clauses ('.', "
        "', then')": _per_cut(lambda tok, q, i: len(tok.encode(q.prefix(0))) + sum(
            len(tok.encode(f"{who} flips" if flips else f"{who} doesn't flip"))
            for who, flips in q.steps[:i])),
    })
check_clause_cuts = CUTS.check
EXERCISES = [CUTS]


# --- exercise 2: intermediate answers Z_i, on one cache, rolled back ----------------------------

def _accepted(logits: torch.Tensor) -> list[int]:
    """The greedy token, and the runner-up when it is a near tie."""
    top = logits.topk(2)
    return [int(t) for t in top.indices[: 2 if float(top.values[0] - top.values[1]) < NEAR_TIE
                                        else 1]]


def _prefilled(model: GPT, ids: list[int], max_len: int) -> KVCache:
    cache = KVCache.for_model(model, max_len=max_len)
    model(torch.tensor([ids], device=model.device), cache=cache)
    return cache


def _first_difference(cache: KVCache, reference: KVCache, length: int) -> int | None:
    """The first position (< length) where some layer's key or value differs, else None."""
    same = torch.ones(length, dtype=torch.bool)
    for a, b in zip(cache.keys + cache.values, reference.keys + reference.values):
        close = torch.isclose(a[:, :, :length], b[:, :, :length], atol=1e-4, rtol=1e-4)
        same &= close.all(dim=3).all(dim=1).all(dim=0).cpu()
    return None if bool(same.all()) else int((~same).nonzero()[0])


def _holds(model: GPT, cache: KVCache, ids: list[int], extra: int = 0) -> bool:
    """Does `cache` hold a prefill of `ids`, every layer, K and V (and at most `extra` more)?"""
    return (len(ids) <= cache.get_seq_length() <= len(ids) + extra and len(ids) > 0
            and _first_difference(cache, _prefilled(model, ids, len(ids)), len(ids)) is None)


_NO_COPY = ("every question is asked on the ONE cache you are given: no fork() (it copies the "
            "whole prefix, every layer, as chapter 03 measures) and no second cache. Feed the "
            "question into the cache itself, read the answer, then roll the cache back to the "
            "cut (crop) before the next clause")


@guarded
def check_intermediate_answers(intermediate_answers) -> None:
    """intermediate_answers(model, tok, question, cache) -> the greedy answer after each person
    i = 0..n, asked on the one cache given (no fork, no new cache), left holding the statement."""
    name = "intermediate_answers"
    (target, tok), draft = load_course_model("target", "cpu"), load_course_model("draft", "cpu")[0]
    noise, qs = tiny_model(3, vocab_size=tok.n_vocab), coin_flip_eval(1, seed=32)  # one per n
    cases = [(target, "target", q) for q in (qs[0], qs[2], qs[4], qs[7], *QUESTIONS[-2:-4:-1])]
    cases += [(draft, "draft", qs[5]), (draft, "draft", qs[6]), (noise, "a random model", qs[3]),
              (noise, "a random model", QUESTIONS[-1])]  # answers nowhere near the truth
    with torch.no_grad():
        for model, model_name, q in cases:
            case, n = f"{model_name}, {q.prompt()!r}", len(q.steps)
            statement, cuts, suffix = _promise(tok, q)
            cot = tok.encode(q.prefix(n, cot=True))
            # what each question gives from scratch: the greedy token after "A:", as a word
            accepted = [[tok.decode([t]).strip() for t in _accepted(model(torch.tensor(
                [statement[:cut] + suffix]), last_only=True)[0, -1].float())] for cut in cuts]
            want = [a[0] for a in accepted]
            # room for the statement and one question at a time (two answer tokens fed back)
            cache = KVCache.for_model(model, max_len=min(model.config.block_size,
                                                          len(statement) + len(suffix) + 2))

            def overflow(e: Exception) -> str:
                if "KV cache overflow" not in str(e):
                    return "your function raised on this input"
                if cot != statement and 0 < cache.get_seq_length() and _holds(
                        model, cache, cot[:cache.get_seq_length()]):
                    return ("that is the chain-of-thought statement (prefix(i, cot=True), \"..., "
                            "so it's tails\"): fill the cache with the plain form")
                return ("the cache is full: it has room for the statement and ONE question at a "
                        "time (its suffix and up to two answer tokens). After reading an answer, "
                        "roll the cache back (crop) to the cut before the next clause: the "
                        "question must not stay in it")
            try:
                with KVCounter(model) as counter, forbid(name, KVCache.fork, KVCache.__init__):
                    got = call_hinted(name, case, overflow, intermediate_answers, model, tok, q,
                                      cache)
            except EngineCalled as e:
                raise CheckFailed(f"{name}: wrong for {case}\n  your function called "
                                  f"{e.called}()\n  hint: {_NO_COPY}") from None
            expect(isinstance(got, (list, tuple)), name, case, want, got,
                   "return a list of str, the answer after each step i = 0..n"
                   + (" (did you forget to return it?)" if got is None else
                      f", not a {type(got).__name__}"))
            expect(all(isinstance(a, str) for a in got), name, case, want, got,
                   "each answer is a str: decode the greedy token with tok.decode([token]) and "
                   "strip its leading space (not a token id or a tensor)")
            hint = (f"one answer per cut: i = 0 (the start sentence, before anyone) up to n = {n}, "
                    f"so {n + 1} answers")
            expect(len(got) == n + 1, name, case, want, list(got), "you left out i = 0, the "
                   "answer after the start sentence: " + hint if list(got) == want[1:] else hint)
            _check_kv_work(name, case, model, counter.count, statement, cot, cuts, suffix, cache)
            _check_main_cache(name, case, model, cache, statement, cot, cuts, suffix)
            hint = ("with the cache cut after person i, feed the question's suffix into it and "
                    "decode the greedy token after 'A:' (the argmax of the LAST position's "
                    "logits), stripped of its leading space")
            if list(got) == q.states and want != q.states:
                hint = ("these are the true states S_i (question.states), not the model's answers "
                        "Z_i: ask the model")
            elif [g.strip() for g in got] == want:
                hint = "strip the answer's leading space: ' tails' -> 'tails'"
            expect(all(g in a for g, a in zip(got, accepted)), name, case, want, list(got), hint)
    passed(name, len(cases))


def _check_kv_work(name, case, model, count, statement, cot, cuts, suffix, cache) -> None:
    n_asks, s = len(cuts), len(suffix)
    least = len(statement) + n_asks * s
    most = least + 2 * n_asks  # up to two answer tokens fed back per question
    where = case + " (K/V vectors your function computed, per layer)"
    recomputed = sum(cuts) + n_asks * s
    if least <= count <= most:
        return
    expect(cot == statement or not _holds(model, cache, cot), name, where, f"{least} to {most}",
           count, "this is the work of the chain-of-thought statement (prefix(i, cot=True), "
           "\"..., so it's tails\"): ask in the plain form, question.prefix(i)")
    expect(count <= most, name, where, f"{least} to {most}", count, "too much K/V work"
           + (f", {count} >= {recomputed}, what asking every question from scratch costs"
              if count >= recomputed else "")
           + f": this is recomputing the prefix for every question. Compute each clause's "
             f"K/V once into `cache` ({len(statement)} in all), then per question only the "
             f"{s} suffix tokens, fed into the same cache and rolled back after the answer")
    fail(name, where, f"{least} to {most}", count,
         f"too little K/V work: every clause ({len(statement)} tokens) and, for each of the "
         f"{n_asks} questions, the {s} suffix tokens must go through the model once"
         + (" (the cache you were given is empty: fill it)" if cache.get_seq_length() == 0
            else ""))


def _check_main_cache(name, case, model, cache, statement, cot, cuts, suffix) -> None:
    """The cache given holds the statement, every layer, K and V, and nothing else."""
    S, s, length = len(statement), len(suffix), cache.get_seq_length()
    where = case + " (the cache you were given, after your function returned)"
    want, now = f"{S} positions: the statement's K/V in every layer", f"{length} positions"
    expect(length > 0, name, where, want, "an empty cache",
           "fill the cache you are given (the `cache` argument) with the statement, clause by "
           "clause, asking each question in it and rolling it back after the answer")
    expect(cot == statement or not _holds(model, cache, cot), name, where, want, now,
           "that is the chain-of-thought statement (prefix(i, cot=True), \"..., so it's "
           "tails\"): fill the cache with the plain form, question.prefix(i)")
    overlap = [t for a, b in zip([0] + cuts[:-1], cuts) for t in statement[max(a - 1, 0):b]]
    expect(overlap == statement or not _holds(model, cache, overlap), name, where, want,
           f"{length} positions = {S} + {len(overlap) - S}",
           "each clause after the first was fed one token too many: a slice like "
           "ids[done - 1:cut] feeds the previous clause's last token again. The next clause "
           "starts at ids[done]")
    expect(not any(_holds(model, cache, statement[:c] + suffix, extra=2) for c in cuts[:-1]),
           name, where, want, now,
           "the whole statement went in first, then the cache was cropped back to each cut "
           "and asked there: crop only moves the length back, so the clauses after the cut "
           "are lost (overwritten by the question) and nothing restores them. Ask as you go: "
           "a clause, its question, crop back to the cut, the next clause")
    asked = length - S  # the suffix (and up to two answer tokens) once per question?
    expect(all(asked != len(cuts) * (s + j) for j in range(3)), name, where, want,
           f"{length} positions = {S} + {len(cuts)} x {asked // len(cuts)}",
           f"the question's suffix stayed in the cache, {len(cuts)} times: after reading an "
           f"answer, roll the cache back (crop) to the cut, so the next clause follows the "
           f"last one, not a question")
    expect(abs(length - S) not in (1, len(cuts)), name, where, want, now,  # at one question or all
           "the roll-back is off by one: after a question, crop to the cut itself, the "
           "cache's length before the suffix went in")
    expect(length == S, name, where, want, now,
           "the cache must hold exactly the statement's tokens, prefix(n), once")
    bad = _first_difference(cache, _prefilled(model, statement, S), S)
    if bad is None:
        return
    restarted = KVCache.for_model(model, max_len=S)  # seed 003's bug, clause by clause
    for start, end in zip([0] + cuts[:-1], cuts):
        model(torch.tensor([statement[start:end]], device=model.device), cache=restarted,
              positions=torch.arange(end - start, device=model.device))
    expect(_first_difference(cache, restarted, S) is not None, name, where, want,
           f"different K/V from position {bad} on (in some layer)",
           "each clause was fed at positions starting from 0 again (seed 003's position "
           "bug): with a cache, positions continue from cache.get_seq_length(); let the model "
           "do it (don't pass positions)")
    fail(name, where, want, f"different K/V from position {bad} on (in some layer, key or value)",
         "the right length, but the K/V at these positions are not the statement's: something "
         "was written over them (a question fed after crop(cut) overwrites the slots after the "
         "cut; crop only moves the length back), or they were computed from other tokens. Feed "
         "each clause once, in order, and crop back to the cut after each question")


# --- exercise 3: prefix sharing by hand ---------------------------------------------------------

def _random_ids(seed: int, model: GPT):
    rng = random.Random(seed)
    return lambda k: [rng.randrange(model.config.vocab_size) for _ in range(k)]


_COIN = ("A coin's state is heads. Alice flips, then Bob doesn't flip", ". What's the state? A:",
         ", then Carol flips. What's the state? A:")  # a prefix, two questions


@guarded
def check_shared_prefix_answers(shared_prefix_answers) -> None:
    """shared_prefix_answers(model, prefix_ids, suffixes, n_new) -> (continuations, prefix_cache),
    the prefix prefilled once, each suffix on a fork of its cache, which keeps the prefix only."""
    name = "shared_prefix_answers"
    (target, tok), a, b = load_course_model("target", "cpu"), tiny_model(4), tiny_model(5)
    ids, (coin, *questions) = _random_ids(33, a), (tok.encode(s) for s in _COIN)
    cases = [
        (a, "a random model", ids(12), [ids(3), ids(1), ids(5)], 6),
        (b, "a random model", ids(1), [ids(2), ids(4)], 1),
        (b, "a random model", ids(20), [ids(7)], 4),
        (a, "a random model", ids(6), [ids(2), ids(2), ids(2), ids(3)], 3),
        (target, "target", tok.encode("Once upon a time there was a little fox named Max."),
         [tok.encode(" One day, Max"), tok.encode(" Max liked to"), tok.encode(" It was")], 5),
        (target, "target", coin, questions, 3)]
    with torch.no_grad():
        for model, model_name, prefix, suffixes, n_new in cases:
            case = f"{model_name}, prefix {prefix}, suffixes {suffixes}, n_new={n_new}"
            # the reference: each prefix + suffix generated from scratch, with its logits
            refs = [generate(model, prefix + s, n_new, return_logits=True) for s in suffixes]
            want = [r.tokens for r in refs]
            with KVCounter(model) as counter, PassCounter(model) as passes:
                try:
                    got = call(name, case, shared_prefix_answers, model, list(prefix),
                               [list(s) for s in suffixes], n_new)
                except CheckFailed as e:
                    if "larger cache" not in str(e):  # generate's: the fork is too small
                        raise
                    raise CheckFailed(f"{e}\n  hint: a fork has the max_len of the cache it "
                                      f"copies: make the prefix's cache big enough for the "
                                      f"prefix, the longest suffix and n_new tokens") from None
            expect(isinstance(got, tuple) and len(got) == 2, name, case,
                   "(continuations, prefix_cache)", kind(got),
                   "return a pair: the list of continuations AND the prefix's KVCache "
                   "(return continuations, prefix_cache)" if isinstance(got, (list, tuple))
                   and len(got) == len(want) and all(isinstance(g, (list, tuple, torch.Tensor))
                                                     for g in got) else
                   "return a tuple of two things: (continuations, prefix_cache)")
            rows = got[0] if not isinstance(got[0], torch.Tensor) or got[0].dim() != 2 else [
                *got[0]]
            expect(isinstance(rows, (list, tuple)), name, case, want, got[0],
                   "continuations: a list with one list of token ids per suffix")
            expect(len(rows) == len(suffixes), name, case, want, got[0],
                   f"one continuation per suffix: {len(suffixes)} lists")
            tokens = [int_list(r) for r in rows]
            expect(None not in tokens, name, case, want, got[0],
                   "each continuation is a list of int token ids (not floats, not text)")
            for t, s in zip(tokens, suffixes):
                hint = f"each continuation is exactly the n_new = {n_new} new tokens"
                if len(t) == n_new + len(s) or len(t) == n_new + len(s) + len(prefix):
                    hint += ", without the suffix or the prefix in front"
                elif len(t) == n_new - 1:
                    hint += " (off by one: the first new token comes from the suffix's pass)"
                expect(len(t) == n_new, name, case, want, tokens, hint)
            _check_prefix_work(name, case, counter.count, passes.passes, prefix, suffixes, n_new)
            _check_prefix_cache(name, case, model, got[1], prefix, suffixes, n_new)
            for k, (ref, row) in enumerate(zip(refs, tokens)):
                t = next((t for t, (x, y) in enumerate(zip(ref.tokens, row)) if x != y), None)
                if t is None or row[t] in _accepted(ref.logits[t]):  # a near tie: may differ later
                    continue
                hint = ("greedy decoding on a fork of the prefix's cache: the suffix in one pass, "
                        "then feed each new token; each continuation must equal generating "
                        "prefix + suffix from scratch")
                shared = _prefilled(model, prefix, len(prefix) + sum(len(s) + n_new
                                                                     for s in suffixes))
                if len(suffixes) > 1 and tokens == [generate(model, s, n_new, cache=shared).tokens
                                                    for s in suffixes]:
                    hint = ("these are the tokens you get when every suffix continues on ONE "
                            "shared cache, without forking: suffix 2 then sees suffix 1 and its "
                            "tokens (contaminated). Fork the prefix's cache for each suffix")
                elif row == ref.tokens[1:] + row[-1:] or row[1:] == ref.tokens[:-1]:
                    hint = ("off by one: the first new token is the argmax of the suffix's last "
                            "position; then feed each new token to get the next")
                fail(name, f"{case}, suffix {k}", want[k], row, hint)
    passed(name, len(cases))


def _check_prefix_work(name, case, count, passes, prefix, suffixes, n_new) -> None:
    P, m = len(prefix), len(suffixes)
    right = P + sum(len(s) + n_new - 1 for s in suffixes)
    if count != right:
        if count == right + m:
            hint = (f"off by one per suffix: you fed the last new token back into the model. "
                    f"Its K/V is never used: n_new tokens need the suffix's pass and "
                    f"n_new - 1 = {n_new - 1} decode passes")
        elif count >= right + (m - 1) * P and m > 1 or count == right + P:
            hint = (f"the prefix's K/V were computed more than once: this is recomputing the "
                    f"prefix for every suffix. Prefill the {P} prefix tokens ONCE into a cache, "
                    f"then continue each suffix on prefix_cache.fork()")
        elif count > right:
            hint = "more K/V work than needed: feed each token through the model once"
        else:
            hint = ("too little K/V work: the prefix once, then each suffix and all but the last "
                    "of its new tokens, must each go through the model")
        fail(name, case + " (K/V vectors your function computed, per layer)",
             f"{P} + sum(len(suffix) + n_new - 1) = {right}", count, hint)
    if len(passes) != 1 + m * n_new:
        singles = sum(1 for shape in passes if shape is not None and shape[1] == 1)
        hint = ("one pass for the prefix, then per suffix one pass over the whole suffix and "
                "one pass per further token")
        if P > 1 and (P, ) not in [shape[1:] for shape in passes if shape]:
            hint = (f"the prefix was not prefilled in one pass (no pass fed {P} tokens): feed "
                    f"all of prefix_ids in one model(...) call; " + hint)
        elif singles > m * (n_new - 1):
            hint = "a suffix was fed token by token: feed each suffix in one pass; " + hint
        fail(name, case + " (forward passes)", 1 + m * n_new, len(passes), hint)


def _check_prefix_cache(name, case, model, prefix_cache, prefix, suffixes, n_new) -> None:
    where, P = case + " (the prefix cache you returned)", len(prefix)
    want = f"a KVCache holding the {P} prefix positions, as a prefill leaves them"
    expect(isinstance(prefix_cache, KVCache), name, where, want, kind(prefix_cache),
           "return the KVCache you prefilled with the prefix, second in the pair")
    expect(prefix_cache.n_layer == model.config.n_layer and prefix_cache.batch_size == 1
           and prefix_cache.n_head == model.config.n_head, name, where, want, repr(prefix_cache),
           "a cache for this model, batch size 1")
    length = prefix_cache.get_seq_length()
    grown = [P + sum(len(s) + n_new - 1 for s in suffixes[:k + 1]) for k in range(len(suffixes))]
    expect(length <= P, name, where, want, f"{length} positions",
           "the suffixes and their tokens went into the prefix's own cache"
           + (" (one after the other: sharing one cache without forking)"
              if length in grown or length in [g + k + 1 for k, g in enumerate(grown)] else "")
           + ": continue each suffix on prefix_cache.fork(), so the prefix's cache stays as the "
             "prefill left it, ready for the next request")
    expect(length == P, name, where, want, f"{length} positions",
           "the prefix's cache must still hold the whole prefix")
    bad = _first_difference(prefix_cache, _prefilled(model, prefix, P), P)
    expect(bad is None, name, where, want, f"different K/V from position {bad} on (in some layer)",
           "the right length, but something wrote over the prefix's K/V (a suffix fed after "
           "crop? into a cache that is not a fork?): continue each suffix on "
           "prefix_cache.fork()")


# --- exercise 4: predict, then measure: which slots the start state reaches ---------------------

@guarded
def check_predict_differing_slots(predict_differing_slots) -> None:
    """predict_differing_slots() -> how many (layer, position) slots of the target's cache differ
    between "A coin's state is heads. Alice flips, then Bob flips" and the same from tails."""
    name = "predict_differing_slots"
    got = prediction(name, f"{name}()", predict_differing_slots, GPT.forward, generate,
                     why="a prediction is committed BEFORE the measurement; reason from "
                         "chapter section 4")
    value = as_int(got)
    if value is None:
        fail(name, f"{name}()", "an int (a number of slots)", got,
             "return the number of (layer, position) slots you predict, an int")
    target, tok = load_course_model("target", "cpu")
    with torch.no_grad():
        ids, other = (tok.encode(CoinFlip(s, (("Alice", True), ("Bob", True))).prefix(2))
                      for s in ("heads", "tails"))
        a, b = _prefilled(target, ids, len(ids)), _prefilled(target, other, len(other))
    L, T = target.config.n_layer, len(ids)
    differ = torch.zeros(L, T, dtype=torch.bool)
    for layer in range(L):
        for x, y in ((a.keys[layer], b.keys[layer]), (a.values[layer], b.values[layer])):
            # identical inputs give identical K/V (0.0); a real difference is far above 1e-3
            differ[layer] |= ((x[0, :, :T] - y[0, :, :T]).abs().amax(dim=(0, 2)) > 1e-3)
    want = int(differ.sum())
    start = next(p for p, (s, t) in enumerate(zip(ids, other)) if s != t)
    after = T - start  # the start-state token's slot and every slot after it
    case = (f"the target's caches of {tok.decode(ids)!r} and of the same with 'tails': "
            f"{L} layers x {T} positions, the start state at position {start}")
    if value == want:
        print(f"✓ {name}: as counted, {want} of the {L * T} slots differ: in layer 0 only the "
              f"start-state token's own, from layer 1 up every slot from it on, before it none")
        return
    mistakes = {
        L * after: "layer 0's K/V at a position are computed from that token and its position "
                   "alone (no attention has happened yet): in layer 0, only the start-state "
                   "token's own slot differs",
        L: "one slot per layer? From layer 1 up, every slot after the start state has attended to "
           "it (its K/V come from the previous layer's output, which mixes the earlier slots)",
        after: "that is one layer's worth: from layer 1 up, each layer's K/V are made from the "
               "previous layer's output, which has attended to the start state",
        L * T: "the slots before the start-state token never see it: the causal mask lets a "
               "position attend only to itself and the positions before it, so a prefix's K/V "
               "do not depend on what follows (which is why a cache can be cut and forked)",
        (L - 1) * after: "layer 0's own slot for the start-state token differs too: a different "
                         "token, a different embedding",
        1 + (L - 1) * (after - 1): "from layer 1 up, the start-state token's own slot differs "
                                   "too",
        0: "the two statements differ in one token: its K/V, and what attends to it, differ",
    }
    fail(name, case, want, value,
         mistakes.get(value, "layer 0 sees only each slot's own token; every later layer, every "
                             "slot from the start state on; no slot before it"))


# --- exercise 5: debug a fork that shares its buffers -------------------------------------------

def _serve(model, cache_cls, prefix, suffixes, n_new, turns: bool, seen: dict):
    """Prefix caching on cache_cls's forks, requests one after the other or taking turns (as a
    server's batch), `seen` getting the source and forks. -> (source, forks, tokens)"""
    source = cache_cls.for_model(model, max_len=len(prefix) + max(map(len, suffixes)) + n_new)
    model(torch.tensor([prefix]), cache=source)
    forks, tokens, feeds = [], [[] for _ in suffixes], [list(s) for s in suffixes]
    seen.update(source=source, forks=forks)
    if turns:
        forks += [source.fork() for _ in suffixes]
    for k in ([k for _ in range(n_new) for k in range(len(suffixes))] if turns else
              [k for k in range(len(suffixes)) for _ in range(n_new)]):
        if len(forks) == k:
            forks.append(source.fork())
        tokens[k].append(int(model(torch.tensor([feeds[k]]), cache=forks[k])[0, -1].argmax()))
        feeds[k] = tokens[k][-1:]
    return source, forks, tokens


def _fork_diagnosis(source, forks) -> str:
    """Name what the forks share with their source (or lack), from their tensors."""
    twin = forks[0]
    if twin is source:
        return "fork() returned the cache itself: every request then writes into the same cache"
    if not isinstance(getattr(twin, "keys", None), list):
        return "the fork must be a cache like its source (a KVCache with keys and values)"
    if twin.max_len < source.max_len:
        return ""  # copied, but too small: the overflow says so
    keys, values = (any(x.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()
                        for x, y in zip(mine, theirs))
                    for mine, theirs in ((twin.keys, source.keys), (twin.values, source.values)))
    if twin.keys is source.keys:
        return ("the fork shares its source's lists of buffers: every fork writes its suffix "
                "into the same tensors, at the same slots after the prefix. One request alone "
                "never notices; requests taking turns overwrite each other's keys and values")
    if keys and values:
        return ("the fork has new lists, but of the same tensors: the buffers themselves must be "
                "copied (clone them), or the requests overwrite each other's keys and values")
    if keys or values:
        return (f"the fork copies the {'values' if keys else 'keys'} but shares the "
                f"{'keys' if keys else 'values'}: copy both")
    if twin.get_seq_length() != source.get_seq_length():
        return "the fork must hold the source's live positions: copy its length too"
    return ""


@guarded
def check_fork(FixedForkCache) -> None:
    """FixedForkCache(minikv.KVCache) with its own fork(): requests served one after the other and
    taking turns as from scratch, the source untouched, without the engine's KVCache.fork."""
    name = "FixedForkCache"
    expect(isinstance(FixedForkCache, type) and issubclass(FixedForkCache, KVCache), name,
           "FixedForkCache", "a subclass of the notebook's ForkableCache", kind(FixedForkCache),
           "pass the class itself: class FixedForkCache(ForkableCache)")
    (target, tok), a = load_course_model("target", "cpu"), tiny_model(4)
    ids, (coin, *questions) = _random_ids(34, a), (tok.encode(s) for s in _COIN)
    cases = [
        (a, "a random model, requests one after the other", ids(10), [ids(3), ids(5)], 6, False),
        (a, "a random model, requests taking turns", ids(10), [ids(3), ids(5), ids(2)], 6, True),
        (target, "the course target, two questions taking turns", coin, questions, 3, True)]
    seen: dict = {}

    def crashed(e: Exception) -> str:  # what the forks made so far share or lack, or no room
        if seen.get("forks") and _fork_diagnosis(seen["source"], seen["forks"]):
            return _fork_diagnosis(seen["source"], seen["forks"])
        if "KV cache overflow" in str(e):
            return ("the fork has no room: it holds only the live positions, so the request's "
                    "tokens cannot be appended. A fork keeps the source's capacity (max_len): "
                    "copy whole buffers")
        return "your cache raised on this input"
    with torch.no_grad():
        for model, label, prefix, suffixes, n_new, turns in cases:
            case = f"{label}: prefix {len(prefix)} tokens, suffixes {suffixes}, n_new={n_new}"
            want = [generate(model, prefix + s, n_new, return_logits=True) for s in suffixes]
            seen.clear()
            with forbid(name, KVCache.fork):
                source, forks, tokens = call_hinted(name, case, crashed, _serve, model,
                                                    FixedForkCache, prefix, suffixes, n_new,
                                                    turns, seen)
            for k, (ref, got) in enumerate(zip(want, tokens)):
                bad = next((t for t, (x, y) in enumerate(zip(ref.tokens, got)) if x != y), None)
                if bad is None or got[bad] in _accepted(ref.logits[bad]):
                    continue
                hint = _fork_diagnosis(source, forks) or (
                    "each request must continue on a copy of the prefix's keys and values that "
                    "nothing else writes into")
                fail(name, f"{case}, request {k}", ref.tokens, got, "each request is right when "
                     "decoded alone, wrong when the requests take turns: the forks are not "
                     "independent. " + hint if turns else hint)
            expect(source.get_seq_length() == len(prefix) and _first_difference(
                source, _prefilled(model, prefix, len(prefix)), len(prefix)) is None, name,
                case + " (the source cache afterwards)",
                f"the prefix's {len(prefix)} positions, as prefilled", "changed",
                _fork_diagnosis(source, forks) or "a fork must leave its source alone")
    passed(name, len(cases))


# --- exercise 6: design: requests served at once on forks, in a memory budget --------------------

DOC, QUESTION, ANSWER, FORK_BUDGET = 100, 11, 20, 48 * 2**20


@guarded
def check_choose_fork_plan(choose_fork_plan) -> None:
    """choose_fork_plan() -> (max_len of the document's cache, requests served at once): the
    smallest max_len that holds a request on a fork, and the most requests in 48 MiB, measured."""
    name = "choose_fork_plan"
    got = call(name, f"{name}()", choose_fork_plan)
    pair = int_list(got)
    case = (f"a {DOC}-token document's cache on the course target (float32), requests of a "
            f"{QUESTION}-token question and a {ANSWER}-token answer, each on its own fork, "
            f"{FORK_BUDGET // 2**20} MiB for all caches alive at once")
    if pair is None or len(pair) != 2 or min(pair) < 1:
        fail(name, case, "a pair of positive ints (max_len, requests)", got,
             "return the document cache's max_len and the number of requests at once")
    (max_len, requests), (target, _) = pair, load_course_model("target", "cpu")
    if max_len > target.config.block_size:
        fail(name, case, f"a max_len the target accepts (at most {target.config.block_size})",
             max_len, "the target has 256 positions: a cache cannot be longer")
    try:  # the document prefilled, then one request on a fork of its cache
        with torch.no_grad():
            fork = _prefilled(target, [t % target.config.vocab_size for t in range(DOC)],
                              max_len).fork()
            generate(target, list(range(3, 3 + QUESTION)), ANSWER, cache=fork)
    except ValueError:
        fork = None
    if fork is None:
        hint = ("a request overflows its fork: a fork has the max_len of the cache it copies, so "
                "the document's cache needs room for the document, the question and the answer")
        if max_len < DOC:
            hint = "the document itself does not fit in a cache of that size"
        if max_len == DOC + QUESTION:
            hint += " (the answer's tokens go into the fork too, all but the last)"
        fail(name, case, "a max_len with which a request fits in its fork",
             f"max_len={max_len}: the fork overflows", hint)
    per_cache, alive = fork.allocated_nbytes, requests + 1  # the document's cache and each fork
    used, need = alive * per_cache, DOC + QUESTION + ANSWER - 1  # the last token is never fed
    if used > FORK_BUDGET:
        hint = ("over budget: every fork allocates a whole cache of max_len positions, and the "
                "document's own cache stays alive too")
        if requests * per_cache <= FORK_BUDGET:
            hint = ("over budget: you left out the document's own cache: it stays alive, and "
                    "every fork is a copy of it")
        elif requests * per_cache // 2 <= FORK_BUDGET:
            hint = "over budget: the target's cache is float32, 4 bytes a number"
        fail(name, case, f"at most {FORK_BUDGET:,} bytes",
             f"{alive} caches of {per_cache:,} bytes = {used:,}", hint)
    expect(max_len == need, name, case, "the smallest max_len that fits a request",
           f"max_len={max_len} ({per_cache:,} bytes per cache)", "a request fits, but in fewer "
           "positions too, and every cache alive pays for each position"
           + (": the answer's last token is never fed" if max_len == need + 1 else ""))
    if requests != FORK_BUDGET // per_cache - 1:
        hint = "it fits, but more requests fit too"
        if requests == 48 * 10**6 // per_cache - 1:
            hint += ": 48 MiB is 48 x 2**20 bytes, not 48 x 10**6"
        fail(name, case, "the most requests that fit", f"{requests} requests: {used:,} bytes",
             hint)
    print(f"✓ {name}: max_len {max_len}, {requests} requests: {alive} caches of {per_cache:,} "
          f"bytes, {used / 2**20:.2f} MiB of {FORK_BUDGET // 2**20}")
