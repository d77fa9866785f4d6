"""Chapter 03's checkers accept the solutions (and other right ways), let the stubs' error through,
and reject every plausible wrong answer with a hint that names the mistake, quickly."""
import copy
import re

import numpy as np
import pytest
import torch

import minikv
from minikv.course.checks import CheckFailed, ch03
from minikv.course.corpus import CoinFlip

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
def question_of(prompt):
    """The CoinFlip a plain prompt was written from (so that wrong answers can be written with
    prefix(i), as a student who rebuilt it would)."""
    statement = prompt[:prompt.rindex(". What's the state?")]
    start, _, people = statement.partition(". ")
    steps = []
    for clause in people.split(", then ") if people else []:
        flips = clause.endswith(" flips")
        steps.append((clause.removesuffix(" flips").removesuffix(" doesn't flip"), flips))
    return CoinFlip(start.split()[-1], tuple(steps))


def clause_cuts(tok, prompt):
    statement = prompt[:prompt.rindex(". What's the state?")]
    start, _, people = statement.partition(". ")
    texts = [start]
    for k, clause in enumerate(people.split(", then ") if people else []):
        texts.append(texts[-1] + (". " if k == 0 else ", then ") + clause)
    return [len(tok.encode(text)) for text in texts]


def clause_cuts_walk(tok, prompt):
    """Also right: encode the prompt once, walk its tokens until the text reaches each clause's
    end (found in the text). In bytes: a name's character may span several tokens, and one of
    them alone is no text."""
    question = question_of(prompt)
    ids, cuts, text = tok.encode(prompt), [], b""
    ends = [len(question.prefix(i).encode()) for i in range(len(question.steps) + 1)]
    for k, token in enumerate(ids):
        text += tok.decode_single_token_bytes(token)
        if len(text) in ends and len(cuts) < len(ends):
            cuts.append(k + 1)
    return np.array(cuts)  # a numpy array of ints is a list of ints


def cuts_with(tok, prompt, length):
    question = question_of(prompt)
    return [length(question, i) for i in range(len(question.steps) + 1)]


def clause_cuts_chars(tok, prompt):  # the character offsets of the clause ends
    return cuts_with(tok, prompt, lambda q, i: len(q.prefix(i)))


def clause_cuts_words(tok, prompt):
    return cuts_with(tok, prompt, lambda q, i: len(q.prefix(i).split()))


def clause_cuts_last_index(tok, prompt):  # the position of the clause's last token
    return [c - 1 for c in clause_cuts(tok, prompt)]


def clause_cuts_with_comma(tok, prompt):  # the cut after the ',' / '.' that follows
    return [c + 1 for c in clause_cuts(tok, prompt)]


def clause_cuts_question_form(tok, prompt):
    return cuts_with(tok, prompt, lambda q, i: len(tok.encode(q.question(i))))


def clause_cuts_no_start(tok, prompt):
    return clause_cuts(tok, prompt)[1:]


def clause_cuts_range_n(tok, prompt):
    return clause_cuts(tok, prompt)[:-1]


def clause_cuts_clauses_apart(tok, prompt):  # each clause's tokens, the separators forgotten
    question = question_of(prompt)
    cuts = [len(tok.encode(question.prefix(0)))]
    for who, flips in question.steps:
        cuts.append(cuts[-1] + len(tok.encode(f"{who} flips" if flips else f"{who} doesn't flip")))
    return cuts


def clause_cuts_separator_tokens(tok, prompt):  # every ',' or '.' token ends a clause
    return [k for k, t in enumerate(tok.encode(prompt)) if tok.decode([t]) in (",", ".")]


def clause_cuts_split_on_dots(tok, prompt):  # every '. ' ends a sentence, names' too
    statement = prompt[:prompt.rindex(". What's the state?")]
    parts = [p for chunk in statement.split(". ") for p in chunk.split(", then ")]
    texts, seps = [parts[0]], statement[len(parts[0]):]
    for part in parts[1:]:
        sep = ". " if seps.startswith(". ") else ", then "
        texts.append(texts[-1] + sep + part)
        seps = statement[len(texts[-1]):]
    return [len(tok.encode(text)) for text in texts]


def clause_cuts_floats(tok, prompt):  # e.g. from an average or a division
    return [float(c) for c in clause_cuts(tok, prompt)]


def clause_cuts_float_array(tok, prompt):
    return np.array(clause_cuts(tok, prompt), dtype=float)


def clause_cuts_none(tok, prompt):
    clause_cuts(tok, prompt)  # forgot to return


# --- exercise 2: intermediate_answers, one cache rolled back --------------------------------------
def asked(model, tok, question, cache, feed=None, read=None, roll=None, statement=None,
          cuts=None):
    """The solution's loop with one of its steps swapped for a mistake: feed(ids, done, cut) fills
    a clause, read(logits) decodes the answer, roll(cut, before) rolls the cache back."""
    statement = statement or tok.encode(question.prefix(len(question.steps)))
    cuts = cuts or clause_cuts(tok, question.prompt())
    suffix = t(tok.encode(suffix_of(question)))
    answers, done = [], 0
    with torch.no_grad():
        for cut in cuts:
            if feed:
                feed(statement, done, cut)
            else:
                model(t(statement[done:cut]), cache=cache)
            done = cut
            before = cache.get_seq_length()
            logits = model(suffix, cache=cache)
            answers.append(read(logits) if read else word(tok, logits))
            if roll:
                roll(cut, before)
            else:
                cache.crop(cut)
    return answers


def intermediate_answers(model, tok, question, cache):
    return asked(model, tok, question, cache)


def intermediate_answers_generate(model, tok, question, cache):
    """Also right: generate() with 3 tokens for each question, then crop back to the cut."""
    statement = tok.encode(question.prefix(len(question.steps)))
    answers, done = [], 0
    for cut in clause_cuts(tok, question.prompt()):
        minikv.generate(model, statement[done:cut], 1, cache=cache)
        done = cut
        out = minikv.generate(model, tok.encode(suffix_of(question)), 3, cache=cache)
        answers.append(tok.decode(out.tokens[:1]).strip())
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
        for cut in clause_cuts(tok, question.prompt()):
            mine = minikv.KVCache.for_model(model, max_len=200)
            model(t(tok.encode(question.prompt())[:cut]), cache=mine)
            answers.append(word(tok, model(t(tok.encode(suffix_of(question))), cache=mine)))
    return answers


def intermediate_answers_forked(model, tok, question, cache):
    """The chapter's way: a fork per question (a copy of the whole prefix each time)."""
    statement = tok.encode(question.prefix(len(question.steps)))
    answers, done = [], 0
    with torch.inference_mode():
        for cut in clause_cuts(tok, question.prompt()):
            model(t(statement[done:cut]), cache=cache)
            done = cut
            answers.append(word(tok, model(t(tok.encode(suffix_of(question))),
                                           cache=cache.fork())))
    return answers


def intermediate_answers_no_rollback(model, tok, question, cache):
    """Asks in the cache and never rolls it back: later clauses follow a question."""
    return asked(model, tok, question, cache, roll=lambda cut, before: None)


def intermediate_answers_crop_no_restore(model, tok, question, cache):
    """The statement once, then crop the cache to each cut (last first) and ask there: the answers
    are right, but the cache loses the clauses after the cut and nothing restores them."""
    statement = tok.encode(question.prefix(len(question.steps)))
    with torch.inference_mode():
        model(t(statement), cache=cache)
        answers = []
        for cut in reversed(clause_cuts(tok, question.prompt())):
            cache.crop(cut)
            answers.append(word(tok, model(t(tok.encode(suffix_of(question))), cache=cache)))
    return answers[::-1]


def intermediate_answers_roll_past(model, tok, question, cache):
    """Rolls back to one position after the cut: the suffix's first token stays each time."""
    return asked(model, tok, question, cache, roll=lambda cut, before: cache.crop(before + 1))


def intermediate_answers_positions_restart(model, tok, question, cache):
    """Seed 003's bug: each clause fed at positions 0, 1, ... as if it were alone."""
    def feed(statement, done, cut):
        model(t(statement[done:cut]), cache=cache, positions=torch.arange(cut - done))
    return asked(model, tok, question, cache, feed=feed)


def intermediate_answers_clause_overlap(model, tok, question, cache):
    """Slices each clause as statement[done - 1:cut]: the previous clause's last token fed again
    (and rolls back to the length it had before the question)."""
    def feed(statement, done, cut):
        model(t(statement[max(done - 1, 0):cut]), cache=cache)
    return asked(model, tok, question, cache, feed=feed,
                 roll=lambda cut, before: cache.crop(before))


def intermediate_answers_cot(model, tok, question, cache):
    """Rolled back right, but the statement in the chain-of-thought form."""
    n = len(question.steps)
    return asked(model, tok, question, cache, statement=tok.encode(question.prefix(n, cot=True)),
                 cuts=[len(tok.encode(question.prefix(i, cot=True))) for i in range(n + 1)])


def intermediate_answers_first_position(model, tok, question, cache):
    """Reads the answer at the suffix's first position instead of its last."""
    return asked(model, tok, question, cache,
                 read=lambda logits: tok.decode([int(logits[0, 0].argmax())]).strip())


def intermediate_answers_truth(model, tok, question, cache):
    intermediate_answers(model, tok, question, cache)
    return list(question.states)


def intermediate_answers_skip_start(model, tok, question, cache):
    return intermediate_answers(model, tok, question, cache)[1:]


def intermediate_answers_with_space(model, tok, question, cache):  # " tails", not "tails"
    return asked(model, tok, question, cache,
                 read=lambda logits: tok.decode([int(logits[0, -1].argmax())]))


def intermediate_answers_token_ids(model, tok, question, cache):
    return asked(model, tok, question, cache, read=lambda logits: int(logits[0, -1].argmax()))


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
    (ch03.check_clause_cuts, clause_cuts_question_form, "lengths of whole questions"),
    (ch03.check_clause_cuts, clause_cuts_no_start, "index 0 is the cut after the start"),
    (ch03.check_clause_cuts, clause_cuts_range_n, "the last cut is after the last person"),
    (ch03.check_clause_cuts, clause_cuts_clauses_apart, "not the separators"),
    (ch03.check_clause_cuts, clause_cuts_separator_tokens, "a name can contain a '.'"),
    (ch03.check_clause_cuts, clause_cuts_split_on_dots, "a name can contain a '.'"),
    (ch03.check_clause_cuts, clause_cuts_floats, "6.0 is not 6"),
    (ch03.check_clause_cuts, clause_cuts_float_array, "6.0 is not 6"),
    (ch03.check_clause_cuts, clause_cuts_none, "forget to return"),
    # exercise 2
    (ch03.check_intermediate_answers, intermediate_answers_recomputed,
     "recomputing the prefix for every question"),
    (ch03.check_intermediate_answers, intermediate_answers_recomputed_own_cache,
     "no fork() (it copies the whole prefix"),
    (ch03.check_intermediate_answers, intermediate_answers_forked,
     "no fork() (it copies the whole prefix"),
    (ch03.check_intermediate_answers, intermediate_answers_no_rollback,
     "roll the cache back (crop) to the cut before the next clause"),
    (ch03.check_intermediate_answers, intermediate_answers_crop_no_restore,
     "the whole statement went in first"),
    (ch03.check_intermediate_answers, intermediate_answers_roll_past,
     "the roll-back is off by one"),
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


def intermediate_answers_roll_short(model, tok, question, cache):
    """Rolls back to one position before the cut: each clause's last token is lost."""
    return asked(model, tok, question, cache, roll=lambda cut, before: cache.crop(before - 1))


def test_a_roll_back_one_short_is_named():
    with pytest.raises(CheckFailed, match="hint: .*(off by one|not the statement's)"):
        ch03.check_intermediate_answers(intermediate_answers_roll_short)


# --- exercise 4: predict, then measure: the slots the start state reaches -------------------------
@pytest.mark.parametrize("wrong, mistake", [
    (lambda: 96, "in layer 0, only the start-state token's own slot differs"),
    (lambda: 12, "one slot per layer?"),
    (lambda: 8, "one layer's worth"),
    (lambda: 156, "the slots before the start-state token never see it"),
    (lambda: 88, "layer 0's own slot for the start-state token differs too"),
    (lambda: 78, "the start-state token's own slot differs too"),
    (lambda: 0, "differ in one token"),
    (lambda: 100, "layer 0 sees only each slot's own token"),
    (lambda: 89.0, "an int"),
    (lambda: minikv.generate(minikv.GPT(minikv.GPTConfig.preset("tiny")), [1], 2).tokens[0],
     "BEFORE the measurement"),
])
def test_predict_differing_slots_names_the_mistake(wrong, mistake):
    with pytest.raises(CheckFailed, match=re.escape(mistake)):
        ch03.check_predict_differing_slots(wrong)


# --- exercise 5: debug forks that share their buffers ---------------------------------------------
class ForkableCache(minikv.KVCache):  # the notebook's, as shipped
    def fork(self):
        return copy.copy(self)


class FixedForkCache(ForkableCache):
    def fork(self):
        twin = copy.copy(self)
        twin.keys = [k.clone() for k in self.keys]
        twin.values = [v.clone() for v in self.values]
        return twin


class DeepForkCache(ForkableCache):  # also right
    def fork(self):
        return copy.deepcopy(self)


class ForkNewLists(ForkableCache):
    def fork(self):
        twin = copy.copy(self)
        twin.keys, twin.values = list(self.keys), list(self.values)
        return twin


class ForkKeysOnly(ForkableCache):
    def fork(self):
        twin = copy.copy(self)
        twin.keys = [k.clone() for k in self.keys]
        return twin


class ForkLiveOnly(ForkableCache):
    def fork(self):
        twin, n = copy.copy(self), self.get_seq_length()
        twin.keys = [k[:, :, :n].clone() for k in self.keys]
        twin.values = [v[:, :, :n].clone() for v in self.values]
        return twin


class ForkIsItself(ForkableCache):
    def fork(self):
        return self


class ForkEngine(ForkableCache):
    def fork(self):
        return minikv.KVCache.fork(self)


@pytest.mark.parametrize("wrong, mistake", [
    (ForkableCache, "the fork shares its source's lists of buffers"),
    (ForkNewLists, "new lists, but of the same tensors"),
    (ForkKeysOnly, "copies the keys but shares the values"),
    (ForkLiveOnly, "the fork has no room"),
    (ForkIsItself, "fork() returned the cache itself"),
    (ForkEngine, "called minikv's own"),
    (FixedForkCache(1, 1, 1, 1, 4), "pass the class itself"),
])
def test_fork_names_the_mistake(wrong, mistake):
    with pytest.raises(CheckFailed, match=re.escape(mistake)):
        ch03.check_fork(wrong)


def test_the_shipped_fork_fails_only_when_requests_take_turns():
    with pytest.raises(CheckFailed, match="requests taking turns.*\n(.*\n)*.*right when decoded "
                                          "alone"):
        ch03.check_fork(ForkableCache)


# --- exercise 6: design: requests on forks in 48 MiB ----------------------------------------------
@pytest.mark.parametrize("wrong, mistake", [
    (lambda: (130, 21), "you left out the document's own cache"),
    (lambda: (131, 19), "the answer's last token is never fed"),
    (lambda: (111, 23), "a request overflows its fork"),
    (lambda: (100, 20), "a fork has the max_len of the cache it copies"),
    (lambda: (256, 9), "a request fits, but in fewer positions too"),
    (lambda: (130, 19), "not 48 x 10**6"),
    (lambda: (130, 15), "more requests fit too"),
    (lambda: (130, 41), "float32, 4 bytes"),
    (lambda: (90, 3), "the document itself does not fit"),
    (lambda: (300, 2), "the target has 256 positions"),
    (lambda: 130, "a pair of positive ints"),
    (lambda: (130.0, 20.0), "a pair of positive ints"),
])
def test_choose_fork_plan_names_the_mistake(wrong, mistake):
    with pytest.raises(CheckFailed, match=re.escape(mistake)):
        ch03.check_choose_fork_plan(wrong)


def test_new_exercises_pass_and_leave_the_random_state_alone(capsys):
    torch.manual_seed(9)
    before = torch.random.get_rng_state()
    ch03.check_predict_differing_slots(lambda: 89)
    ch03.check_fork(FixedForkCache)
    ch03.check_fork(DeepForkCache)
    ch03.check_choose_fork_plan(lambda: (130, 20))
    assert capsys.readouterr().out.count("✓") == 4
    assert torch.equal(torch.random.get_rng_state(), before)


class StubForkCache(ForkableCache):
    def fork(self):
        stub()


@pytest.mark.parametrize("check, args", [(ch03.check_predict_differing_slots, stub),
                                         (ch03.check_fork, StubForkCache),
                                         (ch03.check_choose_fork_plan, stub)])
def test_new_stubs_raise_not_implemented(check, args):
    with pytest.raises(NotImplementedError):
        check(args)


def test_check_cells_follow_their_exercises():
    from conftest import solution_check_cells
    cells = solution_check_cells("03_reasoning_coin_flips.ipynb", "ch03")
    for before, cell, _, passed in cells:
        assert f" {passed[0]}(" in before and "✓" in str(cell.outputs)
    assert [called for _, _, called, _ in cells] == [
        "clause_cuts", "intermediate_answers", "shared_prefix_answers", "predict_differing_slots",
        "fork", "choose_fork_plan"]
