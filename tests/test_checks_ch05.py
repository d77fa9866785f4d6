"""Chapter 05's checkers that are code (choose, predict_server_passes, verify_window) accept the
solutions, let a stub's NotImplementedError through and reject plausible wrong answers with a hint
that names the mistake, quickly, leaving the caller's random state alone. The tables
(invariant_split_sum, verify_schedule, choose_determinism) are tested from their own mistakes in
test_checks_table.py; here, only what a table cannot state: wrong types, inputs changed in place,
two mistakes at once, and independent solutions."""
import functools
import hashlib
import math

import numpy as np
import pytest
import torch

import minikv
from minikv.course.checks import CheckFailed, ch05

from conftest import stub

# --- exercise 1: the same request draws the same tokens wherever it runs --------------------------

def choose(logits, seed, position, temperature, mix=lambda s, p: s * 1_000_003 + p):
    if temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    g = torch.Generator(device=logits.device).manual_seed(mix(seed, position))
    return int(torch.multinomial(probs, 1, generator=g))


def _mixed(mix):
    """choose, with another mix of (seed, position) into the generator's seed."""
    return functools.partial(choose, mix=mix)


def _greedy_else(draw):
    """A choose that takes the argmax at temperature 0, and draw(logits, seed, position,
    temperature) otherwise."""
    def choose_(logits, seed, position, temperature):
        return int(logits.argmax()) if temperature == 0 else draw(logits, seed, position,
                                                                  temperature)
    return choose_


def _draw(weights, generator=None):
    return int(torch.multinomial(weights, 1, generator=generator))


def _soft(logits, temperature):
    return torch.softmax(logits / temperature, -1)


def _own(seed, position):
    return torch.Generator().manual_seed(seed * 1_000_003 + position)


_SHARED, _PER_SEED = torch.Generator().manual_seed(0), {}

CHOOSE_WRONG = [
    (_mixed(lambda s, p: s * p), r"seed \* position"),
    (_mixed(lambda s, p: s ^ p), "symmetric in seed and position"),
    (_mixed(lambda s, p: s * 1_000 + p), r"seed \* 1,000 \+ position"),
    (_mixed(lambda s, p: s * 100_000 + p), r"seed \* 100,000 \+ position"),
    (_mixed(lambda s, p: s), "seeded by the seed alone"),
    (_mixed(lambda s, p: p), "seeded by the position alone"),
    (_mixed(lambda s, p: s + p), r"seed \+ position"),
    (_greedy_else(lambda x, s, p, t: _draw(_soft(x, t))), "global RNG"),
    (_greedy_else(lambda x, s, p, t: torch.manual_seed(s * 1_000_003 + p) and _draw(_soft(x, t))),
     "torch.manual_seed inside choose"),
    (_greedy_else(lambda x, s, p, t: _draw(_soft(x, t), _SHARED)), "a generator shared across"),
    (_greedy_else(lambda x, s, p, t: _draw(_soft(x, t), _PER_SEED.setdefault(  # one per request
        s, torch.Generator().manual_seed(s)))), "a generator shared across calls"),
    (_greedy_else(lambda x, s, p, t: choose(x, s, p, 1.0)), "ignore the temperature"),
    (_greedy_else(lambda x, s, p, t: choose(x * t * t, s, p, t)),
     "multiply the logits by the temperature"),
    (lambda x, s, p, t: choose(x, s, p, t or 1.0), "sample at temperature 0"),  # "no / 0"
    (lambda x, s, p, t: _draw(_soft(x, t), _own(s, p)), "at temperature 0 choose is greedy"),
    (lambda x, s, p, t: int(x.argmax()), "must DRAW from softmax"),
    (_greedy_else(lambda x, s, p, t: _draw(x / t, _own(s, p))), "takes probabilities, not logits"),
    (_greedy_else(lambda x, s, p, t: choose(x.div_(t), s, p, 1.0)), "in-place operation"),
    (lambda x, s, p, t: torch.tensor(choose(x, s, p, t)), "as a Python int"),
    (lambda x, s, p, t: minikv.SamplingParams(t, seed=s).choose(x, p),
     "called minikv's own minikv.engine.sampling.SamplingParams.choose"),
]


def test_other_good_mixes_are_accepted():
    """The exercise asks for a mix without collisions, not for the engine's constant."""
    ch05.check_choose(_mixed(lambda s, p: hash((s, p)) % 2**63))
    ch05.check_choose(_mixed(lambda s, p: int.from_bytes(
        hashlib.sha256(f"{s}/{p}".encode()).digest()[:8], "big")))


# --- the tables: what their mistakes cannot state ------------------------------------------------

def invariant_split_sum(x, n_splits, chunk=16):
    n_chunks = math.ceil(x.numel() / chunk)
    per_worker = math.ceil(n_chunks / n_splits)
    partials = []
    for w in range(n_splits):
        partials += [x[c * chunk:(c + 1) * chunk].sum()
                     for c in range(w * per_worker, min((w + 1) * per_worker, n_chunks))]
    total = partials[0]
    for p in partials[1:]:
        total = total + p
    return total


def sums_in_place(x, n_splits, chunk=16):
    total = invariant_split_sum(x, n_splits, chunk)
    x.zero_()  # "free" the input
    return total


def verify_schedule(max_new_tokens, window):
    passes, first = [], 0
    while first < max_new_tokens - 1:
        k = min(window - 1, max_new_tokens - 2 - first)
        passes.append((first, k))
        first += k + 1
    return passes


def schedule_counts(max_new_tokens, window):  # the old exercise's answer: (rounds, fast steps)
    rounds = math.ceil((max_new_tokens - 1) / window)
    return rounds, max_new_tokens - 1 - rounds


def choose_determinism(n_det, overhead):
    n, steps, rounds = 8, 19, 5
    verify = steps + n_det * rounds if n_det < n else steps - rounds + n * rounds
    return "verify" if verify <= steps * (1 + overhead) else "invariant"


TABLE_WRONG = [
    (ch05.check_invariant_split_sum, lambda x, n, c: float(invariant_split_sum(x, n, c)),
     "0-d float32 tensor"),
    (ch05.check_invariant_split_sum, lambda x, n, c: invariant_split_sum(x, n, c).numpy(),
     "0-d float32 tensor"),
    (ch05.check_invariant_split_sum, lambda x, n, c: invariant_split_sum(x.double(), n, c),
     "no float64"),
    (ch05.check_invariant_split_sum, sums_in_place, "in-place operations on x"),
    (ch05.check_invariant_split_sum, lambda x, n, c: invariant_split_sum(x, n, c + n - 1),
     "depends on the number of splits"),
    (ch05.check_verify_schedule, schedule_counts, "not the counts"),
    (ch05.check_verify_schedule, lambda n, w: [(float(f), float(k)) for f, k in
                                               verify_schedule(n, w)], "pairs of ints"),
    (ch05.check_verify_schedule, lambda n, w: None, "did you forget to return it"),
    (ch05.check_verify_schedule, lambda n, w: verify_schedule(n, w)[n], "raised on this input"),
    (ch05.check_verify_schedule, ch05.served_schedule, "called minikv's own"),
    (ch05.check_choose_determinism, lambda n, o: "invariant", "nothing to verify"),  # two at once
    (ch05.check_choose_determinism, lambda n, o: choose_determinism(n, o) == "verify",
     'return "verify" or "invariant"'),
]


@pytest.mark.parametrize("check, wrong, fragment", TABLE_WRONG, ids=lambda v: (
    v.replace(" ", "_")[:20] if isinstance(v, str) else None))
def test_a_table_rejects_what_its_mistakes_cannot_state(check, wrong, fragment):
    with pytest.raises(CheckFailed, match=fragment):
        check(wrong)


def test_independent_solutions_pass_the_tables():
    ch05.check_invariant_split_sum(invariant_split_sum)
    ch05.check_verify_schedule(verify_schedule)
    ch05.check_verify_schedule(lambda n, w: np.array(verify_schedule(n, w)))  # 2-D array: fine
    ch05.check_choose_determinism(choose_determinism)


def test_split_kv_style_sum_really_depends_on_the_split_count():
    """The lesson's premise: cutting into n_splits pieces changes the bits of a float32 sum."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1000, generator=g) * 10 ** (torch.rand(1000, generator=g) * 6 - 3)
    assert len({float(ch05._equal_pieces(x, n, 16)) for n in (1, 2, 3, 5, 8)}) > 1
    assert len({float(invariant_split_sum(x, n)) for n in (1, 2, 3, 5, 8)}) == 1


# --- exercise 4 (predict, then measure): the server's passes --------------------------------------

def predict_server_passes():
    steps, rounds = 19, 5
    return {0: steps, 1: steps + rounds, 4: steps - rounds + 4 * rounds}


@pytest.mark.parametrize("hint", ch05.PASSES_MISTAKES, ids=lambda h: h[:30])
def test_a_prediction_with_a_usual_mistake_is_named(hint):
    wrong = ch05.PASSES_MISTAKES[hint]
    with pytest.raises(CheckFailed) as info:
        ch05.check_predict_server_passes(lambda: {d: wrong(d) for d in ch05.PREDICT_D})
    assert str(info.value).endswith(hint)


PREDICT_WRONG = [
    (lambda: {**predict_server_passes(), 4: 34.0}, "a whole number"),
    (lambda: {"0": 19, "1": 24, "4": 34}, r"\{0: \.\.\., 1: \.\.\., 4: \.\.\.\}"),
    (lambda: None, "did you forget to return it"),
    (lambda: {0: 19, 1: 24, 4: ch05.server_passes(4)}, "a prediction is made before"),
    (lambda: {0: 19, 1: 23, 4: 39}, "the last window is partial"),  # two mistakes at once
]


def test_the_measured_passes_are_the_prediction():
    assert {d: ch05.server_passes(d) for d in range(5)} == {0: 19, 1: 24, 2: 29, 3: 34, 4: 34}


# --- exercise 5 (debug): a verifier window --------------------------------------------------------

def verify_window(model, seq, proposals, cache, sampling, start, window, *, judge_at=0, own_at=0,
                  crop_first=True, crop_after=True):
    """The fixed verifier; the keywords make the mistakes (positions off by judge_at, own_at)."""
    rows = seq[start:] + proposals
    if crop_first:
        cache.crop(min(cache.get_seq_length(), start))
    logits = model(torch.tensor([rows + [0] * (window - len(rows))]), cache=cache)[0]
    first, accepted = len(seq) - 1 - start, 0
    while accepted < len(proposals) and proposals[accepted] == sampling.choose(
            logits[first + accepted], len(seq) + accepted + judge_at):
        accepted += 1
    token = sampling.choose(logits[first + accepted], len(seq) + accepted + own_at)
    seq.extend(proposals[:accepted] + [token])
    if crop_after:
        cache.crop(min(cache.get_seq_length(), len(seq) - 1))
    return accepted


WINDOW_WRONG = [
    (ch05.verify_window_buggy, "verify_window_buggy unchanged"),
    (functools.partial(verify_window, judge_at=-1, own_at=-1), "verify_window_buggy unchanged"),
    (functools.partial(verify_window, own_at=-1), "the verifier's own token wrong"),
    (functools.partial(verify_window, crop_first=False), "replay the window's rows in ONE pass"),
    (functools.partial(verify_window, crop_after=False), "the cache wrong"),  # padding's K/V kept
    (ch05._engine_window, "called minikv's own"),
]


CHECKS = {
    "choose": (ch05.check_choose, choose, CHOOSE_WRONG),
    "predict_server_passes": (ch05.check_predict_server_passes, predict_server_passes,
                              PREDICT_WRONG),
    "verify_window": (ch05.check_verify_window, verify_window, WINDOW_WRONG),
}


@pytest.mark.parametrize("name", CHECKS)
def test_solution_passes(name, capsys):
    checker, solution, _ = CHECKS[name]
    checker(solution)
    assert f"✓ {name}: all " in capsys.readouterr().out


@pytest.mark.parametrize("name", CHECKS)
def test_stub_raises_not_implemented(name):
    with pytest.raises(NotImplementedError):
        CHECKS[name][0](stub)


@pytest.mark.parametrize("name, wrong, fragment",
                         [(n, w, f) for n, (_, _, ws) in CHECKS.items() for w, f in ws],
                         ids=lambda v: v if isinstance(v, str) and not v.isspace()
                         and len(v) < 25 else getattr(v, "__name__", None))
def test_wrong_answer_rejected_with_its_mistake_named(name, wrong, fragment):
    with pytest.raises(CheckFailed, match=fragment):
        CHECKS[name][0](wrong)


def test_the_engine_chooses_as_the_exercise_asks():
    """The solution is the engine's own SamplingParams.choose, token for token."""
    for i in range(50):
        logits = ch05._logits(i, vocab=20)
        for t in (0.0, 0.7, 1.5):
            want = minikv.SamplingParams(t, seed=i).choose(logits, 3 * i)
            assert choose(logits, i, 3 * i, t) == want


def test_checkers_leave_the_random_state_alone_and_are_fast():
    import time
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    for checker, solution, _ in CHECKS.values():
        start = time.perf_counter()
        checker(solution)
        assert time.perf_counter() - start < 5, checker.__name__
    assert torch.equal(before, torch.random.get_rng_state())
