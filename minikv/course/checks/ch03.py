"""Checkers for chapter 03 (seed 000, the KV cache inside reasoning: coin flips).

Ground truth comes from the corpus (`CoinFlip.states`); the model's answers from the engine
itself, each question recomputed from scratch; the K/V work from `KVCounter`'s hooks, so a solution
that recomputes the prefix instead of forking the cache is caught. The models are the notebook's own
(the shipped course models).
"""
from __future__ import annotations

import random

import torch

from ...engine import KVCounter
from ..corpus import CoinFlip, coin_flip_eval, random_coin_flip
from . import call, expect, fail, passed

SUFFIX = ". What's the state? A:"


def _question(start: str, pattern: str,
              names=("Alice", "Bob", "Carol", "Dave", "Eve", "Frank", "Grace", "Henry")
              ) -> CoinFlip:
    """CoinFlip from a pattern like "FNF" (F: flips, N: doesn't flip)."""
    return CoinFlip(start, tuple((name, c == "F") for name, c in zip(names, pattern)))


# --- exercise 1: the ground truth after each step -------------------------------------------------

def check_coin_states(coin_states) -> None:
    """coin_states(start, flips) -> the state before anyone (index 0) and after each person."""
    name = "coin_states"
    rng = random.Random(3)
    cases = [("heads", ""), ("tails", ""), ("heads", "F"), ("heads", "N"), ("tails", "FF"),
             ("heads", "FN"), ("tails", "NNN"), ("heads", "FFFFFFFF"), ("tails", "NFNFFNNF")]
    cases += [(q.start, "".join("F" if f else "N" for _, f in q.steps)) for q in
              (random_coin_flip(rng) for _ in range(6))]
    for start, pattern in cases:
        flips = [c == "F" for c in pattern]
        case = f"start={start!r}, flips={flips}"
        want = _question(start, pattern).states
        got = call(name, case, coin_states, start, list(flips))
        if not isinstance(got, (list, tuple)):
            fail(name, case, want, got,
                 "return a list of 'heads' / 'tails', one more than there are people")
        got = list(got)
        hint = ("index 0 is the start state, then one state per person: len(flips) + 1 in all"
                if len(got) != len(want) else
                "a person who flips turns the coin over; one who doesn't leaves it as it was")
        expect(got == want, name, case, want, got, hint)
    passed(name, len(cases))


# --- exercise 2: intermediate answers from a forked cache -----------------------------------------

@torch.inference_mode()
def _recomputed_answers(model, tok, q: CoinFlip) -> list[str]:
    """The reference: every question(i) fed from scratch, greedy token after "A:"."""
    answers = []
    for i in range(len(q.steps) + 1):
        ids = torch.tensor([tok.encode(q.question(i))], device=model.device)
        answers.append(tok.decode([int(model(ids, last_only=True)[0, -1].argmax())]).strip())
    return answers


def check_intermediate_answers(intermediate_answers, target, draft, tok) -> None:
    """intermediate_answers(model, tok, question) -> the model's answer after each person, computed
    on forks of one cache: answers equal the recomputed ones, and the K/V work is one prefix plus
    one suffix per fork."""
    name = "intermediate_answers"
    suffix_len = len(tok.encode(SUFFIX))
    cases = [(target, "target", _question("heads", "FF")),
             (target, "target", _question("tails", "N")),
             (target, "target", _question("heads", "NFFNF")),
             (target, "target", _question("tails", "FNNFFNFF")),
             (draft, "draft", _question("heads", "FFFFFF")),
             (draft, "draft", _question("heads", "FFFFFNF"))]
    # the draft answers some of these steps wrongly (with clear margins): the model's answers, not
    # the truth
    for model, model_name, q in cases:
        case = f"{model_name}, {q.prompt()!r}"
        want = _recomputed_answers(model, tok, q)
        with KVCounter(model) as counter:
            got = call(name, case, intermediate_answers, model, tok, q)
        if not isinstance(got, (list, tuple)):
            fail(name, case, want, got,
                 "return a list of answers, one per step i = 0..n (the start, then each person)")
        got = [a.strip() if isinstance(a, str) else a for a in got]
        hint = ("one answer per cache cut: i = 0 (the start sentence) up to n (everyone), "
                "so n + 1 answers"
                if len(got) != len(want) else
                "fork the cache cut after person i, feed '. What's the state? A:' into the fork, "
                "and decode the greedy next token (stripped of its leading space); "
                "these are the model's answers, not the truth")
        expect(got == want, name, case, want, got, hint)
        prefix_len = len(tok.encode(q.prefix(len(q.steps))))
        least = prefix_len + (n_forks := len(q.steps) + 1) * suffix_len
        # room for a few answer tokens per fork
        most = prefix_len + suffix_len + n_forks * (suffix_len + 4)
        expect(counter.count >= least, name, case + " (K/V vectors computed per layer)",
               f">= {least}", counter.count,
               "every clause and every question's suffix has to go through the model once")
        expect(counter.count <= most, name, case + " (K/V vectors computed per layer)",
               f"<= {most}", counter.count,
               f"too much K/V work, as if the prefix were recomputed: compute each clause's K/V "
               f"once ({prefix_len} in all), then per fork only the {suffix_len} suffix tokens "
               f"and the answer (cache.fork(), then "
               f"model(idx, cache=fork) or generate(..., cache=fork))")
    passed(name, len(cases))


# --- exercise 3: accuracy by number of people -----------------------------------------------------

@torch.inference_mode()
def _reference(model, tok, questions: list[CoinFlip],
               margin: float = 0.05) -> tuple[list[CoinFlip], dict[int, float]]:
    """The rule of minikv.course.evaluate.coin_flip_accuracy (greedy token after "A:" equals
    " " + answer), one question at a time, on the questions whose top two logits are more than
    `margin` apart: near-ties are left out, so batched and one-at-a-time forward passes agree on
    every kept question whatever the kernels' rounding."""
    kept, right, total = [], {}, {}
    for q in questions:
        logits = model(torch.tensor([tok.encode(q.prompt())], device=model.device),
                       last_only=True)[0, -1]
        top = logits.topk(2)
        if float(top.values[0] - top.values[1]) <= margin:
            continue
        kept.append(q)
        n = len(q.steps)
        right[n] = right.get(n, 0) + (int(top.indices[0]) == tok.encode(" " + q.answer)[0])
        total[n] = total.get(n, 0) + 1
    return kept, {n: right[n] / total[n] for n in sorted(total)}


def check_accuracy_by_count(accuracy_by_count, target, draft, tok) -> None:
    """accuracy_by_count(model, tok, questions) -> {number of people: fraction answered right},
    against the rule of minikv.course.evaluate.coin_flip_accuracy on held-out questions."""
    name = "accuracy_by_count"
    n_cases = 0
    for model, model_name, n_per_count, seed in ((draft, "draft", 5, 0), (draft, "draft", 4, 7),
                                                 (target, "target", 2, 1)):
        questions, want = _reference(model, tok, coin_flip_eval(n_per_count, seed=seed))
        case = (f"{model_name}, {len(questions)} questions of "
                f"coin_flip_eval({n_per_count}, seed={seed}) (near-ties left out)")
        got = call(name, case, accuracy_by_count, model, tok, list(questions))
        if not isinstance(got, dict):
            fail(name, case, want, got, "return a dict {number of people: fraction correct}")
        hint = ("keys are the numbers of people (1..8), len(question.steps)"
                if set(got) != set(want) else
                "correct when the greedy token after 'A:' is ' ' + question.answer "
                "(with its leading space); a fraction in [0, 1] per number of people")
        try:
            same = set(got) == set(want) and all(abs(float(got[k]) - want[k]) < 1e-9 for k in want)
        except (TypeError, ValueError):
            same = False
        expect(same, name, case, want, got, hint)
        n_cases += 1
    passed(name, n_cases)


__all__ = ["check_coin_states", "check_intermediate_answers", "check_accuracy_by_count"]
