"""Chapter 03's checkers accept the solutions (and other right ways), let the stubs' error through,
and reject every plausible wrong answer with a hint that names the mistake, quickly."""
import re

import numpy as np
import pytest
import torch

import minikv
from minikv.course.checks import CheckFailed, ch03

from conftest import stub


@pytest.fixture(autouse=True)
def one_thread():
    """On a busy 2-core machine, two threads per process oversubscribe and crawl."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def suffix_of(question):
    return question.question(0)[len(question.prefix(0)):]


def word(tok, logits):
    return tok.decode([int(logits[0, -1].argmax())]).strip()


def t(ids):
    return torch.tensor([ids])


# --- exercise 1: clause_cuts ---------------------------------------------------------------------
def clause_cuts(tok, question):
    cuts = []
    for i in range(len(question.steps) + 1):
        cuts.append(len(tok.encode(question.prefix(i))))
    return cuts


def clause_cuts_walk(tok, question):
    """Also right: encode the prompt once, walk its tokens until the text reaches each clause.
    In bytes: a name's character may span several tokens, and one of them alone is no text."""
    ids, cuts, text = tok.encode(question.prompt()), [], b""
    ends = [len(question.prefix(i).encode()) for i in range(len(question.steps) + 1)]
    for k, token in enumerate(ids):
        text += tok.decode_single_token_bytes(token)
        if len(text) in ends and len(cuts) < len(ends):
            cuts.append(k + 1)
    return np.array(cuts)  # a numpy array of ints is a list of ints


def clause_cuts_chars(tok, question):
    return [len(question.prefix(i)) for i in range(len(question.steps) + 1)]


def clause_cuts_words(tok, question):
    return [len(question.prefix(i).split()) for i in range(len(question.steps) + 1)]


def clause_cuts_last_index(tok, question):  # the position of the clause's last token
    return [c - 1 for c in clause_cuts(tok, question)]


def clause_cuts_with_comma(tok, question):  # the cut after the ',' / '.' that follows
    return [c + 1 for c in clause_cuts(tok, question)]


def clause_cuts_question_form(tok, question):
    return [len(tok.encode(question.question(i))) for i in range(len(question.steps) + 1)]


def clause_cuts_cot(tok, question):
    return [len(tok.encode(question.prefix(i, cot=True))) for i in range(len(question.steps) + 1)]


def clause_cuts_no_start(tok, question):
    return clause_cuts(tok, question)[1:]


def clause_cuts_range_n(tok, question):
    return [len(tok.encode(question.prefix(i))) for i in range(len(question.steps))]


def clause_cuts_clauses_apart(tok, question):  # each clause's tokens, the separators forgotten
    cuts = [len(tok.encode(question.prefix(0)))]
    for who, flips in question.steps:
        cuts.append(cuts[-1] + len(tok.encode(f"{who} flips" if flips else f"{who} doesn't flip")))
    return cuts


def clause_cuts_floats(tok, question):  # e.g. from an average or a division
    return [float(c) for c in clause_cuts(tok, question)]


def clause_cuts_float_array(tok, question):
    return np.array(clause_cuts(tok, question), dtype=float)


def clause_cuts_none(tok, question):
    clause_cuts(tok, question)  # forgot to return


# --- exercise 2: intermediate_answers -------------------------------------------------------------
def intermediate_answers(model, tok, question, cache):
    statement = tok.encode(question.prefix(len(question.steps)))
    suffix = t(tok.encode(suffix_of(question)))
    answers, done = [], 0
    with torch.inference_mode():
        for cut in clause_cuts(tok, question):
            model(t(statement[done:cut]), cache=cache)
            done = cut
            answers.append(word(tok, model(suffix, cache=cache.fork(), last_only=True)))
    return answers


def intermediate_answers_generate(model, tok, question, cache):
    """Also right: the whole statement at once, then fork + crop, generate() with 3 tokens."""
    statement = tok.encode(question.prefix(len(question.steps)))
    minikv.generate(model, statement, 1, cache=cache)
    answers = []
    for cut in clause_cuts(tok, question):
        branch = cache.fork()
        branch.crop(cut)
        out = minikv.generate(model, tok.encode(suffix_of(question)), 3, cache=branch)
        answers.append(tok.decode(out.tokens[:1]).strip())
    return answers


def intermediate_answers_crop_back(model, tok, question, cache):
    """Also right: ask on the cache itself, then crop back to the cut before the next clause."""
    statement = tok.encode(question.prefix(len(question.steps)))
    answers, done = [], 0
    with torch.no_grad():
        for cut in clause_cuts(tok, question):
            model(t(statement[done:cut]), cache=cache)
            done = cut
            answers.append(word(tok, model(t(tok.encode(suffix_of(question))), cache=cache)))
            cache.crop(cut)
    return answers


def intermediate_answers_recomputed(model, tok, question, cache):
    """Right answers, but every question's prefix computed again (the cache filled as well)."""
    with torch.inference_mode():
        model(t(tok.encode(question.prefix(len(question.steps)))), cache=cache)
        return [word(tok, model(t(tok.encode(question.question(i))), last_only=True))
                for i in range(len(question.steps) + 1)]


def intermediate_answers_recomputed_own_cache(model, tok, question, cache):
    """A new cache per question: the given one ignored, the prefix recomputed each time."""
    answers = []
    with torch.inference_mode():
        for cut in clause_cuts(tok, question):
            mine = minikv.KVCache.for_model(model, max_len=200)
            model(t(tok.encode(question.prompt())[:cut]), cache=mine)
            answers.append(word(tok, model(t(tok.encode(suffix_of(question))), cache=mine)))
    return answers


def intermediate_answers_no_fork(model, tok, question, cache):
    """Asks on the main cache: it grows by the suffix, and later clauses follow a question."""
    statement = tok.encode(question.prefix(len(question.steps)))
    answers, done = [], 0
    with torch.inference_mode():
        for cut in clause_cuts(tok, question):
            model(t(statement[done:cut]), cache=cache)
            done = cut
            answers.append(word(tok, model(t(tok.encode(suffix_of(question))), cache=cache)))
    return answers


def intermediate_answers_crop_no_restore(model, tok, question, cache):
    """The statement once, then crop the cache itself to each cut (last first) and ask on it:
    the answers are right, but the cache loses the clauses after the cut and nothing restores
    them."""
    statement = tok.encode(question.prefix(len(question.steps)))
    with torch.inference_mode():
        model(t(statement), cache=cache)
        answers = []
        for cut in reversed(clause_cuts(tok, question)):
            cache.crop(cut)
            answers.append(word(tok, model(t(tok.encode(suffix_of(question))), cache=cache)))
    return answers[::-1]


def intermediate_answers_positions_restart(model, tok, question, cache):
    """Seed 003's bug: each clause fed at positions 0, 1, ... as if it were alone."""
    statement = tok.encode(question.prefix(len(question.steps)))
    answers, done = [], 0
    with torch.inference_mode():
        for cut in clause_cuts(tok, question):
            model(t(statement[done:cut]), cache=cache, positions=torch.arange(cut - done))
            done = cut
            answers.append(word(tok, model(t(tok.encode(suffix_of(question))),
                                           cache=cache.fork())))
    return answers


def intermediate_answers_clause_overlap(model, tok, question, cache):
    """Slices each clause as statement[done - 1:cut]: the previous clause's last token fed
    again."""
    statement = tok.encode(question.prefix(len(question.steps)))
    answers, done = [], 0
    with torch.inference_mode():
        for cut in clause_cuts(tok, question):
            model(t(statement[max(done - 1, 0):cut]), cache=cache)
            done = cut
            answers.append(word(tok, model(t(tok.encode(suffix_of(question))),
                                           cache=cache.fork())))
    return answers


def intermediate_answers_cot(model, tok, question, cache):
    """Forks right, but the statement in the chain-of-thought form."""
    statement = tok.encode(question.prefix(len(question.steps), cot=True))
    answers, done = [], 0
    with torch.inference_mode():
        for i in range(len(question.steps) + 1):
            cut = len(tok.encode(question.prefix(i, cot=True)))
            model(t(statement[done:cut]), cache=cache)
            done = cut
            answers.append(word(tok, model(t(tok.encode(suffix_of(question))),
                                           cache=cache.fork())))
    return answers


def intermediate_answers_first_position(model, tok, question, cache):
    """Reads the answer at the suffix's first position instead of its last."""
    statement = tok.encode(question.prefix(len(question.steps)))
    answers, done = [], 0
    with torch.inference_mode():
        for cut in clause_cuts(tok, question):
            model(t(statement[done:cut]), cache=cache)
            done = cut
            logits = model(t(tok.encode(suffix_of(question))), cache=cache.fork())
            answers.append(tok.decode([int(logits[0, 0].argmax())]).strip())
    return answers


def intermediate_answers_truth(model, tok, question, cache):
    intermediate_answers(model, tok, question, cache)
    return list(question.states)


def intermediate_answers_skip_start(model, tok, question, cache):
    return intermediate_answers(model, tok, question, cache)[1:]


def intermediate_answers_with_space(model, tok, question, cache):  # " tails", not "tails"
    statement = tok.encode(question.prefix(len(question.steps)))
    answers, done = [], 0
    with torch.inference_mode():
        for cut in clause_cuts(tok, question):
            model(t(statement[done:cut]), cache=cache)
            done = cut
            logits = model(t(tok.encode(suffix_of(question))), cache=cache.fork())
            answers.append(tok.decode([int(logits[0, -1].argmax())]))
    return answers


def intermediate_answers_token_ids(model, tok, question, cache):
    statement = tok.encode(question.prefix(len(question.steps)))
    answers, done = [], 0
    with torch.inference_mode():
        for cut in clause_cuts(tok, question):
            model(t(statement[done:cut]), cache=cache)
            done = cut
            logits = model(t(tok.encode(suffix_of(question))), cache=cache.fork())
            answers.append(int(logits[0, -1].argmax()))
    return answers


def intermediate_answers_numpy(model, tok, question, cache):
    return np.array(intermediate_answers(model, tok, question, cache))


# --- exercise 3: shared_prefix_answers ------------------------------------------------------------
def shared_prefix_answers(model, prefix_ids, suffixes, n_new):
    longest = max(len(s) for s in suffixes)
    prefix_cache = minikv.KVCache.for_model(model, max_len=len(prefix_ids) + longest + n_new)
    with torch.inference_mode():
        model(t(prefix_ids), cache=prefix_cache)
        continuations = []
        for suffix in suffixes:
            cache = prefix_cache.fork()
            logits = model(t(suffix), cache=cache, last_only=True)
            tokens = [int(logits[0, -1].argmax())]
            while len(tokens) < n_new:
                tokens.append(int(model(t(tokens[-1:]), cache=cache)[0, -1].argmax()))
            continuations.append(tokens)
    return continuations, prefix_cache


def shared_prefix_answers_generate(model, prefix_ids, suffixes, n_new):
    """Also right: generate() on each fork."""
    prefix_cache = minikv.KVCache.for_model(model, max_len=150)
    with torch.inference_mode():
        model(t(prefix_ids), cache=prefix_cache)
    outs = [minikv.generate(model, s, n_new, cache=prefix_cache.fork()).tokens for s in suffixes]
    return outs, prefix_cache


def shared_prefix_answers_crop(model, prefix_ids, suffixes, n_new):
    """Also right: continue on the prefix's cache itself and roll it back with crop after each
    suffix (the later slots are overwritten, the prefix's are not touched)."""
    cache = minikv.KVCache.for_model(model, max_len=150)
    with torch.inference_mode():
        model(t(prefix_ids), cache=cache)
        outs = []
        for s in suffixes:
            outs.append(minikv.generate(model, s, n_new, cache=cache).tokens)
            cache.crop(len(prefix_ids))
    return outs, cache


def shared_prefix_answers_recomputed(model, prefix_ids, suffixes, n_new):
    """Right tokens, but the prefix computed again for every suffix."""
    prefix_cache = minikv.KVCache.for_model(model, max_len=len(prefix_ids))
    with torch.inference_mode():
        model(t(prefix_ids), cache=prefix_cache)
    return [minikv.generate(model, prefix_ids + s, n_new).tokens for s in suffixes], prefix_cache


def shared_prefix_answers_no_fork(model, prefix_ids, suffixes, n_new):
    """One cache shared by every suffix: each suffix sees the ones before it."""
    cache = minikv.KVCache.for_model(model, max_len=200)
    with torch.inference_mode():
        model(t(prefix_ids), cache=cache)
        return [minikv.generate(model, s, n_new, cache=cache).tokens for s in suffixes], cache


def shared_prefix_answers_no_fork_kept_copy(model, prefix_ids, suffixes, n_new):
    """Shares one cache without forking, but returns a clean copy taken before: the continuations
    are contaminated."""
    cache = minikv.KVCache.for_model(model, max_len=200)
    with torch.inference_mode():
        model(t(prefix_ids), cache=cache)
        clean = cache.fork()
        return [minikv.generate(model, s, n_new, cache=cache).tokens for s in suffixes], clean


def shared_prefix_answers_last_fed(model, prefix_ids, suffixes, n_new):
    """Feeds every new token back, the last one too: one K/V vector per suffix too many."""
    prefix_cache = minikv.KVCache.for_model(model, max_len=200)
    with torch.inference_mode():
        model(t(prefix_ids), cache=prefix_cache)
        continuations = []
        for suffix in suffixes:
            cache, feed, tokens = prefix_cache.fork(), suffix, []
            for _ in range(n_new):
                tokens.append(int(model(t(feed), cache=cache)[0, -1].argmax()))
                feed = tokens[-1:]
            model(t(feed), cache=cache)
            continuations.append(tokens)
    return continuations, prefix_cache


def shared_prefix_answers_prefix_token_by_token(model, prefix_ids, suffixes, n_new):
    """Right K/V count, but the prefix prefilled one token per pass."""
    prefix_cache = minikv.KVCache.for_model(model, max_len=200)
    with torch.inference_mode():
        for token in prefix_ids:
            model(t([token]), cache=prefix_cache)
    outs = [minikv.generate(model, s, n_new, cache=prefix_cache.fork()).tokens for s in suffixes]
    return outs, prefix_cache


def shared_prefix_answers_cache_too_small(model, prefix_ids, suffixes, n_new):
    """Sizes the prefix's cache for the prefix alone: its forks have no room for the rest."""
    prefix_cache = minikv.KVCache.for_model(model, max_len=len(prefix_ids))
    with torch.inference_mode():
        model(t(prefix_ids), cache=prefix_cache)
    outs = [minikv.generate(model, s, n_new, cache=prefix_cache.fork()).tokens for s in suffixes]
    return outs, prefix_cache


def shared_prefix_answers_no_cache_returned(model, prefix_ids, suffixes, n_new):
    return shared_prefix_answers(model, prefix_ids, suffixes, n_new)[0]


def shared_prefix_answers_with_suffix(model, prefix_ids, suffixes, n_new):  # suffix + new tokens
    outs, cache = shared_prefix_answers(model, prefix_ids, suffixes, n_new)
    return [list(s) + o for s, o in zip(suffixes, outs)], cache


def shared_prefix_answers_float_tensor(model, prefix_ids, suffixes, n_new):
    outs, cache = shared_prefix_answers(model, prefix_ids, suffixes, n_new)
    return [torch.tensor(o, dtype=torch.float32) for o in outs], cache


def shared_prefix_answers_first_token_missed(model, prefix_ids, suffixes, n_new):
    """Ignores the suffix pass's token: starts from the token after it."""
    prefix_cache = minikv.KVCache.for_model(model, max_len=200)
    with torch.inference_mode():
        model(t(prefix_ids), cache=prefix_cache)
        outs = []
        for s in suffixes:
            out = minikv.generate(model, s, n_new, cache=prefix_cache.fork()).tokens
            outs.append(out[1:] + out[-1:])
    return outs, prefix_cache


# --- the tests ------------------------------------------------------------------------------------
RIGHT = [
    (ch03.check_clause_cuts, clause_cuts),
    (ch03.check_clause_cuts, clause_cuts_walk),
    (ch03.check_intermediate_answers, intermediate_answers),
    (ch03.check_intermediate_answers, intermediate_answers_generate),
    (ch03.check_intermediate_answers, intermediate_answers_crop_back),
    (ch03.check_shared_prefix_answers, shared_prefix_answers),
    (ch03.check_shared_prefix_answers, shared_prefix_answers_generate),
    (ch03.check_shared_prefix_answers, shared_prefix_answers_crop),
]


@pytest.mark.parametrize("check, right", RIGHT, ids=lambda f: f.__name__)
def test_right_answers_pass(check, right, capsys):
    check(right)
    assert capsys.readouterr().out.startswith("✓")


@pytest.mark.parametrize("check", [ch03.check_clause_cuts, ch03.check_intermediate_answers,
                                   ch03.check_shared_prefix_answers], ids=lambda f: f.__name__)
def test_stub_raises_not_implemented(check):
    with pytest.raises(NotImplementedError):
        check(stub)


WRONG = [
    # exercise 1
    (ch03.check_clause_cuts, clause_cuts_chars, "character counts"),
    (ch03.check_clause_cuts, clause_cuts_words, "word counts"),
    (ch03.check_clause_cuts, clause_cuts_last_index, "positions of each clause's last token"),
    (ch03.check_clause_cuts, clause_cuts_with_comma, "counted the token after the clause"),
    (ch03.check_clause_cuts, clause_cuts_question_form, "lengths of the whole questions"),
    (ch03.check_clause_cuts, clause_cuts_cot, "chain-of-thought"),
    (ch03.check_clause_cuts, clause_cuts_no_start, "index 0 is the cut after the start"),
    (ch03.check_clause_cuts, clause_cuts_range_n, "the last cut is after the last person"),
    (ch03.check_clause_cuts, clause_cuts_clauses_apart, "not the separators"),
    (ch03.check_clause_cuts, clause_cuts_floats, "6.0 is not 6"),
    (ch03.check_clause_cuts, clause_cuts_float_array, "6.0 is not 6"),
    (ch03.check_clause_cuts, clause_cuts_none, "forget to return"),
    # exercise 2
    (ch03.check_intermediate_answers, intermediate_answers_recomputed,
     "recomputing the prefix for every question"),
    (ch03.check_intermediate_answers, intermediate_answers_recomputed_own_cache,
     "recomputing the prefix for every question"),
    (ch03.check_intermediate_answers, intermediate_answers_no_fork, "you forgot to fork"),
    (ch03.check_intermediate_answers, intermediate_answers_crop_no_restore,
     "cropped back to a cut"),
    (ch03.check_intermediate_answers, intermediate_answers_positions_restart,
     "seed 003's position bug"),
    (ch03.check_intermediate_answers, intermediate_answers_clause_overlap,
     "fed one token too many"),
    (ch03.check_intermediate_answers, intermediate_answers_cot, "chain-of-thought"),
    (ch03.check_intermediate_answers, intermediate_answers_first_position,
     "the argmax of the LAST position's logits"),
    (ch03.check_intermediate_answers, intermediate_answers_truth, "true states S_i"),
    (ch03.check_intermediate_answers, intermediate_answers_skip_start, "you left out i = 0"),
    (ch03.check_intermediate_answers, intermediate_answers_with_space, "leading space"),
    (ch03.check_intermediate_answers, intermediate_answers_token_ids, "not a token id"),
    (ch03.check_intermediate_answers, intermediate_answers_numpy, "not a ndarray"),
    # exercise 3
    (ch03.check_shared_prefix_answers, shared_prefix_answers_recomputed,
     "recomputing the prefix for every suffix"),
    (ch03.check_shared_prefix_answers, shared_prefix_answers_no_fork,
     "sharing one cache without forking"),
    (ch03.check_shared_prefix_answers, shared_prefix_answers_no_fork_kept_copy,
     "contaminated"),
    (ch03.check_shared_prefix_answers, shared_prefix_answers_last_fed,
     "fed the last new token back"),
    (ch03.check_shared_prefix_answers, shared_prefix_answers_prefix_token_by_token,
     "not prefilled in one pass"),
    (ch03.check_shared_prefix_answers, shared_prefix_answers_cache_too_small,
     "a fork has the max_len of the cache it copies"),
    (ch03.check_shared_prefix_answers, shared_prefix_answers_no_cache_returned,
     "AND the prefix's KVCache"),
    (ch03.check_shared_prefix_answers, shared_prefix_answers_with_suffix,
     "without the suffix"),
    (ch03.check_shared_prefix_answers, shared_prefix_answers_float_tensor, "list of int"),
    (ch03.check_shared_prefix_answers, shared_prefix_answers_first_token_missed,
     "the first new token is the argmax of the suffix's last position"),
]


@pytest.mark.parametrize("check, wrong, mistake", WRONG, ids=lambda f: getattr(f, "__name__", ""))
def test_wrong_answer_is_named(check, wrong, mistake):
    with pytest.raises(CheckFailed, match="hint: .*" + re.escape(mistake)):
        check(wrong)


def test_checkers_leave_the_random_state_alone():
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    ch03.check_intermediate_answers(intermediate_answers)
    ch03.check_shared_prefix_answers(shared_prefix_answers)
    assert torch.equal(torch.random.get_rng_state(), before)


def test_a_patched_checker_does_not_silence_the_check_cell():
    """An exercise cell that replaces the checker's function changes nothing: the check cell runs a
    fresh copy loaded from the package's file."""
    from minikv.course import checks
    original = ch03.check_clause_cuts
    ch03.check_clause_cuts = lambda fn: print("✓ clause_cuts: all 99 cases pass")
    try:
        with pytest.raises(CheckFailed, match="character counts"):
            checks.fresh("ch03").check_clause_cuts(clause_cuts_chars)
    finally:
        ch03.check_clause_cuts = original
