"""Chapter 04's checkers accept the solutions, let a stub's NotImplementedError through, and reject
plausible wrong answers with a hint that names the mistake; they are sound (the engine agrees with
them on every case they use) and leave the caller's random state alone."""
import math

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


def test_a_method_replaced_in_the_notebook_is_refused(monkeypatch):
    """A KVCache.crop that never grows a cache would let crop(len(seq) - 1) without min pass."""
    crop = minikv.KVCache.crop
    monkeypatch.setattr(minikv.KVCache, "crop",
                        lambda self, n: crop(self, min(n, self.get_seq_length())))
    with pytest.raises(CheckFailed, match="KVCache.crop is not the packaged one"):
        ch04.check_speculative_round(round_crop_without_min)


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


# --- exercise 2: the residual ---------------------------------------------------------------------

def residual(p, q):
    r = (p - q).clamp(min=0)
    return r / r.sum()


def residual_not_normalised(p, q):
    return (p - q).clamp(min=0)


def residual_abs(p, q):
    r = (p - q).abs()
    return r / r.sum()


def residual_is_p(p, q):
    return p


def residual_reversed(p, q):
    r = (q - p).clamp(min=0)
    return r / r.sum()


def residual_in_place(p, q):
    p.sub_(q).clamp_(min=0)
    return p / p.sum()


def residual_numpy(p, q):
    r = np.maximum(p.numpy() - q.numpy(), 0)
    return r / r.sum()


def residual_list(p, q):
    return residual(p, q).tolist()


RESIDUAL_WRONG = [
    (residual_not_normalised, "forget to normalise"),
    (residual_abs, r"\|p - q\|"),
    (residual_is_p, "resample from p itself"),
    (residual_reversed, r"max\(0, q - p\)"),
    (residual_in_place, "in-place operations"),
    (residual_numpy, "not a numpy.ndarray"),
    (residual_list, "not a list"),
]


def test_residual_solution_passes(capsys):
    ch04.check_residual(residual)
    assert capsys.readouterr().out.startswith("✓ residual: all ")


@pytest.mark.parametrize("wrong, fragment", RESIDUAL_WRONG,
                         ids=[w.__name__ for w, _ in RESIDUAL_WRONG])
def test_residual_wrong_answer(wrong, fragment):
    with pytest.raises(CheckFailed, match=fragment):
        ch04.check_residual(wrong)


def test_speculative_step_keeps_p_only_with_the_right_residual():
    p, q = ch04._distributions(1)
    assert torch.allclose(ch04.speculative_sample_distribution(p, q, residual), p, atol=1e-12)
    assert not torch.allclose(ch04.speculative_sample_distribution(p, q, residual_abs), p,
                              atol=1e-3)


# --- exercise 3: α from a trace -------------------------------------------------------------------

def _verifies(trace):
    return [e for e in trace if e.kind == "verify"]


def alpha_from_trace(trace):
    accepted = rejections = 0
    for e in _verifies(trace):
        accepted += len(e.accepted)
        rejections += len(e.rejected) > 0
    return accepted / (accepted + rejections) if accepted + rejections else 0.0


def alpha_accepted_over_proposed(trace):
    accepted = sum(len(e.accepted) for e in _verifies(trace))
    proposed = sum(len(e.input_ids) for e in _verifies(trace))
    return accepted / proposed if proposed else 0.0


def alpha_counts_never_judged(trace):
    accepted = sum(len(e.accepted) for e in _verifies(trace))
    rejected = sum(len(e.rejected) for e in _verifies(trace))
    return accepted / (accepted + rejected) if accepted + rejected else 0.0


def alpha_every_round_a_rejection(trace):
    accepted = sum(len(e.accepted) for e in _verifies(trace))
    rounds = len(_verifies(trace))
    return accepted / (accepted + rounds) if rounds else 0.0


def alpha_mean_of_rounds(trace):
    rates = [len(e.accepted) / len(e.input_ids) for e in _verifies(trace) if e.input_ids]
    return sum(rates) / len(rates) if rates else 0.0


def alpha_counts_target_token(trace):
    committed = sum(len(e.input_ids) for e in trace if e.kind == "commit")
    rejections = sum(bool(e.rejected) for e in _verifies(trace))
    return committed / (committed + rejections) if committed else 0.0


def alpha_divides_by_zero(trace):
    accepted = sum(len(e.accepted) for e in _verifies(trace))
    return accepted / (accepted + sum(bool(e.rejected) for e in _verifies(trace)))


def alpha_as_tensor(trace):
    return torch.tensor(alpha_from_trace(trace))


ALPHA_WRONG = [
    (alpha_accepted_over_proposed, "accepted / proposed"),
    (alpha_counts_never_judged, "never judged"),
    (alpha_every_round_a_rejection, "every round counts as a rejection"),
    (alpha_mean_of_rounds, "average each round's rate"),
    (alpha_counts_target_token, "count the target's own token as an accepted proposal"),
    (alpha_divides_by_zero, "return 0.0 then"),
    (alpha_as_tensor, "return a Python float, not a torch.Tensor"),
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
        alphas = {label: out.stats.alpha for label, out in ch04._alpha_cases()}
    assert 1.0 in alphas.values() and 0.0 in alphas.values()
    assert sum(0.3 < a < 0.97 for a in alphas.values()) >= 6


# --- exercise 4: choose γ -------------------------------------------------------------------------

def _value(alpha, c, g):
    tokens = g + 1 if alpha == 1 else (1 - alpha ** (g + 1)) / (1 - alpha)
    return tokens / (g * c + 1)


def best_gamma(alpha, c, max_gamma=16):
    best = 1
    for g in range(2, max_gamma + 1):
        if _value(alpha, c, g) > _value(alpha, c, best):
            best = g
    return best


def gamma_crashes_at_alpha_1(alpha, c, max_gamma=16):
    values = [(1 - alpha ** (g + 1)) / ((1 - alpha) * (g * c + 1)) for g in range(1, max_gamma + 1)]
    return 1 + values.index(max(values))


def gamma_zero_based(alpha, c, max_gamma=16):
    values = [_value(alpha, c, g) for g in range(1, max_gamma + 1)]
    return values.index(max(values))


def gamma_range_stops_early(alpha, c, max_gamma=16):
    values = [_value(alpha, c, g) for g in range(1, max_gamma)]
    return 1 + values.index(max(values)) if values else 1


def gamma_ties_to_larger(alpha, c, max_gamma=16):
    best = 1
    for g in range(2, max_gamma + 1):
        if _value(alpha, c, g) >= _value(alpha, c, best):
            best = g
    return best


def gamma_as_float(alpha, c, max_gamma=16):
    return float(np.argmax([_value(alpha, c, g) for g in range(1, max_gamma + 1)]) + 1)


def gamma_ignores_cost(alpha, c, max_gamma=16):
    return best_gamma(alpha, 0.0, max_gamma)


def gamma_exponent_gamma(alpha, c, max_gamma=16):
    def value(g):
        return (g if alpha == 1 else (1 - alpha ** g) / (1 - alpha)) / (g * c + 1)
    values = [value(g) for g in range(1, max_gamma + 1)]
    return 1 + values.index(max(values))


def gamma_nan_at_alpha_1(alpha, c, max_gamma=16):
    a = np.float64(alpha)
    with np.errstate(all="ignore"):
        values = [(1 - a ** (g + 1)) / ((1 - a) * (g * c + 1)) for g in range(1, max_gamma + 1)]
    return int(np.argmax(values)) + 1


GAMMA_WRONG = [
    (gamma_crashes_at_alpha_1, "at α = 1 the formula is 0/0"),
    (gamma_nan_at_alpha_1, "at α = 1 the formula is 0/0"),
    (gamma_zero_based, "counted from 0"),
    (gamma_range_stops_early, r"range\(1, max_gamma\)"),
    (gamma_ties_to_larger, "on a tie return the SMALLER"),
    (gamma_as_float, "return γ as an int, not a float"),
    (gamma_ignores_cost, "maximise tokens per target pass alone"),
    (gamma_exponent_gamma, "the exponent is γ \\+ 1"),
]


def test_best_gamma_solution_passes(capsys):
    ch04.check_best_gamma(best_gamma)
    assert capsys.readouterr().out.startswith("✓ best_gamma: all ")


@pytest.mark.parametrize("wrong, fragment", GAMMA_WRONG, ids=[w.__name__ for w, _ in GAMMA_WRONG])
def test_best_gamma_wrong_answer(wrong, fragment):
    with pytest.raises(CheckFailed, match=fragment):
        ch04.check_best_gamma(wrong)


def test_gamma_cases_have_a_clear_winner_or_an_exact_tie():
    for alpha, c, max_gamma in ch04.GAMMA_CASES:
        values = sorted((ch04.speedup(alpha, c, g) for g in range(1, max_gamma + 1)), reverse=True)
        if len(values) > 1 and values[0] != values[1]:
            assert values[0] - values[1] > 1e-9 * values[0], (alpha, c, max_gamma)
    answers = {ch04.reference_best_gamma(*case) for case in ch04.GAMMA_CASES}
    assert {1, 16} <= answers and len(answers) >= 6


# --- all exercises --------------------------------------------------------------------------------

CHECKS = [(ch04.check_speculative_round, speculative_round), (ch04.check_residual, residual),
          (ch04.check_alpha_from_trace, alpha_from_trace), (ch04.check_best_gamma, best_gamma)]


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
    """An exercise cell that replaces the checker (or empties its cases) changes nothing: the
    check cell loads a fresh copy from the package."""
    import minikv.course.checks as checks
    monkeypatch.setattr(ch04, "check_best_gamma", lambda fn: print("✓ best_gamma: all 6 cases"))
    monkeypatch.setattr(ch04, "GAMMA_CASES", [])
    with pytest.raises(CheckFailed):
        checks.fresh("ch04").check_best_gamma(gamma_ignores_cost)
