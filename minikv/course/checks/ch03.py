"""Chapter 03's checkers (coin flips), measured at run time: cuts by the tokenizer, answers asked
from scratch, K/V work by KVCounter, caches against a one-pass prefill. Hints: hints/ch03.toml."""
from __future__ import annotations

import random

import torch

from ...engine import GPT, KVCache, KVCounter, generate
from .. import checks as ck
from ..checkpoint import load_course_model
from ..corpus import CoinFlip, coin_flip_eval
from ..tokenizer import load_tokenizer

H = ck.hints("ch03")
CUT, ASK, SHARE, SLOTS, FORK, PLAN = (H[k] for k in (
    "clause_cuts", "intermediate_answers", "shared_prefix_answers", "predict_differing_slots",
    "FixedForkCache", "choose_fork_plan"))
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
    if ck.int_list(got) is None:
        floats = "float" in str(getattr(got, "dtype", "")) or (
            isinstance(got, (list, tuple)) and len(got) > 0
            and all(isinstance(v, float) for v in got))
        raise ck.Refused(CUT["floats"] if floats else CUT["not_a_list"]
                         + ("" if got is None else " (did you forget to return it?)"))
    return ck.int_list(got)


def _cuts_hint(answers) -> str:
    """The first wrong answer explained: a '.' in a name, the count of cuts, where it cuts."""
    (tok, prompt), cuts = next((case, got) for case, got in answers if got != clause_cuts(*case))
    q, want, ids = _Q[prompt], clause_cuts(tok, prompt), tok.encode(prompt)
    n, dotted = len(q.steps), [who for who, _ in q.steps if "." in who][:1]
    hint = CUT["dotted"].format(dotted=dotted[0]) if dotted else CUT["otherwise"]
    if len(cuts) != n + 1:
        hint = CUT["count"].format(n=n, n1=n + 1) + (CUT["count_dotted"].format(dotted=dotted[0])
                                                     if dotted and len(cuts) > n + 1 else "")
    bad = next((i for i, (c, w) in enumerate(zip(cuts, want)) if c != w), None)
    if bad is not None and 0 <= cuts[bad] <= len(ids):
        hint += CUT["where"].format(bad=bad, cut=cuts[bad], text=tok.decode(ids[:cuts[bad]]),
                                    clause=q.prefix(bad))
    return hint


CUTS = ck.Exercise(
    "clause_cuts", cases=[(load_tokenizer(), prompt) for prompt in _Q], reference=clause_cuts,
    describe=lambda tok, prompt: (f"{prompt!r} ({len(_Q[prompt].steps)} "
                                  f"{'person' if len(_Q[prompt].steps) == 1 else 'people'})"),
    returns=_cut_list, otherwise=_cuts_hint, mistakes={
        CUT["first_cut"]: lambda tok, prompt: clause_cuts(tok, prompt)[1:],
        CUT["last_cut"]: lambda tok, prompt: clause_cuts(tok, prompt)[:-1],
        CUT["characters"]: _per_cut(lambda tok, q, i: len(q.prefix(i))),
        CUT["words"]: _per_cut(lambda tok, q, i: len(q.prefix(i).split())),
        CUT["last_token"]: lambda tok, prompt: [c - 1 for c in clause_cuts(tok, prompt)],
        CUT["next_token"]: lambda tok, prompt: [c + 1 for c in clause_cuts(tok, prompt)],
        CUT["questions"]: _per_cut(lambda tok, q, i: len(tok.encode(q.question(i)))),
        CUT["separators"]: _per_cut(lambda tok, q, i: len(tok.encode(q.prefix(0))) + sum(
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


def _diverges(ref, row: list[int]) -> bool:
    """Does `row` leave the reference's greedy tokens other than at a near tie?"""
    t = next((t for t, (x, y) in enumerate(zip(ref.tokens, row)) if x != y), None)
    return t is not None and row[t] not in _accepted(ref.logits[t])  # a near tie: may differ later


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


def _differs(model: GPT, cache: KVCache, ids: list[int]) -> int | None:
    """The first position where `cache` is not a prefill of `ids`, else None."""
    return _first_difference(cache, _prefilled(model, ids, len(ids)), len(ids))


def _holds(model: GPT, cache: KVCache, ids: list[int], extra: int = 0) -> bool:
    """Does `cache` hold a prefill of `ids`, every layer, K and V (and at most `extra` more)?"""
    return (len(ids) <= cache.get_seq_length() <= len(ids) + extra and len(ids) > 0
            and _differs(model, cache, ids) is None)


@ck.guarded
def check_intermediate_answers(intermediate_answers) -> None:
    name = "intermediate_answers"
    (target, tok), draft = load_course_model("target", "cpu"), load_course_model("draft", "cpu")[0]
    noise, qs = ck.tiny_model(3, vocab_size=tok.n_vocab), coin_flip_eval(1, seed=32)  # one per n
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
                return ASK["cot_overflow"] if cot != statement and 0 < cache.get_seq_length() \
                    and _holds(model, cache, cot[:cache.get_seq_length()]) else ASK["full"]
            try:
                with KVCounter(model) as counter, ck.forbid(name, KVCache.fork, KVCache.__init__):
                    got = ck.call_hinted(name, case, overflow, intermediate_answers, model, tok, q,
                                         cache)
            except ck.EngineCalled as e:
                raise ck.CheckFailed(f"{name}: wrong for {case}\n  your function called "
                                     f"{e.called}()\n  hint: {ASK['no_copy']}") from None
            ck.expect(isinstance(got, (list, tuple)), name, case, want, got, ASK["not_a_list"] + (
                " (did you forget to return it?)" if got is None else
                f", not a {type(got).__name__}"))
            ck.expect(all(isinstance(a, str) for a in got), name, case, want, got, ASK["not_str"])
            hint = ASK["count"].format(n=n, n1=n + 1)
            ck.expect(len(got) == n + 1, name, case, want, list(got),
                      ASK["no_zero"] + hint if list(got) == want[1:] else hint)
            _check_kv_work(name, case, model, counter.count, statement, cot, cuts, suffix, cache)
            _check_main_cache(name, case, model, cache, statement, cot, cuts, suffix)
            hint = ASK["states"] if list(got) == q.states and want != q.states else \
                ASK["space"] if [g.strip() for g in got] == want else ASK["otherwise"]
            ck.expect(all(g in a for g, a in zip(got, accepted)), name, case, want, list(got), hint)
    ck.passed(name, len(cases))


def _check_kv_work(name, case, model, count, statement, cot, cuts, suffix, cache) -> None:
    asks, s, S = len(cuts), len(suffix), len(statement)
    least, most = S + asks * s, S + asks * s + 2 * asks  # up to two answer tokens fed back each
    where, want = case + " (K/V vectors your function computed, per layer)", f"{least} to {most}"
    if least <= count <= most:
        return
    ck.expect(cot == statement or not _holds(model, cache, cot), name, where, want, count,
              ASK["cot_work"])
    recomputed = sum(cuts) + asks * s
    ck.expect(count <= most, name, where, want, count, ASK["too_much"] + (
        ASK["from_scratch"].format(count=count, recomputed=recomputed) if count >= recomputed
        else "") + ASK["recomputed"].format(S=S, s=s))
    ck.fail(name, where, want, count, ASK["too_little"].format(S=S, asks=asks, s=s)
            + (ASK["empty_too"] if cache.get_seq_length() == 0 else ""))


def _check_main_cache(name, case, model, cache, statement, cot, cuts, suffix) -> None:
    """The cache given holds the statement, every layer, K and V, and nothing else."""
    S, s, length = len(statement), len(suffix), cache.get_seq_length()
    where = case + " (the cache you were given, after your function returned)"
    want, now = f"{S} positions: the statement's K/V in every layer", f"{length} positions"
    ck.expect(length > 0, name, where, want, "an empty cache", ASK["empty"])
    ck.expect(cot == statement or not _holds(model, cache, cot), name, where, want, now,
              ASK["cot_cache"])
    overlap = [t for a, b in zip([0] + cuts[:-1], cuts) for t in statement[max(a - 1, 0):b]]
    ck.expect(overlap == statement or not _holds(model, cache, overlap), name, where, want,
              f"{length} positions = {S} + {len(overlap) - S}", ASK["overlap"])
    ck.expect(not any(_holds(model, cache, statement[:c] + suffix, extra=2) for c in cuts[:-1]),
              name, where, want, now, ASK["cropped_statement"])
    asked = length - S  # the suffix (and up to two answer tokens) once per question?
    ck.expect(all(asked != len(cuts) * (s + j) for j in range(3)), name, where, want,
              f"{length} positions = {S} + {len(cuts)} x {asked // len(cuts)}",
              ASK["suffix_stayed"].format(asks=len(cuts)))
    ck.expect(abs(length - S) not in (1, len(cuts)), name, where, want, now, ASK["roll_back"])
    ck.expect(length == S, name, where, want, now, ASK["length"])
    bad = _differs(model, cache, statement)
    if bad is None:
        return
    restarted = KVCache.for_model(model, max_len=S)  # seed 003's bug, clause by clause
    for start, end in zip([0] + cuts[:-1], cuts):
        model(torch.tensor([statement[start:end]], device=model.device), cache=restarted,
              positions=torch.arange(end - start, device=model.device))
    ck.expect(_first_difference(cache, restarted, S) is not None, name, where, want,
              f"different K/V from position {bad} on (in some layer)", ASK["positions"])
    ck.fail(name, where, want, f"different K/V from position {bad} on (in some layer, key or "
            f"value)", ASK["overwritten"])


# --- exercise 3: prefix sharing by hand ---------------------------------------------------------

def _random_ids(seed: int, model: GPT):
    rng = random.Random(seed)
    return lambda k: [rng.randrange(model.config.vocab_size) for _ in range(k)]


_COIN = ("A coin's state is heads. Alice flips, then Bob doesn't flip", ". What's the state? A:",
         ", then Carol flips. What's the state? A:")  # a prefix, two questions


@ck.guarded
def check_shared_prefix_answers(shared_prefix_answers) -> None:
    name = "shared_prefix_answers"
    (target, tok), a, b = load_course_model("target", "cpu"), ck.tiny_model(4), ck.tiny_model(5)
    ids, (coin, *questions) = _random_ids(33, a), (tok.encode(s) for s in _COIN)
    cases = [
        (a, "a random model", ids(12), [ids(3), ids(1), ids(5)], 6),
        (b, "a random model", ids(1), [ids(2), ids(4)], 1),
        (b, "a random model", ids(20), [ids(7)], 4),
        (a, "a random model", ids(6), [ids(2), ids(2), ids(2), ids(3)], 3),
        (target, "target", tok.encode("Once upon a time there was a little fox named Max."),
         [tok.encode(" One day, Max"), tok.encode(" Max liked to"), tok.encode(" It was")], 5),
        (target, "target", coin, questions, 3)]
    too_small = lambda e: SHARE["too_small"] if "larger cache" in str(e) else (  # noqa: E731
        "your function raised on this input")  # generate's: the fork is too small
    with torch.no_grad():
        for model, model_name, prefix, suffixes, n_new in cases:
            case = f"{model_name}, prefix {prefix}, suffixes {suffixes}, n_new={n_new}"
            # the reference: each prefix + suffix generated from scratch, with its logits
            refs = [generate(model, prefix + s, n_new, return_logits=True) for s in suffixes]
            want = [r.tokens for r in refs]
            with KVCounter(model) as counter, ck.PassCounter(model) as passes:
                got = ck.call_hinted(name, case, too_small, shared_prefix_answers, model,
                                     list(prefix), [list(s) for s in suffixes], n_new)
            ck.expect(isinstance(got, tuple) and len(got) == 2, name, case,
                      "(continuations, prefix_cache)", ck.kind(got), SHARE["no_cache"]
                      if isinstance(got, (list, tuple)) and len(got) == len(want)
                      and all(isinstance(g, (list, tuple, torch.Tensor)) for g in got)
                      else SHARE["not_a_pair"])
            rows = got[0] if not isinstance(got[0], torch.Tensor) or got[0].dim() != 2 else [
                *got[0]]
            ck.expect(isinstance(rows, (list, tuple)), name, case, want, got[0],
                      SHARE["not_a_list"])
            ck.expect(len(rows) == len(suffixes), name, case, want, got[0],
                      SHARE["count"].format(m=len(suffixes)))
            tokens = [ck.int_list(r) for r in rows]
            ck.expect(None not in tokens, name, case, want, got[0], SHARE["not_ints"])
            for t, s in zip(tokens, suffixes):
                more = len(t) - n_new
                ck.expect(more == 0, name, case, want, tokens, SHARE["length"].format(
                    n_new=n_new) + (SHARE["with_suffix"] if more in (len(s), len(s) + len(prefix))
                                    else SHARE["one_short"] if more == -1 else ""))
            _check_prefix_work(name, case, counter.count, passes.passes, prefix, suffixes, n_new)
            _check_prefix_cache(name, case, model, got[1], prefix, suffixes, n_new)
            for k, (ref, row) in enumerate(zip(refs, tokens)):
                if not _diverges(ref, row):
                    continue
                shared = _prefilled(model, prefix, len(prefix) + sum(len(s) + n_new
                                                                     for s in suffixes))
                one_cache = [generate(model, s, n_new, cache=shared).tokens for s in suffixes]
                shifted = row == ref.tokens[1:] + row[-1:] or row[1:] == ref.tokens[:-1]
                ck.fail(name, f"{case}, suffix {k}", want[k], row, SHARE["contaminated"] if len(
                    suffixes) > 1 and tokens == one_cache else SHARE["shifted"] if shifted
                     else SHARE["otherwise"])
    ck.passed(name, len(cases))


def _check_prefix_work(name, case, count, passes, prefix, suffixes, n_new) -> None:
    P, m = len(prefix), len(suffixes)
    right = P + sum(len(s) + n_new - 1 for s in suffixes)
    if count != right:
        ck.fail(name, case + " (K/V vectors your function computed, per layer)",
                f"{P} + sum(len(suffix) + n_new - 1) = {right}", count,
                SHARE["fed_back"].format(n1=n_new - 1) if count == right + m else
                SHARE["recomputed"].format(P=P) if count >= right + (m - 1) * P and m > 1
                or count == right + P else SHARE["too_much"] if count > right else
                SHARE["too_little"])
    if len(passes) != 1 + m * n_new:
        singles = sum(1 for shape in passes if shape is not None and shape[1] == 1)
        ck.fail(name, case + " (forward passes)", 1 + m * n_new, len(passes), (
            SHARE["no_prefill"].format(P=P) if P > 1 and (P, ) not in [
                shape[1:] for shape in passes if shape] else SHARE["token_by_token"]
            if singles > m * (n_new - 1) else "") + SHARE["passes"])


def _check_prefix_cache(name, case, model, prefix_cache, prefix, suffixes, n_new) -> None:
    where, P = case + " (the prefix cache you returned)", len(prefix)
    want = f"a KVCache holding the {P} prefix positions, as a prefill leaves them"
    ck.expect(isinstance(prefix_cache, KVCache), name, where, want, ck.kind(prefix_cache),
              SHARE["not_a_cache"])
    ck.expect(prefix_cache.n_layer == model.config.n_layer and prefix_cache.batch_size == 1
              and prefix_cache.n_head == model.config.n_head, name, where, want, repr(prefix_cache),
              SHARE["other_cache"])
    length = prefix_cache.get_seq_length()
    grown = [P + sum(len(s) + n_new - 1 for s in suffixes[:k + 1]) for k in range(len(suffixes))]
    ck.expect(length <= P, name, where, want, f"{length} positions", SHARE["grown"] + (
        SHARE["one_cache"] if length in grown or length in [g + k + 1 for k, g in enumerate(grown)]
        else "") + SHARE["fork_it"])
    ck.expect(length == P, name, where, want, f"{length} positions", SHARE["shrunk"])
    bad = _differs(model, prefix_cache, prefix)
    ck.expect(bad is None, name, where, want, f"different K/V from position {bad} on (in some "
              f"layer)", SHARE["overwritten"])


# --- exercise 4: predict, then measure: which slots the start state reaches ---------------------

@ck.guarded
def check_predict_differing_slots(predict_differing_slots) -> None:
    name = "predict_differing_slots"
    got = ck.prediction(name, f"{name}()", predict_differing_slots, GPT.forward, generate,
                        why=SLOTS["why"])
    value = ck.as_int(got)
    if value is None:
        ck.fail(name, f"{name}()", "an int (a number of slots)", got, SLOTS["not_an_int"])
    target, tok = load_course_model("target", "cpu")
    with torch.no_grad():
        ids, other = (tok.encode(CoinFlip(s, (("Alice", True), ("Bob", True))).prefix(2))
                      for s in ("heads", "tails"))
        a, b = _prefilled(target, ids, len(ids)), _prefilled(target, other, len(other))
    L, T = target.config.n_layer, len(ids)
    kv = [torch.stack([t[0, :, :T] for t in c.keys + c.values]) for c in (a, b)]  # (2L, h, T, d)
    # identical inputs give identical K/V (0.0); a real difference is far above 1e-3
    want = int(((kv[0] - kv[1]).abs().amax(dim=(1, 3)) > 1e-3).view(2, L, T).any(0).sum())
    start = next(p for p, (s, t) in enumerate(zip(ids, other)) if s != t)
    after = T - start  # the start-state token's slot and every slot after it
    if value == want:
        print(f"✓ {name}: as counted, {want} of the {L * T} slots differ: in layer 0 only the "
              f"start-state token's own, from layer 1 up every slot from it on, before it none")
        return
    mistakes = {L * after: "every_layer_alike", L: "one_per_layer", after: "one_layer",
                L * T: "every_slot", (L - 1) * after: "layer_0",
                1 + (L - 1) * (after - 1): "own_slot", 0: "none"}
    ck.fail(name, f"the target's caches of {tok.decode(ids)!r} and of the same with 'tails': "
            f"{L} layers x {T} positions, the start state at position {start}", want, value,
            SLOTS[mistakes.get(value, "otherwise")])


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
    if twin is source or not isinstance(getattr(twin, "keys", None), list):
        return FORK["itself"] if twin is source else FORK["not_a_cache"]
    if twin.max_len < source.max_len:
        return ""  # copied, but too small: the overflow says so
    keys, values = (any(x.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()
                        for x, y in zip(mine, theirs))
                    for mine, theirs in ((twin.keys, source.keys), (twin.values, source.values)))
    if twin.keys is source.keys or keys and values:
        return FORK["same_lists"] if twin.keys is source.keys else FORK["same_tensors"]
    if keys or values:
        return FORK["half"].format(copied="values" if keys else "keys",
                                   shared="keys" if keys else "values")
    return FORK["length"] if twin.get_seq_length() != source.get_seq_length() else ""


@ck.guarded
def check_fork(FixedForkCache) -> None:
    name = "FixedForkCache"
    ck.expect(isinstance(FixedForkCache, type) and issubclass(FixedForkCache, KVCache), name,
              "FixedForkCache", "a subclass of the notebook's ForkableCache",
              ck.kind(FixedForkCache), FORK["not_a_class"])
    (target, tok), a = load_course_model("target", "cpu"), ck.tiny_model(4)
    ids, (coin, *questions) = _random_ids(34, a), (tok.encode(s) for s in _COIN)
    cases = [
        (a, "a random model, requests one after the other", ids(10), [ids(3), ids(5)], 6, False),
        (a, "a random model, requests taking turns", ids(10), [ids(3), ids(5), ids(2)], 6, True),
        (target, "the course target, two questions taking turns", coin, questions, 3, True)]
    seen: dict = {}

    def crashed(e: Exception) -> str:  # what the forks made so far share or lack, or no room
        if seen.get("forks") and _fork_diagnosis(seen["source"], seen["forks"]):
            return _fork_diagnosis(seen["source"], seen["forks"])
        return FORK["no_room"] if "KV cache overflow" in str(e) else FORK["raised"]
    with torch.no_grad():
        for model, label, prefix, suffixes, n_new, turns in cases:
            case = f"{label}: prefix {len(prefix)} tokens, suffixes {suffixes}, n_new={n_new}"
            want = [generate(model, prefix + s, n_new, return_logits=True) for s in suffixes]
            seen.clear()
            with ck.forbid(name, KVCache.fork):
                source, forks, tokens = ck.call_hinted(name, case, crashed, _serve, model,
                                                       FixedForkCache, prefix, suffixes, n_new,
                                                       turns, seen)
            for k, (ref, got) in enumerate(zip(want, tokens)):
                hint = _fork_diagnosis(source, forks) or FORK["otherwise"]
                ck.expect(not _diverges(ref, got), name, f"{case}, request {k}", ref.tokens, got,
                          FORK["turns"] + hint if turns else hint)
            ck.expect(source.get_seq_length() == len(prefix) and _differs(model, source, prefix)
                      is None, name, case + " (the source cache afterwards)",
                      f"the prefix's {len(prefix)} positions, as prefilled", "changed",
                      _fork_diagnosis(source, forks) or FORK["source"])
    ck.passed(name, len(cases))


# --- exercise 6: design: requests served at once on forks, in a memory budget --------------------

DOC, QUESTION, ANSWER, FORK_BUDGET = 100, 11, 20, 48 * 2**20


@ck.guarded
def check_choose_fork_plan(choose_fork_plan) -> None:
    name = "choose_fork_plan"
    got = ck.call(name, f"{name}()", choose_fork_plan)
    pair = ck.int_list(got)
    case = (f"a {DOC}-token document's cache on the course target (float32), requests of a "
            f"{QUESTION}-token question and a {ANSWER}-token answer, each on its own fork, "
            f"{FORK_BUDGET // 2**20} MiB for all caches alive at once")
    if pair is None or len(pair) != 2 or min(pair) < 1:
        ck.fail(name, case, "a pair of positive ints (max_len, requests)", got, PLAN["not_a_pair"])
    (max_len, requests), (target, _) = pair, load_course_model("target", "cpu")
    if max_len > target.config.block_size:
        ck.fail(name, case, f"a max_len the target accepts (at most {target.config.block_size})",
                max_len, PLAN["too_long"])
    try:  # the document prefilled, then one request on a fork of its cache
        with torch.no_grad():
            fork = _prefilled(target, [t % target.config.vocab_size for t in range(DOC)],
                              max_len).fork()
            generate(target, list(range(3, 3 + QUESTION)), ANSWER, cache=fork)
    except ValueError:
        fork = None
    if fork is None:
        ck.fail(name, case, "a max_len with which a request fits in its fork",
                f"max_len={max_len}: the fork overflows", PLAN["no_document"] if max_len < DOC else
                PLAN["overflow"] + (PLAN["no_answer"] if max_len == DOC + QUESTION else ""))
    per_cache, alive = fork.allocated_nbytes, requests + 1  # the document's cache and each fork
    used, need = alive * per_cache, DOC + QUESTION + ANSWER - 1  # the last token is never fed
    ck.expect(used <= FORK_BUDGET, name, case, f"at most {FORK_BUDGET:,} bytes",
              f"{alive} caches of {per_cache:,} bytes = {used:,}",
              PLAN["document_left_out"] if requests * per_cache <= FORK_BUDGET else
              PLAN["half_precision"] if requests * per_cache // 2 <= FORK_BUDGET else
              PLAN["over_budget"])
    ck.expect(max_len == need, name, case, "the smallest max_len that fits a request",
              f"max_len={max_len} ({per_cache:,} bytes per cache)",
              PLAN["too_roomy"] + (PLAN["last_token"] if max_len == need + 1 else ""))
    ck.expect(requests == FORK_BUDGET // per_cache - 1, name, case, "the most requests that fit",
              f"{requests} requests: {used:,} bytes", PLAN["more_fit"] + (
                  PLAN["megabytes"] if requests == 48 * 10**6 // per_cache - 1 else ""))
    print(f"✓ {name}: max_len {max_len}, {requests} requests: {alive} caches of {per_cache:,} "
          f"bytes, {used / 2**20:.2f} MiB of {FORK_BUDGET // 2**20}")
