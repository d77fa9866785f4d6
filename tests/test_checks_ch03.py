"""Chapter 03's checkers that are code accept the solutions (and other right ways), let a stub's
NotImplementedError through and name every plausible wrong answer's mistake in its hint, leaving
the random state alone. clause_cuts is a table, tested from its mistakes in test_checks_table.py;
here, only what its mistakes cannot state: wrong types, and hints made from the answers."""
import copy
import re

import numpy as np
import pytest
import torch

import minikv
from minikv.course.checks import CheckFailed, ch03

from conftest import stub

SUFFIX = ". What's the state? A:"
CUTS, ANSWERS, SHARED = (ch03.check_clause_cuts, ch03.check_intermediate_answers,
                         ch03.check_shared_prefix_answers)


def t(ids):
    return torch.tensor([ids])


def word(tok, logits, at=-1):
    return tok.decode([int(logits[0, at].argmax())]).strip()


def clause_cuts_walk(tok, prompt):
    """Also right: walk the prompt's tokens until the text reaches each clause's end (found in the
    text), in bytes (a name's character may span several tokens, one of them alone no text)."""
    statement = prompt[:prompt.rindex(". What's the state?")]
    ends = [statement.find(". ")] * (". " in statement) + [
        m.start() for m in re.finditer(", then ", statement)] + [len(statement)]
    ends, text, cuts = [len(statement[:e].encode()) for e in ends], b"", []
    for k, token in enumerate(tok.encode(prompt)):
        text += tok.decode_single_token_bytes(token)
        if len(text) in ends and len(cuts) < len(ends):
            cuts.append(k + 1)
    return np.array(cuts)  # a numpy array of ints is a list of ints


def split_on_dots(tok, prompt):  # every '. ' ends a sentence, names' too
    parts = re.split(r"(\. |, then )", prompt[:prompt.rindex(". What's the state?")])
    return [len(tok.encode("".join(parts[:i + 1]))) for i in range(0, len(parts), 2)]


def asked(feed=lambda m, c, ids, done, cut: m(t(ids[done:cut]), cache=c),
          ask=lambda m, tok, c: word(tok, m(t(tok.encode(SUFFIX)), cache=c)),
          roll=lambda cache, cut, before: cache.crop(cut), cot=False):
    """intermediate_answers with one step swapped for a mistake: feed(model, cache, ids, done, cut)
    fills a clause, ask(model, tok, cache) answers, roll(cache, cut, before) rolls back."""
    def intermediate_answers(model, tok, question, cache):
        n, answers, done = len(question.steps), [], 0
        statement = tok.encode(question.prefix(n, cot=cot))
        for cut in [len(tok.encode(question.prefix(i, cot=cot))) for i in range(n + 1)]:
            feed(model, cache, statement, done, cut)  # the checkers run them under no_grad
            done, before = cut, cache.get_seq_length()
            answers.append(ask(model, tok, cache))
            roll(cache, cut, before)
        return answers
    return intermediate_answers


def answers_crop_no_restore(model, tok, question, cache):  # the statement, cropped to each cut
    n, answers = len(question.steps), []
    model(t(tok.encode(question.prefix(n))), cache=cache)
    for i in reversed(range(n + 1)):
        cache.crop(len(tok.encode(question.prefix(i))))
        answers.append(word(tok, model(t(tok.encode(SUFFIX)), cache=cache)))
    return answers[::-1]


def shared(room=100, prefill=lambda m, ids, c: m(t(ids), cache=c), fork=lambda c: c.fork(),
           decode=lambda m, s, n, c: minikv.generate(m, s, n, cache=c).tokens,
           out=lambda outs, cache, suffixes: (outs, cache)):
    """shared_prefix_answers by generate() on forks, one step swapped for a mistake."""
    def shared_prefix_answers(model, prefix_ids, suffixes, n_new):
        cache = minikv.KVCache.for_model(model, max_len=len(prefix_ids) + room)
        prefill(model, prefix_ids, cache)
        return out([decode(model, s, n_new, fork(cache)) for s in suffixes], cache, suffixes)
    return shared_prefix_answers


def shared_crop(model, prefix_ids, suffixes, n_new):
    """Also right: each suffix on the prefix's cache itself, cropped back after it."""
    return shared(fork=lambda c: c, decode=lambda m, s, n, c: [
        minikv.generate(m, s, n, cache=c).tokens, c.crop(len(prefix_ids))][0])(
        model, prefix_ids, suffixes, n_new)


def kept_copy(model, prefix_ids, suffixes, n_new):  # one cache shared, a clean copy returned
    clean = []
    outs, _ = shared(fork=lambda c: clean.append(c.fork()) or c)(model, prefix_ids, suffixes, n_new)
    return outs, clean[0]


def forked(fork):
    """A ForkableCache whose fork() is `fork`."""
    return type("Cache", (minikv.KVCache,), {"fork": fork})


def twin(cache, keys=lambda ts: ts, values=None):  # copy.copy, with new lists of keys and values
    twin = copy.copy(cache)
    twin.keys, twin.values = keys(cache.keys), (values or keys)(cache.values)
    return twin


def clones(tensors):
    return [x.clone() for x in tensors]


ForkableCache, FixedForkCache = forked(copy.copy), forked(lambda self: twin(self, clones))
RIGHT_ANSWERS, RIGHT_SHARED = asked(), shared()


@pytest.mark.parametrize("check, right", [
    (CUTS, clause_cuts_walk), (ANSWERS, RIGHT_ANSWERS), (SHARED, RIGHT_SHARED),
    (SHARED, shared_crop),
    (ANSWERS, asked(feed=lambda m, c, ids, done, cut: minikv.generate(m, ids[done:cut], 1, cache=c),
                    ask=lambda m, tok, c: tok.decode(minikv.generate(  # generate() asks too
                        m, tok.encode(SUFFIX), 3, cache=c).tokens[:1]).strip()))])
def test_right_answers_pass(check, right, capsys):
    check(right)
    assert capsys.readouterr().out.startswith("✓")


WRONG = [
    (CUTS, lambda tok, p: [float(c) for c in ch03.clause_cuts(tok, p)], "6.0 is not 6"),
    (CUTS, lambda tok, p: np.array(ch03.clause_cuts(tok, p), dtype=float), "6.0 is not 6"),
    (CUTS, lambda tok, p: None, "forget to return"),
    (CUTS, lambda tok, p: [k for k, x in enumerate(tok.encode(p)) if tok.decode([x]) in ",."],
     "a name can contain a '.'"),  # every ',' or '.' token ends a clause
    (CUTS, split_on_dots, "a name can contain a '.'"),
    (ANSWERS, lambda m, tok, q, c: [m(t(tok.encode(q.prefix(len(q.steps)))), cache=c)] and [
        word(tok, m(t(tok.encode(q.question(i))))) for i in range(len(q.steps) + 1)],
     "recomputing the prefix for every question"),  # right answers, each prefix recomputed
    (ANSWERS, lambda m, tok, q, c: RIGHT_ANSWERS(m, tok, q, minikv.KVCache.for_model(
        m, max_len=200)), "no fork() (it copies the whole prefix"),  # a new cache
    (ANSWERS, lambda m, tok, q, c: RIGHT_ANSWERS(m, tok, q, c.fork()),
     "no fork() (it copies the whole prefix"),
    (ANSWERS, asked(roll=lambda c, cut, before: None),
     "roll the cache back (crop) to the cut before the next clause"),
    (ANSWERS, answers_crop_no_restore, "the whole statement went in first"),
    (ANSWERS, asked(roll=lambda c, cut, before: c.crop(before + 1)), "the roll-back is off by one"),
    (ANSWERS, asked(roll=lambda c, cut, before: c.crop(before - 1)), "the roll-back is off by"),
    (ANSWERS, asked(feed=lambda m, c, ids, done, cut: m(t(ids[done:cut]), cache=c, positions=(
        torch.arange(cut - done)))), "seed 003's position bug"),
    (ANSWERS, asked(feed=lambda m, c, ids, done, cut: m(t(ids[max(done - 1, 0):cut]), cache=c),
                    roll=lambda c, cut, before: c.crop(before)), "fed one token too many"),
    (ANSWERS, asked(cot=True), "chain-of-thought"),
    (ANSWERS, asked(ask=lambda m, tok, c: word(tok, m(t(tok.encode(SUFFIX)), cache=c), 0)),
     "the argmax of the LAST position's"),
    (ANSWERS, lambda m, tok, q, c: RIGHT_ANSWERS(m, tok, q, c) and q.states, "true states S_i"),
    (ANSWERS, lambda *args: RIGHT_ANSWERS(*args)[1:], "you left out i = 0"),
    (ANSWERS, asked(ask=lambda m, tok, c: tok.decode([int(m(t(tok.encode(SUFFIX)), cache=c)[
        0, -1].argmax())])), "leading space"),
    (ANSWERS, asked(ask=lambda m, tok, c: int(m(t(tok.encode(SUFFIX)), cache=c)[0, -1].argmax())),
     "not a token id"),
    (ANSWERS, lambda *args: np.array(RIGHT_ANSWERS(*args)), "not a ndarray"),
    (SHARED, lambda m, p, ss, n: shared(room=0, decode=lambda m_, s, n_, c: minikv.generate(
        m_, p + s, n_).tokens)(m, p, ss, n), "recomputing the prefix for every suffix"),
    (SHARED, shared(fork=lambda c: c), "sharing one cache without forking"),
    (SHARED, kept_copy, "contaminated"),
    (SHARED, shared(decode=lambda m, s, n, c: [out := minikv.generate(m, s, n, cache=c).tokens,
                                               m(t(out[-1:]), cache=c)][0]),
     "fed the last new token back"),
    (SHARED, shared(prefill=lambda m, ids, c: [m(t([i]), cache=c) for i in ids]),
     "not prefilled in one pass"),
    (SHARED, shared(room=0), "a fork has the max_len of the cache it copies"),
    (SHARED, lambda *args: RIGHT_SHARED(*args)[0], "AND the prefix's KVCache"),
    (SHARED, shared(out=lambda outs, c, ss: ([s + o for s, o in zip(ss, outs)], c)),
     "without the suffix"),
    (SHARED, shared(out=lambda outs, c, ss: ([torch.tensor(o).float() for o in outs], c)),
     "list of int"),
    (SHARED, shared(out=lambda outs, c, ss: ([o[1:] + o[-1:] for o in outs], c)),
     "the first new token is the argmax of the suffix's last position"),
    *[(ch03.check_predict_differing_slots, lambda n=n: n, mistake) for n, mistake in [
        (96, "in layer 0, only the start-state token's own slot differs"),
        (12, "one slot per layer?"), (8, "one layer's worth"), (0, "differ in one token"),
        (156, "the slots before the start-state token never see it"),
        (88, "layer 0's own slot for the start-state token differs too"),
        (78, "the start-state token's own slot differs too"), (89.0, "an int"),
        (100, "layer 0 sees only each slot's own")]],
    (ch03.check_predict_differing_slots, lambda: minikv.generate(minikv.GPT(
        minikv.GPTConfig.preset("tiny")), [1], 2).tokens[0], "BEFORE the measurement"),
    (ch03.check_fork, ForkableCache, "right when decoded alone, wrong when the requests take "
                                     "turns: the forks are not independent. the fork shares its"),
    (ch03.check_fork, forked(lambda self: twin(self, list)), "new lists, but of the same tensors"),
    (ch03.check_fork, forked(lambda self: twin(self, clones, lambda ts: ts)),
     "copies the keys but shares the values"),
    (ch03.check_fork, forked(lambda self: twin(self, lambda ts: [
        x[:, :, :self.get_seq_length()].clone() for x in ts])), "the fork has no room"),
    (ch03.check_fork, forked(lambda self: self), "fork() returned the cache itself"),
    (ch03.check_fork, forked(minikv.KVCache.fork), "called minikv's own"),
    (ch03.check_fork, FixedForkCache(1, 1, 1, 1, 4), "pass the class itself"),
    *[(ch03.check_choose_fork_plan, lambda plan=plan: plan, mistake) for plan, mistake in [
        ((130, 21), "you left out the document's own cache"),
        ((131, 19), "the answer's last token is never fed"),
        ((111, 23), "a request overflows its fork"), ((130, 15), "more requests fit too"),
        ((100, 20), "a fork has the max_len of the cache it copies"),
        ((256, 9), "a request fits, but in fewer positions too"),
        ((130, 19), "not 48 x 10**6"), ((130, 41), "float32, 4 bytes"),
        ((90, 3), "the document itself does not fit"), ((300, 2), "the target has 256 positions"),
        (130, "a pair of positive ints"), ((130.0, 20.0), "a pair of positive ints")]],
]


@pytest.mark.parametrize("check, wrong, mistake", WRONG, ids=lambda v: (
    re.sub(r"\W+", "_", v[:30]) if isinstance(v, str) else ""))
def test_wrong_answer_is_named(check, wrong, mistake):
    with pytest.raises(CheckFailed, match=re.escape(mistake)):
        check(wrong)


def test_checkers_pass_and_leave_the_random_state_alone(capsys):
    torch.manual_seed(9)
    before = torch.random.get_rng_state()
    ch03.check_intermediate_answers(RIGHT_ANSWERS)
    ch03.check_shared_prefix_answers(RIGHT_SHARED)
    ch03.check_predict_differing_slots(lambda: 89)
    ch03.check_fork(FixedForkCache)
    ch03.check_fork(forked(copy.deepcopy))  # also right
    ch03.check_choose_fork_plan(lambda: (130, 20))
    assert capsys.readouterr().out.count("✓") == 6
    assert torch.equal(torch.random.get_rng_state(), before)


@pytest.mark.parametrize("check, args", [
    (ANSWERS, stub), (SHARED, stub), (ch03.check_predict_differing_slots, stub),
    (ch03.check_fork, forked(stub)), (ch03.check_choose_fork_plan, stub)])
def test_stubs_raise_not_implemented(check, args):
    with pytest.raises(NotImplementedError):
        check(args)
