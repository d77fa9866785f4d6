"""Chapter 04's checkers accept the solutions, let a stub's NotImplementedError through, and reject
plausible wrong answers with a hint that names the mistake; they are sound (the engine agrees with
them on every case they use) and leave the caller's random state alone."""
import math
import re

import numpy as np
import pytest
import torch

import minikv
from minikv.course.checks import CheckFailed, ch04

from conftest import stub

# --- exercise 1: one speculative round ------------------------------------------------------------


def _draft(draft, seq, d_cache, gamma, feed=None):
    proposals = []
    for _ in range(gamma):
        pending = (seq + proposals)[d_cache.get_seq_length():] if feed is None \
            else feed(seq, proposals, d_cache)
        logits = draft(torch.tensor([pending]), cache=d_cache, last_only=True)
        proposals.append(int(logits[0, -1].argmax()))
    return proposals


def _verify(target, seq, t_cache, proposals):
    return target(torch.tensor([seq[-1:] + proposals]), cache=t_cache)[0].argmax(-1).tolist()


def _prefix(proposals, choice):
    n = 0
    while n < len(proposals) and proposals[n] == choice[n]:
        n += 1
    return n


def _crop(seq, *caches):
    for cache in caches:
        cache.crop(min(cache.get_seq_length(), len(seq) - 1))


def speculative_round(target, draft, seq, t_cache, d_cache, gamma):
    proposals = _draft(draft, seq, d_cache, gamma)
    choice = _verify(target, seq, t_cache, proposals)
    n = _prefix(proposals, choice)
    new = proposals[:n] + [choice[n]]
    seq.extend(new)
    _crop(seq, t_cache, d_cache)
    return new


def round_crop_without_min(target, draft, seq, t_cache, d_cache, gamma):
    proposals = _draft(draft, seq, d_cache, gamma)
    choice = _verify(target, seq, t_cache, proposals)
    n = _prefix(proposals, choice)
    seq.extend(proposals[:n] + [choice[n]])
    t_cache.crop(len(seq) - 1)
    d_cache.crop(len(seq) - 1)
    return proposals[:n] + [choice[n]]


def round_without_draft_crop(target, draft, seq, t_cache, d_cache, gamma):
    proposals = _draft(draft, seq, d_cache, gamma)
    choice = _verify(target, seq, t_cache, proposals)
    n = _prefix(proposals, choice)
    seq.extend(proposals[:n] + [choice[n]])
    _crop(seq, t_cache)
    return proposals[:n] + [choice[n]]


def round_one_target_pass_per_proposal(target, draft, seq, t_cache, d_cache, gamma):
    proposals = _draft(draft, seq, d_cache, gamma)
    choice = [int(target(torch.tensor([[t]]), cache=t_cache)[0, -1].argmax())
              for t in seq[-1:] + proposals]
    n = _prefix(proposals, choice)
    seq.extend(proposals[:n] + [choice[n]])
    _crop(seq, t_cache, d_cache)
    return proposals[:n] + [choice[n]]


def round_without_bonus(target, draft, seq, t_cache, d_cache, gamma):
    proposals = _draft(draft, seq, d_cache, gamma)
    choice = _verify(target, seq, t_cache, proposals)
    n = _prefix(proposals, choice)
    new = proposals if n == gamma else proposals[:n] + [choice[n]]
    seq.extend(new)
    _crop(seq, t_cache, d_cache)
    return new


def round_commits_draft_token(target, draft, seq, t_cache, d_cache, gamma):
    proposals = _draft(draft, seq, d_cache, gamma)
    choice = _verify(target, seq, t_cache, proposals)
    n = _prefix(proposals, choice)
    new = proposals[:n + 1] if n < gamma else proposals + [choice[n]]
    seq.extend(new)
    _crop(seq, t_cache, d_cache)
    return new


def round_off_by_one_rows(target, draft, seq, t_cache, d_cache, gamma):
    proposals = _draft(draft, seq, d_cache, gamma)
    choice = _verify(target, seq, t_cache, proposals)
    n = 0
    while n < gamma and proposals[n] == choice[n + 1]:  # row i + 1 taken for proposal i
        n += 1
    new = proposals[:n] + [choice[min(n + 1, gamma)]]
    seq.extend(new)
    _crop(seq, t_cache, d_cache)
    return new


def round_keeps_every_match(target, draft, seq, t_cache, d_cache, gamma):
    proposals = _draft(draft, seq, d_cache, gamma)
    choice = _verify(target, seq, t_cache, proposals)
    kept = [p for p, c in zip(proposals, choice) if p == c]
    new = kept + [choice[len(kept)]]
    seq.extend(new)
    _crop(seq, t_cache, d_cache)
    return new


def round_resets_draft(target, draft, seq, t_cache, d_cache, gamma):
    new = speculative_round(target, draft, seq, t_cache, d_cache, gamma)
    d_cache.reset()  # "the draft will catch up anyway"
    return new


def round_resets_both(target, draft, seq, t_cache, d_cache, gamma):
    proposals = _draft(draft, seq, d_cache, gamma)
    choice = _verify(target, seq, t_cache, proposals)
    n = _prefix(proposals, choice)
    seq.extend(proposals[:n] + [choice[n]])
    t_cache.reset()
    d_cache.reset()
    return proposals[:n] + [choice[n]]


def round_zeroes_unverified(target, draft, seq, t_cache, d_cache, gamma):
    """Wipes what this round wrote, "as it was unverified", before cropping: accepted K/V too."""
    start = len(seq) - 1
    new = speculative_round(target, draft, seq, t_cache, d_cache, gamma)
    for t in t_cache.keys + t_cache.values:
        t[:, :, start:] = 0
    return new


def round_zeroes_draft_values(target, draft, seq, t_cache, d_cache, gamma):
    """Clears the draft's cache "to start each round clean", but keeps its length."""
    new = speculative_round(target, draft, seq, t_cache, d_cache, gamma)
    for t in d_cache.values:
        t.zero_()
    return new


def round_zeroes_last_layer(target, draft, seq, t_cache, d_cache, gamma):
    """Only the target's LAST layer's values are hurt: a check of layer 0 alone would miss it."""
    start = len(seq) - 1
    new = speculative_round(target, draft, seq, t_cache, d_cache, gamma)
    t_cache.values[-1][:, :, start:] = 0
    return new


def round_zeroes_stale_slots(target, draft, seq, t_cache, d_cache, gamma):
    """Zeroing only what was cropped away is harmless: the checker must accept it."""
    new = speculative_round(target, draft, seq, t_cache, d_cache, gamma)
    for cache in (t_cache, d_cache):
        for t in cache.keys + cache.values:
            t[:, :, cache.get_seq_length():] = 0
    return new


def round_draft_feeds_last_token(target, draft, seq, t_cache, d_cache, gamma):
    proposals = _draft(draft, seq, d_cache, gamma, feed=lambda s, p, c: (s + p)[-1:])
    choice = _verify(target, seq, t_cache, proposals)
    n = _prefix(proposals, choice)
    seq.extend(proposals[:n] + [choice[n]])
    _crop(seq, t_cache, d_cache)
    return proposals[:n] + [choice[n]]


def round_target_without_cache(target, draft, seq, t_cache, d_cache, gamma):
    proposals = _draft(draft, seq, d_cache, gamma)
    logits = target(torch.tensor([seq + proposals]))[0, -(gamma + 1):]
    choice = logits.argmax(-1).tolist()
    n = _prefix(proposals, choice)
    seq.extend(proposals[:n] + [choice[n]])
    _crop(seq, t_cache, d_cache)
    return proposals[:n] + [choice[n]]


def round_forgets_seq(target, draft, seq, t_cache, d_cache, gamma):
    new = speculative_round(target, draft, list(seq), t_cache, d_cache, gamma)
    return new


def round_returns_nothing(target, draft, seq, t_cache, d_cache, gamma):
    speculative_round(target, draft, seq, t_cache, d_cache, gamma)


def round_returns_whole_sequence(target, draft, seq, t_cache, d_cache, gamma):
    speculative_round(target, draft, seq, t_cache, d_cache, gamma)
    return seq


def round_returns_float_tensor(target, draft, seq, t_cache, d_cache, gamma):
    return torch.tensor(speculative_round(target, draft, seq, t_cache, d_cache, gamma),
                        dtype=torch.float32)


def round_by_the_engine_core(target, draft, seq, t_cache, d_cache, gamma):
    from functools import partial
    proposals = _draft(draft, seq, d_cache, gamma)
    before = len(seq)
    minikv.verify_and_commit(
        seq, proposals, t_cache, lambda rows, c: target(torch.tensor([rows]), cache=c)[0],
        partial(ch04.accept_matching, sampling=minikv.SamplingParams(), first_position=before),
        other_caches={"draft": d_cache})
    return seq[before:]


def round_by_speculative_generate(target, draft, seq, t_cache, d_cache, gamma):
    minikv.speculative_generate(target, draft, seq, gamma + 1, gamma=gamma)
    return speculative_round(target, draft, seq, t_cache, d_cache, gamma)


ROUND_WRONG = [
    (round_crop_without_min, "crop(len(seq) - 1) without min"),
    (round_without_draft_crop, "do not crop the draft cache"),
    (round_one_target_pass_per_proposal, "one target pass each"),
    (round_without_bonus, "forget the bonus token"),
    (round_commits_draft_token, "commit the DRAFT's token at the first mismatch"),
    (round_off_by_one_rows, "off by one in the target's rows"),
    (round_keeps_every_match, "keep every proposal that matches"),
    (round_resets_draft, "reset the draft cache"),
    (round_resets_both, "reset the target cache"),
    (round_zeroes_unverified, "zero, reset or overwrite cache entries"),
    (round_zeroes_draft_values, "the draft cache's K/V"),
    (round_zeroes_last_layer, "the target cache's K/V"),
    (round_draft_feeds_last_token, "the draft's first pass feeds only the last committed token"),
    (round_target_without_cache, "feed the target the whole sequence again"),
    (round_forgets_seq, "append the committed tokens to seq in place"),
    (round_returns_nothing, "returned None"),
    (round_returns_whole_sequence, "append exactly the tokens you return"),
    (round_returns_float_tensor, "as a list of ints, not a torch.Tensor"),
    (round_by_the_engine_core, "called minikv's own minikv.engine.verify.verify_and_commit"),
    (round_by_speculative_generate, "called minikv's own minikv.engine.speculative"),
]


def test_speculative_round_solution_passes(capsys):
    ch04.check_speculative_round(speculative_round)
    assert capsys.readouterr().out.startswith("✓ speculative_round: all ")


def test_zeroing_only_the_stale_slots_is_accepted():
    ch04.check_speculative_round(round_zeroes_stale_slots)


@pytest.mark.parametrize("wrong, fragment", ROUND_WRONG, ids=[w.__name__ for w, _ in ROUND_WRONG])
def test_speculative_round_wrong_answer(wrong, fragment):
    with pytest.raises(CheckFailed, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        ch04.check_speculative_round(wrong)


def test_round_cases_cover_every_kind_of_round():
    """The checker's cases include fully accepted rounds (where the draft cache is shorter than
    the sequence), rejections of the first proposal and later ones, for every γ."""
    kinds = set()
    for seed, prompt, gamma in ch04.ROUND_CASES:
        target, draft = ch04.tiny_pair(seed)
        out = minikv.speculative_generate(target, draft, prompt, ch04.NEW_TOKENS + gamma,
                                          gamma=gamma, trace=True)
        for e in out.trace:
            if e.kind == "verify" and len(e.input_ids) == gamma:
                kinds.add((gamma, "all" if not e.rejected else "first" if not e.accepted
                           else "later"))
    gammas = {g for _, _, g in ch04.ROUND_CASES}
    assert gammas == set(range(1, 7))
    assert {(g, "all") for g in gammas} <= kinds and {(g, "first") for g in gammas} <= kinds
    assert {(g, "later") for g in gammas if g > 1} <= kinds


def test_round_cases_are_sound():
    """The engine's own speculative decoding equals target-only greedy on every checker case,
    with a clear argmax margin (no near-tie a different summation order could flip)."""
    for seed, prompt, gamma in ch04.ROUND_CASES:
        target, draft = ch04.tiny_pair(seed)
        n = ch04.NEW_TOKENS + gamma + 1
        spec = minikv.speculative_generate(target, draft, prompt, n, gamma=gamma)
        alone = minikv.generate(target, prompt, n, return_logits=True)
        assert spec.tokens == alone.tokens
        top2 = alone.logits.topk(2, dim=-1).values
        assert float((top2[:, 0] - top2[:, 1]).min()) > 1e-4


# --- exercise 2: the residual (a table; what it cannot state) -----------------------------------

def test_one_step_gives_p_only_with_the_rules_own_residual():
    """Soundness: the reference residual makes one speculative step give exactly p, under the
    chapter's rule (where it is the engine's) and another; the chapter's residual does not."""
    from minikv.engine.verify import residual_distribution

    def step(p, q, residual, a):  # draw x ~ q, accept with a(x), else draw from the residual
        return q * a + (1 - (q * a).sum()) * residual(p, q, a)
    for s in range(5):
        p, q = ch04._distributions(s)
        a, half = ch04.chapter_acceptance(p, q), ch04.chapter_acceptance(p, q) / 2
        assert torch.allclose(ch04.reference_residual(p, q, a), residual_distribution(p, q))
        for rule in (a, half):
            assert torch.allclose(step(p, q, ch04.reference_residual, rule), p, atol=1e-12)
        chapter_line = next(iter(ch04.RESIDUAL.mistakes.values()))
        assert not torch.allclose(step(p, q, chapter_line, half), p, atol=1e-3)


# --- exercise 3: α from a trace -------------------------------------------------------------------

def _verifies(trace):
    return [e for e in trace if e.kind == "verify"]


def alpha_from_trace(trace, index=None):
    accepted = judged = 0
    for e in _verifies(trace):
        n_ok, refused = len(e.accepted), len(e.rejected) > 0
        if index is None:
            accepted += n_ok
            judged += n_ok + refused
        elif n_ok > index:
            accepted += 1
            judged += 1
        elif n_ok == index and refused:
            judged += 1
    return accepted / judged if judged else None


def _pooled(wrong):
    """A wrong pooled estimator, with the right per-index one."""
    def alpha(trace, index=None):
        return wrong(trace) if index is None else alpha_from_trace(trace, index)
    alpha.__name__ = wrong.__name__
    return alpha


@_pooled
def alpha_accepted_over_proposed(trace):
    accepted = sum(len(e.accepted) for e in _verifies(trace))
    proposed = sum(len(e.input_ids) for e in _verifies(trace))
    return accepted / proposed if proposed else None


@_pooled
def alpha_counts_never_judged(trace):
    accepted = sum(len(e.accepted) for e in _verifies(trace))
    rejected = sum(len(e.rejected) for e in _verifies(trace))
    return accepted / (accepted + rejected) if accepted + rejected else None


@_pooled
def alpha_every_round_a_rejection(trace):
    accepted = sum(len(e.accepted) for e in _verifies(trace))
    rounds = len(_verifies(trace))
    return accepted / (accepted + rounds) if rounds else None


@_pooled
def alpha_mean_of_rounds(trace):
    rates = [len(e.accepted) / len(e.input_ids) for e in _verifies(trace) if e.input_ids]
    return sum(rates) / len(rates) if rates else None


@_pooled
def alpha_counts_target_token(trace):
    committed = sum(len(e.input_ids) for e in trace if e.kind == "commit")
    rejections = sum(bool(e.rejected) for e in _verifies(trace))
    return committed / (committed + rejections) if committed else None


def alpha_zero_when_nothing_judged(trace, index=None):  # the old convention
    value = alpha_from_trace(trace, index)
    return 0.0 if value is None else value


def alpha_nan_when_nothing_judged(trace, index=None):
    value = alpha_from_trace(trace, index)
    return float("nan") if value is None else value


def alpha_divides_by_zero(trace, index=None):
    if index is None:
        accepted = sum(len(e.accepted) for e in _verifies(trace))
        return accepted / (accepted + sum(bool(e.rejected) for e in _verifies(trace)))
    return alpha_from_trace(trace, index)


def alpha_as_tensor(trace, index=None):
    value = alpha_from_trace(trace, index)
    return None if value is None else torch.tensor(value)


def alpha_index_counts_unjudged(trace, index=None):  # proposal i judged in every round that made it
    if index is None:
        return alpha_from_trace(trace)
    rounds = [e for e in _verifies(trace) if len(e.input_ids) > index]
    ok = sum(len(e.accepted) > index for e in rounds)
    return ok / len(rounds) if rounds else None


def alpha_index_over_every_round(trace, index=None):
    if index is None:
        return alpha_from_trace(trace)
    rounds = _verifies(trace)
    ok = sum(len(e.accepted) > index for e in rounds)
    return ok / len(rounds) if rounds and ok else alpha_from_trace(trace, index)


def alpha_index_pooled(trace, index=None):  # ignores index
    return alpha_from_trace(trace)


def alpha_index_from_one(trace, index=None):  # index=1 taken as the first proposal
    return alpha_from_trace(trace, None if index is None else max(index - 1, 0))


ALPHA_WRONG = [
    (alpha_accepted_over_proposed, "accepted / proposed"),
    (alpha_counts_never_judged, "never judged"),
    (alpha_every_round_a_rejection, "every round counts as a rejection"),
    (alpha_mean_of_rounds, "average each round's rate"),
    (alpha_counts_target_token, "count the target's own token as an accepted proposal"),
    (alpha_zero_when_nothing_judged, r"return None \(n/a\), not a number"),
    (alpha_nan_when_nothing_judged, r"return None \(n/a\), not a number"),
    (alpha_divides_by_zero, "return None"),
    (alpha_as_tensor, "return a Python float, not a torch.Tensor"),
    (alpha_index_counts_unjudged, "never judged"),
    (alpha_index_over_every_round, "divide by every round"),
    (alpha_index_pooled, "pooled over every proposal"),
    (alpha_index_from_one, "index counts from 0"),
]


def test_alpha_solution_passes(capsys):
    ch04.check_alpha_from_trace(alpha_from_trace)
    assert capsys.readouterr().out.startswith("✓ alpha_from_trace: all ")


@pytest.mark.parametrize("wrong, fragment", ALPHA_WRONG, ids=[w.__name__ for w, _ in ALPHA_WRONG])
def test_alpha_wrong_answer(wrong, fragment):
    with pytest.raises(CheckFailed, match=fragment):
        ch04.check_alpha_from_trace(wrong)


def test_alpha_cases_include_the_edges():
    with torch.inference_mode():
        runs = list(ch04._alpha_cases())
    alphas = {label: out.stats.alpha for label, out in runs}
    assert 1.0 in alphas.values() and None in alphas.values()
    assert sum(a is not None and 0.3 < a < 0.97 for a in alphas.values()) >= 6
    # per index: α is not the same at every index of a round, and some index was never judged
    per_index = [ch04.reference_alpha(out.trace, i) for _, out in runs for i in range(3)]
    assert None in per_index and len({round(a, 3) for a in per_index if a is not None}) > 5


# --- exercise 4: choose γ (a table; what it cannot state) ------------------------------------

def gamma_crashes_at_alpha_1(alpha, c, max_gamma=16):
    values = [(1 - alpha ** (g + 1)) / ((1 - alpha) * (g * c + 1)) for g in range(1, max_gamma + 1)]
    return 1 + values.index(max(values))


def test_gamma_cases_have_a_clear_winner_or_an_exact_tie():
    for alpha, c, max_gamma in ch04.BEST_GAMMA.cases:
        values = sorted((ch04.speedup(alpha, c, g) for g in range(1, max_gamma + 1)), reverse=True)
        if len(values) > 1 and values[0] != values[1]:
            assert values[0] - values[1] > 1e-9 * values[0], (alpha, c, max_gamma)
    answers = {ch04.reference_best_gamma(*case) for case in ch04.BEST_GAMMA.cases}
    assert {1, 16} <= answers and len(answers) >= 6


# --- exercise 5 (predict, then measure): a draft that is never wrong ------------------------------

def predict_perfect_draft():
    P, N, gamma = 4, 30, 4
    left, rounds = N - 1, []
    while left:
        g = min(gamma, left - 1)
        rounds.append(g)
        left -= g + 1
    return {"target_passes": 1 + len(rounds), "draft_passes": sum(rounds),
            "target_kv": P + sum(g + 1 for g in rounds),
            "draft_kv": P + 1 + rounds[0] - 1 + sum(g + 1 for g in rounds[1:])}


def _predicting(**changes):
    def predict():
        return {**predict_perfect_draft(), **changes}
    predict.__name__ = "predict_" + "_".join(f"{k}_{v}" for k, v in changes.items())
    return predict


PREDICT_WRONG = [
    (_predicting(target_passes=6), "the prefill is a target pass too"),
    (_predicting(target_passes=9), "commits γ \\+ 1"),
    (_predicting(target_passes=30), "target-only decoding"),
    (_predicting(draft_passes=24), "the last round proposes only what the budget leaves"),
    (_predicting(draft_passes=29), "the bonus tokens come from the target"),
    (_predicting(target_kv=34), "never fed to the target"),
    (_predicting(target_kv=29), "you forgot the prompt"),
    (_predicting(target_kv=27), "γ \\+ 1 rows, not γ"),
    (_predicting(draft_kv=23), "one row per draft pass"),
    (_predicting(draft_kv=27), "you caught the draft up once"),
    (_predicting(draft_kv=33), "ends TWO behind"),
    (_predicting(draft_kv=7.5), "a count is a whole number"),
    (lambda: [7, 23, 33, 32], "as a dict"),
    (lambda: None, "did you forget to return it"),
    (lambda: {"passes": 7}, "as a dict"),
    (lambda: {"target_passes": minikv.speculative_generate(
        *[minikv.load_course_model("target", "cpu")[0]] * 2, [1, 2, 3, 4], 30,
        gamma=4).stats.target_passes, "draft_passes": 23, "target_kv": 33, "draft_kv": 32},
     "a prediction is made before the measurement"),
]


def test_predict_solution_passes(capsys):
    ch04.check_predict_perfect_draft(predict_perfect_draft)
    out = capsys.readouterr().out
    assert "✓ predict_perfect_draft: all 4 cases pass" in out
    assert "measured: 7 target and 23 draft passes, 33 and 32 K/V vectors" in out


@pytest.mark.parametrize("wrong, fragment", PREDICT_WRONG,
                         ids=[getattr(w, "__name__", str(i)) for i, (w, _) in
                              enumerate(PREDICT_WRONG)])
def test_predict_wrong_answer(wrong, fragment):
    with pytest.raises(CheckFailed, match=fragment):
        ch04.check_predict_perfect_draft(wrong)


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

def accept_sampled(p, q, proposals, generator):
    u = torch.rand(len(proposals), generator=generator)
    for i, x in enumerate(proposals):
        if u[i] * q[i, x] >= p[i, x]:
            residual = (p[i] - q[i]).clamp(min=0)
            return i, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    n = len(proposals)
    return n, int(torch.multinomial(p[n], 1, generator=generator))


def accept_draws_differently(p, q, proposals, generator):
    """Right, with the random numbers drawn one at a time: the distribution is what counts."""
    for i, x in enumerate(proposals):
        u = float(torch.rand(1, generator=generator))
        if u >= min(1.0, float(p[i, x] / q[i, x])):
            residual = (p[i] - q[i]).clamp(min=0)
            return i, int(torch.multinomial(residual, 1, generator=generator))
    return len(proposals), int(torch.multinomial(p[len(proposals)], 1, generator=generator))


def accept_patched_for_empty(p, q, proposals, generator):  # only the crash fixed
    i = 0
    u = torch.rand(len(proposals), generator=generator)
    for i, x in enumerate(proposals):
        if u[i] * q[i, x] >= p[i, x]:
            residual = (p[i] - q[i]).clamp(min=0)
            return i, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    return len(proposals), int(torch.multinomial(p[i], 1, generator=generator))


def accept_bonus_from_draft(p, q, proposals, generator):
    n = len(proposals)
    out = accept_sampled(p, q, proposals, generator)
    if out[0] == n and n:
        return n, int(torch.multinomial(q[n - 1], 1, generator=generator))
    return out


def accept_resamples_from_p(p, q, proposals, generator):
    u = torch.rand(len(proposals), generator=generator)
    for i, x in enumerate(proposals):
        if u[i] * q[i, x] >= p[i, x]:
            return i, int(torch.multinomial(p[i], 1, generator=generator))
    return len(proposals), int(torch.multinomial(p[len(proposals)], 1, generator=generator))


def accept_inverted_ratio(p, q, proposals, generator):
    u = torch.rand(len(proposals), generator=generator)
    for i, x in enumerate(proposals):
        if u[i] * p[i, x] >= q[i, x]:
            residual = (p[i] - q[i]).clamp(min=0)
            return i, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    return len(proposals), int(torch.multinomial(p[len(proposals)], 1, generator=generator))


def accept_everything(p, q, proposals, generator):
    n = len(proposals)
    return n, int(torch.multinomial(p[n], 1, generator=generator))


def accept_abs_residual(p, q, proposals, generator):
    u = torch.rand(len(proposals), generator=generator)
    for i, x in enumerate(proposals):
        if u[i] * q[i, x] >= p[i, x]:
            return i, int(torch.multinomial((p[i] - q[i]).abs(), 1, generator=generator))
    return len(proposals), int(torch.multinomial(p[len(proposals)], 1, generator=generator))


def accept_in_place(p, q, proposals, generator):
    p /= p.sum(-1, keepdim=True)  # "normalise the rows first", in place
    p[:, 0] += 0.01
    return accept_sampled(p, q, proposals, generator)


def accept_returns_tensors(p, q, proposals, generator):
    k, y = accept_sampled(p, q, proposals, generator)
    return torch.tensor(k), torch.tensor([y], dtype=torch.float32)


SAMPLED_WRONG = [
    (ch04.accept_sampled_buggy, "accept_sampled_buggy unchanged"),
    (accept_patched_for_empty, "LAST PROPOSAL's position"),
    (accept_bonus_from_draft, "the bonus token follows the draft's distribution"),
    (accept_resamples_from_p, "not from p"),
    (accept_inverted_ratio, "refused most"),
    (accept_everything, "every proposal is accepted"),
    (accept_abs_residual, r"not \|p - q\|"),
    (accept_in_place, "no in-place operations"),
    (accept_returns_tensors, "two ints"),
]


def test_accept_sampled_solution_passes(capsys):
    ch04.check_accept_sampled(accept_sampled)
    assert capsys.readouterr().out.startswith("✓ accept_sampled: all ")


def test_accept_sampled_is_judged_by_distribution_not_draw_order():
    ch04.check_accept_sampled(accept_draws_differently)


@pytest.mark.parametrize("wrong, fragment", SAMPLED_WRONG,
                         ids=[w.__name__ for w, _ in SAMPLED_WRONG])
def test_accept_sampled_wrong_answer(wrong, fragment):
    with pytest.raises(CheckFailed, match=fragment):
        ch04.check_accept_sampled(wrong)


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


# --- exercise 7 (design): γ for a batch, a table with a line printed before its ✓ -------------

def test_choose_gamma_solution_passes(capsys):
    ch04.check_choose_gamma(ch04.reference_choose_gamma)
    assert capsys.readouterr().out == (
        "  the best γ as the batch grows (α = 0.9, c = 0.05, balance = 64): 1 → 13, 4 → 13, "
        "16 → 3, 32 → 1, 48 → 1, 64 → 0, 128 → 0\n✓ choose_gamma: all 11 cases pass\n")


@pytest.mark.parametrize("hint, wrong", ch04.DESIGN.mistakes.items())
def test_choose_gamma_names_each_mistake(hint, wrong, capsys):
    with pytest.raises(CheckFailed) as info:
        ch04.check_choose_gamma(wrong)
    assert str(info.value).endswith(f"\n  hint: {hint}") and not capsys.readouterr().out


def test_design_cases_span_the_choices():
    answers = [ch04.reference_choose_gamma(*case) for case in ch04.DESIGN.cases]
    assert 0 in answers and 1 in answers and max(answers) >= 7
    # one request is the chapter's formula
    assert ch04.reference_choose_gamma(0.9, 0.05, 1, 64) == ch04.reference_best_gamma(0.9, 0.05, 16)


# --- all exercises --------------------------------------------------------------------------------

BEYOND_THE_TABLES = [  # wrong types, crashes, inputs changed in place
    (ch04.check_residual, lambda p, q, a: p.sub_(q * a).clamp_(min=0) / p.sum(),
     "in-place operations"),
    (ch04.check_residual, lambda p, q, a: np.maximum(p.numpy() - q.numpy() * a.numpy(), 0),
     "not a numpy.ndarray"),
    (ch04.check_residual, lambda p, q, a: ch04.reference_residual(p, q, a).tolist(), "not a list"),
    (ch04.check_best_gamma, gamma_crashes_at_alpha_1, "at α = 1 the formula is 0/0"),
    (ch04.check_best_gamma, lambda *case: float(ch04.reference_best_gamma(*case)),
     "return γ as an int, not a float"),
    (ch04.check_choose_gamma, lambda *case: float(ch04.reference_choose_gamma(*case)),
     "return γ as an int"),
]


@pytest.mark.parametrize("check, wrong, fragment", BEYOND_THE_TABLES)
def test_beyond_the_tables(check, wrong, fragment):
    with pytest.raises(CheckFailed, match=re.escape(fragment)):
        check(wrong)


CHECKS = [(ch04.check_speculative_round, speculative_round),
          (ch04.check_alpha_from_trace, alpha_from_trace),
          (ch04.check_predict_perfect_draft, predict_perfect_draft),
          (ch04.check_accept_sampled, accept_sampled),
          (ch04.check_choose_gamma, ch04.reference_choose_gamma)]


@pytest.mark.parametrize("check", [c for c, _ in CHECKS], ids=lambda c: c.__name__)
def test_stub_raises_not_implemented(check):
    with pytest.raises(NotImplementedError):
        check(stub)


def test_checkers_leave_the_random_state_alone():
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    for check, solution in CHECKS:
        check(solution)
    assert torch.equal(before, torch.random.get_rng_state())


def test_checkers_are_fast():
    import time
    for check, solution in CHECKS:
        start = time.perf_counter()
        check(solution)
        assert time.perf_counter() - start < 5, check.__name__


def test_speedup_is_the_formula_and_its_limit_at_alpha_1():
    assert math.isclose(ch04.speedup(0.5, 0.1, 3), (1 - 0.5 ** 4) / (0.5 * 1.3))
    assert math.isclose(ch04.speedup(1.0, 0.1, 3), 4 / 1.3)
    assert math.isclose(ch04.speedup(1 - 1e-9, 0.1, 3), 4 / 1.3, rel_tol=1e-6)


def test_a_patched_checker_does_not_silence_the_check_cell(monkeypatch):
    """An exercise cell that replaces the checker changes nothing: the check cell loads a fresh
    copy from the package."""
    import minikv.course.checks as checks
    monkeypatch.setattr(ch04, "check_choose_gamma", lambda fn: print("✓ choose_gamma: all"))
    with pytest.raises(CheckFailed):
        checks.fresh("ch04").check_choose_gamma(lambda *case: 16)
