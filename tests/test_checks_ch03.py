"""Chapter 03's checkers accept the solutions and reject stubs and plausible wrong answers,
quickly."""
from collections import defaultdict

import pytest
import torch

import minikv
from minikv.course.checks import CheckFailed, ch03

from conftest import stub


@pytest.fixture(scope="module")
def models():
    target, tok = minikv.load_course_model("target", "cpu")
    draft, _ = minikv.load_course_model("draft", "cpu")
    return target, draft, tok


SUFFIX = ". What's the state? A:"


# --- exercise 1: ground truth ---------------------------------------------------------------------
def coin_states(start, flips):
    states = [start]
    for flipped in flips:
        states.append(("tails" if states[-1] == "heads" else "heads") if flipped else states[-1])
    return states


def coin_states_no_start(start, flips):  # off by one: forgets the state before anyone
    return coin_states(start, flips)[1:]


def coin_states_always_turns(start, flips):  # "doesn't flip" read as a flip too
    return coin_states(start, [True] * len(flips))


def coin_states_last_only(start, flips):  # the final state repeated
    return [coin_states(start, flips)[-1]] * (len(flips) + 1)


# --- exercise 2: intermediate answers on forks ----------------------------------------------------
def _answer(model, tok, logits):
    return tok.decode([int(logits[0, -1].argmax())]).strip()


def intermediate_answers(model, tok, question):
    ids = tok.encode(question.prefix(len(question.steps)))
    suffix = tok.encode(SUFFIX)
    cache = minikv.KVCache.for_model(model, max_len=len(ids) + len(suffix))
    answers, done = [], 0
    with torch.inference_mode():
        for i in range(len(question.steps) + 1):
            cut = len(tok.encode(question.prefix(i)))
            model(torch.tensor([ids[done:cut]]), cache=cache)
            done = cut
            answers.append(_answer(model, tok, model(torch.tensor([suffix]), cache=cache.fork(),
                                                     last_only=True)))
    return answers


# fork + crop of the full prompt, generate(): also fine
def intermediate_answers_generate(model, tok, question):
    ids = tok.encode(question.prompt())
    cache = minikv.KVCache.for_model(model, max_len=len(ids) + 4)
    with torch.inference_mode():
        model(torch.tensor([ids]), cache=cache)
    answers = []
    for i in range(len(question.steps) + 1):
        branch = cache.fork()
        branch.crop(len(tok.encode(question.prefix(i))))
        out = minikv.generate(model, tok.encode(SUFFIX), 3, eos_id=tok.eot_token, cache=branch)
        answers.append(tok.decode(out.tokens[:1]))
    return answers


# right answers, but every prefix recomputed
def intermediate_answers_recomputed(model, tok, question):
    with torch.inference_mode():
        return [_answer(model, tok, model(torch.tensor([tok.encode(question.question(i))]),
                                          last_only=True))
                for i in range(len(question.steps) + 1)]


# the corpus's states, not the model's answers
def intermediate_answers_truth(model, tok, question):
    return list(question.states)


# off by one: no answer before anyone flips
def intermediate_answers_skip_start(model, tok, question):
    return intermediate_answers(model, tok, question)[1:]


# asks on the main cache: later clauses follow the question
def intermediate_answers_no_fork(model, tok, question):
    ids = tok.encode(question.prefix(len(question.steps)))
    suffix = tok.encode(SUFFIX)
    cache = minikv.KVCache.for_model(model,
                                     max_len=len(ids) + len(suffix) * (len(question.steps) + 1))
    answers, done = [], 0
    with torch.inference_mode():
        for i in range(len(question.steps) + 1):
            cut = len(tok.encode(question.prefix(i)))
            model(torch.tensor([ids[done:cut]]), cache=cache)
            done = cut
            answers.append(_answer(model, tok, model(torch.tensor([suffix]), cache=cache,
                                                     last_only=True)))
    return answers


# --- exercise 3: accuracy by count ----------------------------------------------------------------
def accuracy_by_count(model, tok, questions, space=" ", key=lambda q: len(q.steps)):
    right, total = defaultdict(int), defaultdict(int)
    with torch.inference_mode():
        for q in questions:
            guess = int(model(torch.tensor([tok.encode(q.prompt())]),
                              last_only=True)[0, -1].argmax())
            right[key(q)] += guess == tok.encode(space + q.answer)[0]
            total[key(q)] += 1
    return {n: right[n] / total[n] for n in sorted(total)}


def accuracy_no_space(model, tok, questions):  # compares with the token of "heads", not " heads"
    return accuracy_by_count(model, tok, questions, space="")


def accuracy_zero_based(model, tok, questions):  # keys 0..7
    return accuracy_by_count(model, tok, questions, key=lambda q: len(q.steps) - 1)


def accuracy_always_right(model, tok, questions):
    return {n: 1.0 for n in range(1, 9)}


def accuracy_counts(model, tok, questions):  # numbers correct, not fractions
    acc = accuracy_by_count(model, tok, questions)
    sizes = defaultdict(int)
    for q in questions:
        sizes[len(q.steps)] += 1
    return {n: round(a * sizes[n]) for n, a in acc.items()}


# --- the tests ------------------------------------------------------------------------------------
def test_solutions_pass(models, capsys):
    target, draft, tok = models
    threads = torch.get_num_threads()
    # on a busy 2-core machine, 2 threads per process oversubscribe and crawl
    torch.set_num_threads(1)
    try:
        for run in (lambda: ch03.check_coin_states(coin_states),
                    lambda: ch03.check_intermediate_answers(intermediate_answers, target, draft,
                                                            tok),
                    lambda: ch03.check_intermediate_answers(intermediate_answers_generate, target,
                                                            draft, tok),
                    lambda: ch03.check_accuracy_by_count(accuracy_by_count, target, draft, tok)):
            run()
    finally:
        torch.set_num_threads(threads)
    assert capsys.readouterr().out.count("✓") == 4


@pytest.mark.parametrize("wrong", [coin_states_no_start, coin_states_always_turns,
                                   coin_states_last_only])
def test_coin_states_rejects(wrong):
    with pytest.raises(CheckFailed):
        ch03.check_coin_states(wrong)


@pytest.mark.parametrize("wrong", [intermediate_answers_recomputed, intermediate_answers_truth,
                                   intermediate_answers_skip_start, intermediate_answers_no_fork])
def test_intermediate_answers_rejects(models, wrong):
    target, draft, tok = models
    with pytest.raises(CheckFailed):
        ch03.check_intermediate_answers(wrong, target, draft, tok)


def test_recomputing_is_rejected_for_its_work(models):
    target, draft, tok = models
    with pytest.raises(CheckFailed, match="recomputed"):
        ch03.check_intermediate_answers(intermediate_answers_recomputed, target, draft, tok)


@pytest.mark.parametrize("wrong", [accuracy_no_space, accuracy_zero_based, accuracy_always_right,
                                   accuracy_counts])
def test_accuracy_by_count_rejects(models, wrong):
    target, draft, tok = models
    with pytest.raises(CheckFailed):
        ch03.check_accuracy_by_count(wrong, target, draft, tok)


def test_stubs_raise_not_implemented(models):
    target, draft, tok = models
    for run in (lambda: ch03.check_coin_states(stub),
                lambda: ch03.check_intermediate_answers(stub, target, draft, tok),
                lambda: ch03.check_accuracy_by_count(stub, target, draft, tok)):
        with pytest.raises(NotImplementedError):
            run()
