"""Chapter 04's checkers beyond the generic test of its tables (tests/test_checks_table.py): one
list of (wrong implementation, hint fragment) for the stateful exercises and what tables cannot
state (wrong types, crashes, inputs changed in place); the solutions pass; the cases are sound."""
import math
import re
from functools import partial

import numpy as np
import pytest
import torch

import minikv
from minikv.course.checks import CheckFailed, ch04

from conftest import stub

A, R, _n = ch04.reference_alpha, ch04._rounds, ch04._matching

# --- exercise 1: one speculative round ------------------------------------------------------------

def _crop(seq, *caches):
    for cache in caches:
        cache.crop(min(cache.get_seq_length(), len(seq) - 1))


def _verify(target, seq, t_cache, proposals):
    return target(torch.tensor([seq[-1:] + proposals]), cache=t_cache)[0].argmax(-1).tolist()


def _round(pick=lambda p, c: p[:_n(p, c)] + [c[_n(p, c)]], verify=_verify, crop=_crop,
           after=lambda t_cache, d_cache, start: None,
           feed=lambda seq, p, d_cache: (seq + p)[d_cache.get_seq_length():]):
    """The solution's round, or a wrong one: one of its steps replaced."""
    def speculative_round(target, draft, seq, t_cache, d_cache, gamma):
        start, proposals = len(seq) - 1, []
        for _ in range(gamma):
            logits = draft(torch.tensor([feed(seq, proposals, d_cache)]), cache=d_cache,
                           last_only=True)
            proposals.append(int(logits[0, -1].argmax()))
        new = pick(proposals, verify(target, seq, t_cache, proposals))
        seq.extend(new)
        crop(seq, t_cache, d_cache)
        after(t_cache, d_cache, start)
        return new
    return speculative_round


speculative_round = _round()


ROUND_WRONG = [  # rounds that commit the usual wrong tokens (the first the checker lists)...
    (_round(pick=lambda p, c, wrong=wrong: (wrong(p, c) or [p[:_n(p, c)] + [c[_n(p, c)]]])[0]),
     hint) for hint, wrong in ch04.COMMIT_MISTAKES.items()] + [  # ...and do other wrong things
    (_round(crop=lambda s, t, d: (t.crop(len(s) - 1), d.crop(len(s) - 1))), "without min"),
    (_round(crop=lambda s, t, d: _crop(s, t)), "do not crop the draft cache"),
    (_round(verify=lambda m, s, c, p: [int(m(torch.tensor([[x]]), cache=c)[0, -1].argmax())
                                       for x in s[-1:] + p]), "one target pass each"),
    (_round(after=lambda t, d, start: d.reset()), "reset the draft cache"),
    (_round(crop=lambda s, t, d: (t.reset(), d.reset())), "reset the target cache"),
    (_round(after=lambda t, d, start: [x[:, :, start:].zero_() for x in t.keys + t.values]),
     "zero, reset or overwrite"),  # "unverified", accepted K/V too
    (_round(after=lambda t, d, start: [x.zero_() for x in d.values]), "the draft cache's K/V"),
    (_round(after=lambda t, d, start: t.values[-1][:, :, start:].zero_()), "target cache's K/V"),
    (_round(feed=lambda s, p, d: (s + p)[-1:]), "first pass feeds only the last committed token"),
    (_round(verify=lambda m, s, c, p: m(torch.tensor([s + p]))[0, -len(p) - 1:].argmax(-1)
            .tolist()), "feed the target the whole sequence again"),
    (lambda tg, dr, seq, *rest: speculative_round(tg, dr, list(seq), *rest), "seq in place"),
    (lambda *args: speculative_round(*args) and None, "returned None"),
    (lambda tg, dr, seq, *rest: speculative_round(tg, dr, seq, *rest) and seq, "exactly the"),
    (lambda *args: torch.tensor(speculative_round(*args), dtype=torch.float32), "a torch.Tensor"),
    (_round(verify=lambda m, s, c, p: (minikv.verify_and_commit(  # on copies: called is enough
        list(s), p, c.fork(), lambda rows, c: m(torch.tensor([rows]), cache=c)[0], partial(
            ch04.accept_matching, sampling=minikv.SamplingParams(), first_position=len(s))),
        _verify(m, s, c, p))[1]), "called minikv's own minikv.engine.verify.verify_and_commit"),
    (lambda tg, dr, seq, t, d, g: (minikv.speculative_generate(tg, dr, seq, g + 1, gamma=g),
                                   speculative_round(tg, dr, seq, t, d, g))[1],
     "called minikv's own minikv.engine.speculative"),
]


def test_round_cases_cover_every_kind_of_round_and_are_sound():
    """For every γ, fully accepted rounds, rejections of the first proposal and of later ones; the
    engine's speculative decoding is target-only greedy on every case, by a clear margin."""
    kinds = set()
    for seed, prompt, gamma in ch04.ROUND_CASES:
        target, draft = ch04.tiny_pair(seed)
        n = ch04.NEW_TOKENS + gamma + 1
        out = minikv.speculative_generate(target, draft, prompt, n, gamma=gamma, trace=True)
        kinds |= {(gamma, "all" if not e.rejected else "first" if not e.accepted else "later")
                  for e in out.trace if e.kind == "verify" and len(e.input_ids) == gamma}
        alone = minikv.generate(target, prompt, n, return_logits=True)
        assert out.tokens == alone.tokens
        top2 = alone.logits.topk(2, dim=-1).values
        assert float((top2[:, 0] - top2[:, 1]).min()) > 1e-4
    gammas = {g for _, _, g in ch04.ROUND_CASES}
    assert gammas == set(range(1, 7))
    assert {(g, "all") for g in gammas} <= kinds and {(g, "first") for g in gammas} <= kinds
    assert {(g, "later") for g in gammas if g > 1} <= kinds


# --- exercises 2-4 (tables): their cases are sound ------------------------------------------------

def test_one_step_gives_p_only_with_the_rules_own_residual():
    """Soundness: the reference residual makes one speculative step give exactly p, under the
    chapter's rule (where it is the engine's) and another; the chapter's residual does not."""
    from minikv.engine.verify import residual_distribution

    def step(p, q, residual, a):  # draw x ~ q, accept with a(x), else draw from the residual
        return q * a + (1 - (q * a).sum()) * residual(p, q, a)
    chapter_line = next(iter(ch04.RESIDUAL.mistakes.values()))
    for s in range(5):
        p, q = ch04._distributions(s)
        a, half = ch04.chapter_acceptance(p, q), ch04.chapter_acceptance(p, q) / 2
        assert torch.allclose(ch04.reference_residual(p, q, a), residual_distribution(p, q))
        for rule in (a, half):
            assert torch.allclose(step(p, q, ch04.reference_residual, rule), p, atol=1e-12)
        assert not torch.allclose(step(p, q, chapter_line, half), p, atol=1e-3)


def test_alpha_cases_include_the_edges_and_are_the_engines():
    with torch.inference_mode():
        runs = list(ch04._alpha_runs())
    alphas = [out.stats.alpha for _, out in runs]
    assert all(ch04._same(A(out.trace), out.stats.alpha) for _, out in runs)
    assert 1.0 in alphas and None in alphas and sum(0.3 < (a or 0) < 0.97 for a in alphas) >= 6
    # per index: α is not the same at every index of a round, and some index was never judged
    per_index = [A(out.trace, i) for _, out in runs for i in range(3)]
    assert None in per_index and len({round(a, 3) for a in per_index if a is not None}) > 5


def test_gamma_cases_are_sound():
    """best_gamma's cases have a clear winner or an exact tie, varied answers, the limit at α = 1;
    choose_gamma's span no speculation to 7+, and one request is the chapter's formula."""
    for alpha, c, max_gamma in ch04.BEST_GAMMA.cases:
        values = sorted((ch04.speedup(alpha, c, g) for g in range(1, max_gamma + 1)), reverse=True)
        assert len(values) < 2 or values[0] == values[1] or values[0] - values[1] > 1e-9 * values[0]
    assert {1, 16} <= {ch04.reference_best_gamma(*case) for case in ch04.BEST_GAMMA.cases}
    assert len({ch04.reference_best_gamma(*case) for case in ch04.BEST_GAMMA.cases}) >= 6
    assert math.isclose(ch04.speedup(0.5, 0.1, 3), (1 - 0.5 ** 4) / (0.5 * 1.3))
    assert math.isclose(ch04.speedup(1 - 1e-9, 0.1, 3), ch04.speedup(1.0, 0.1, 3), rel_tol=1e-6)
    answers = [ch04.reference_choose_gamma(*case) for case in ch04.DESIGN.cases]
    assert 0 in answers and 1 in answers and max(answers) >= 7
    assert ch04.reference_choose_gamma(0.9, 0.05, 1, 64) == ch04.reference_best_gamma(0.9, 0.05, 16)


# --- exercise 5 (predict, then measure): a draft that is never wrong ------------------------------

MEASURED = {"target_passes": 7, "draft_passes": 23, "target_kv": 33, "draft_kv": 32}


PREDICT_WRONG = [  # every usual wrong count the checker names (P = 4, 6 rounds, 23 proposals)
    (lambda key=key, value=value: {**MEASURED, key: value}, hint)
    for key, mistakes in ch04._prediction_mistakes(4, 30, 4, 6, 23, 23).items()
    for value, hint in mistakes if value != MEASURED[key]] + [
    (lambda: {**MEASURED, "draft_kv": 7.5}, "a count is a whole number"),
    (lambda: [7, 23, 33, 32], "as a dict"),
    (lambda: None, "did you forget to return it"),
    (lambda: {"passes": 7}, "as a dict"),
    (lambda: {"target_passes": minikv.speculative_generate(
        *[minikv.load_course_model("target", "cpu")[0]] * 2, [1, 2, 3, 4], 30,
        gamma=4).stats.target_passes, "draft_passes": 23, "target_kv": 33, "draft_kv": 32},
     "a prediction is made before the measurement"),
]


def test_the_perfect_draft_run_accepts_everything_and_is_the_targets_own():
    P, out, measured = ch04.perfect_draft_run()
    assert out.stats.rejected == 0 and out.stats.alpha == 1.0
    target, tok = minikv.load_course_model("target", "cpu")
    alone = minikv.generate(target, tok.encode(ch04.PERFECT_PROMPT), ch04.PERFECT_NEW,
                            return_logits=True)
    assert out.tokens == alone.tokens
    top2 = alone.logits.topk(2, dim=-1).values  # no near-tie another CPU could flip
    assert float((top2[:, 0] - top2[:, 1]).min()) > 1e-3
    assert measured["target_kv"] == P + ch04.PERFECT_NEW - 1  # nothing thrown away at α = 1


# --- exercise 6 (debug): one round of speculative sampling ----------------------------------------

def accept_draws_differently(p, q, proposals, generator):
    """Right, with the random numbers drawn one at a time: the distribution is what counts."""
    for i, x in enumerate(proposals):
        u = float(torch.rand(1, generator=generator))
        if u >= min(1.0, float(p[i, x] / q[i, x])):
            residual = (p[i] - q[i]).clamp(min=0)
            return i, int(torch.multinomial(residual, 1, generator=generator))
    return len(proposals), int(torch.multinomial(p[len(proposals)], 1, generator=generator))


def _following(rule):
    """A round that follows `rule` (accept, residual, bonus), one of ch04.SAMPLED_MISTAKES'."""
    def accept(p, q, proposals, generator):
        (accept, residual, bonus), u = rule, torch.rand(len(proposals), generator=generator)
        for i, x in enumerate(proposals):
            if u[i] >= accept(float(p[i, x]), float(q[i, x])):
                return i, int(torch.multinomial(residual(p[i], q[i]), 1, generator=generator))
        n = len(proposals)
        return n, int(torch.multinomial(bonus(p, q, n), 1, generator=generator))
    return accept


accept_sampled = _following(ch04.RIGHT_RULE)


SAMPLED_WRONG = [(_following(rule), hint) for rule, hint in ch04.SAMPLED_MISTAKES] + [
    (ch04.accept_sampled_buggy, "accept_sampled_buggy unchanged"),
    (lambda p, *rest: accept_sampled(p.mul_(1.01), *rest), "no in-place operations"),
    (lambda *args: (len(args[2]) + 1, 0), "accepted counts proposals kept"),
    (lambda *args: (lambda k, y: (torch.tensor(k), torch.tensor([y], dtype=torch.float32)))(
        *accept_sampled(*args)), "two ints"),
]


def test_the_closed_form_is_the_engines_rule():
    """The solution draws the same random numbers as the engine's accept_by_rejection_sampling,
    so their outcomes agree trial for trial; and the closed form sums to 1 for every rule."""
    from minikv.engine.verify import accept_by_rejection_sampling
    sp = minikv.SamplingParams(temperature=1.0)
    for _, p, q, proposals in ch04._sampled_cases():
        logits = p.clamp(min=1e-30).log()  # softmax(log p) = p
        for t in range(200):
            mine = accept_sampled(p, q, proposals, torch.Generator().manual_seed(t))
            verdict = accept_by_rejection_sampling(
                logits, proposals, q if len(proposals) else None, sp,
                torch.Generator().manual_seed(t))
            assert mine == (verdict.accepted, verdict.token)
        for rule, _ in [(ch04.RIGHT_RULE, None)] + ch04.SAMPLED_MISTAKES:
            assert math.isclose(float(ch04.outcome_distribution(p, q, proposals, rule).sum()),
                                1.0, rel_tol=1e-6)


# --- all exercises --------------------------------------------------------------------------------

def _per_index(wrong):
    return lambda trace, index=None: A(trace) if index is None else wrong(R(trace), index)


BEYOND_THE_TABLES = {  # what no table names: wrong types, crashes, inputs changed, stateful code
    ch04.check_residual: [
        (lambda p, q, a: p.sub_(q * a).clamp_(min=0) / p.sum(), "in-place operations"),
        (lambda p, q, a: np.maximum(p.numpy() - q.numpy() * a.numpy(), 0), "a numpy.ndarray"),
        (lambda p, q, a: ch04.reference_residual(p, q, a).tolist(), "not a list"),
        (lambda p, q, a: ch04.reference_residual(p, q, a)[1:], "shape as p"),
        (lambda p, q, a: ch04.reference_residual(p, q, a).flip(0), "divided by its sum"),
        (lambda p, q, a: ch04.reference_residual(p, q, a).flip(0) if a.label.startswith(
            "one speculative step") else ch04.reference_residual(p, q, a), "it must fill")],
    ch04.check_alpha_from_trace: [
        (lambda t, i=None: 0.0 if A(t, i) is None else A(t, i), "None (n/a), not a number"),
        (lambda t, i=None: math.nan if A(t, i) is None else A(t, i), "None (n/a), not a number"),
        (lambda t, i=None: A(t, i) if i is not None else sum(a for a, _, _ in R(t)) / sum(
            a + j for a, j, _ in R(t)), "return None (n/a) then"),
        (lambda t, i=None: A(t, i) and torch.tensor(A(t, i)), "float, not a torch.Tensor"),
        (_per_index(lambda r, i: ch04._ratio(sum(a > i for a, _, _ in r),
                                             sum(n > i for *_, n in r))), "never judged"),
        (_per_index(lambda r, i: sum(a > i for a, _, _ in r) / len(r) if r else None),
         "divide by every round"),
        (lambda trace, index=None: A(trace), "pooled over every proposal"),
        (lambda t, i=None: A(t, None if i is None else max(i - 1, 0)), "index counts from 0")],
    ch04.check_best_gamma: [
        (lambda alpha, c, m: 1 + max(range(m), key=lambda g: (1 - alpha ** (g + 2)) / (
            (1 - alpha) * (g * c + c + 1))), "at α = 1 the formula is 0/0"),  # crashes there
        (lambda *case: float(ch04.reference_best_gamma(*case)), "an int, not a float")],
    ch04.check_choose_gamma: [(lambda *case: float(ch04.reference_choose_gamma(*case)),
                               "return γ as an int")] + [  # its table, not in EXERCISES
        (wrong, hint) for hint, wrong in ch04.DESIGN.mistakes.items()],
    ch04.check_speculative_round: ROUND_WRONG,
    ch04.check_predict_perfect_draft: PREDICT_WRONG,
    ch04.check_accept_sampled: SAMPLED_WRONG}
WRONG = [(check, w, f) for check, wrongs in BEYOND_THE_TABLES.items() for w, f in wrongs]


@pytest.mark.parametrize("check, wrong, fragment", WRONG)
def test_a_wrong_answer_is_named(check, wrong, fragment):
    with pytest.raises(CheckFailed, match=re.escape(fragment)):
        check(wrong)


CHECKS = [(ch04.check_speculative_round, speculative_round), (ch04.check_accept_sampled,
          accept_sampled), (ch04.check_predict_perfect_draft, lambda: dict(MEASURED)),
          (ch04.check_choose_gamma, ch04.reference_choose_gamma)]
ACCEPTED = [(ch04.check_speculative_round, _round(after=lambda t, d, start: [  # stale slots
    x[:, :, c.get_seq_length():].zero_() for c in (t, d) for x in c.keys + c.values])),
            (ch04.check_accept_sampled, accept_draws_differently)]  # judged by distribution


@pytest.mark.parametrize("check, solution", CHECKS + ACCEPTED)
def test_solutions_pass_leaving_the_random_state_alone_and_a_stub_goes_through(
        check, solution, capsys):
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    check(solution)
    with pytest.raises(NotImplementedError):
        check(stub)
    assert torch.equal(before, torch.random.get_rng_state())
    out = capsys.readouterr().out
    assert out.endswith(" cases pass\n") and out.count("✓ ") == 1
    if check == ch04.check_predict_perfect_draft:
        assert "measured: 7 target and 23 draft passes, 33 and 32 K/V vectors" in out
    if check == ch04.check_choose_gamma:
        assert out.startswith("  the best γ as the batch grows (α = 0.9, c = 0.05, balance = 64): "
                              "1 → 13, 4 → 13, 16 → 3, 32 → 1, 48 → 1, 64 → 0, 128 → 0\n✓ ")
