"""Chapter 05's checkers that are code (choose, predict_server_passes, verify_window) accept the
solutions, let a stub's NotImplementedError through and name plausible mistakes, leaving the
caller's random state alone. The tables' own mistakes are tested in test_checks_table.py; here,
only what a table cannot state (wrong types, inputs changed in place, two mistakes at once) and
independent solutions."""
import hashlib
import math
import re
from functools import partial

import numpy as np
import pytest
import torch

import minikv
from minikv.course.checks import CheckFailed, ch05

from conftest import stub

CHOOSE, SPLIT, SCHEDULE, PASSES, WINDOW, DESIGN = (
    ch05.check_choose, ch05.check_invariant_split_sum, ch05.check_verify_schedule,
    ch05.check_predict_server_passes, ch05.check_verify_window, ch05.check_choose_determinism)


# --- exercise 1: the same request draws the same tokens wherever it runs --------------------------
def choose(logits, seed, position, temperature, mix=lambda s, p: s * 1_000_003 + p):
    if temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    g = torch.Generator(device=logits.device).manual_seed(mix(seed, position))
    return int(torch.multinomial(probs, 1, generator=g))


def _greedy_else(draw):  # the argmax at temperature 0, else draw(logits, seed, position, t)
    return lambda x, s, p, t: int(x.argmax()) if t == 0 else draw(x, s, p, t)


def _draw(weights, generator=None):
    return int(torch.multinomial(weights, 1, generator=generator))


def _soft(logits, temperature):
    return torch.softmax(logits / temperature, -1)


def _own(seed, position):
    return torch.Generator().manual_seed(seed * 1_000_003 + position)


_SHARED, _PER_SEED = torch.Generator().manual_seed(0), {}

CHOOSE_WRONG = [
    (partial(choose, mix=lambda s, p: s * p), r"seed \* position"),
    (partial(choose, mix=lambda s, p: s ^ p), "symmetric in seed and position"),
    (partial(choose, mix=lambda s, p: s * 1_000 + p), r"seed \* 1,000 \+ position"),
    (partial(choose, mix=lambda s, p: s * 100_000 + p), r"seed \* 100,000 \+ position"),
    (partial(choose, mix=lambda s, p: s), "seeded by the seed alone"),
    (partial(choose, mix=lambda s, p: p), "seeded by the position alone"),
    (partial(choose, mix=lambda s, p: s + p), r"seed \+ position"),
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


# --- the tables (independent solutions), then exercises 4 and 5 -----------------------------------
def invariant_split_sum(x, n_splits, chunk=16):
    n_chunks = math.ceil(x.numel() / chunk)
    per_worker = math.ceil(n_chunks / n_splits)
    partials = []
    for w in range(n_splits):
        partials += [x[c * chunk:(c + 1) * chunk].sum()
                     for c in range(w * per_worker, min((w + 1) * per_worker, n_chunks))]
    return sum(partials[1:], partials[0])  # one by one, from the left


def choose_determinism(n_det, overhead):
    n, steps, rounds = 8, 19, 5
    verify = steps + n_det * rounds if n_det < n else steps - rounds + n * rounds
    return "verify" if verify <= steps * (1 + overhead) else "invariant"


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


schedule = ch05.reference_schedule
SOLUTIONS = [  # (checker, a right answer): other mixes than the engine's, other forms
    (CHOOSE, choose), (CHOOSE, partial(choose, mix=lambda s, p: hash((s, p)) % 2**63)),
    (CHOOSE, partial(choose, mix=lambda s, p: int.from_bytes(
        hashlib.sha256(f"{s}/{p}".encode()).digest()[:8], "big"))),
    (SPLIT, invariant_split_sum), (SCHEDULE, lambda n, w: np.array(schedule(n, w))),  # 2-D array
    (PASSES, lambda: {0: 19, 1: 19 + 5, 4: 19 - 5 + 4 * 5}),  # 19 steps, 5 windows of 4
    (WINDOW, verify_window), (DESIGN, choose_determinism)]

WRONG = [(CHOOSE, wrong, fragment) for wrong, fragment in CHOOSE_WRONG] + [
    (SPLIT, lambda x, n, c: float(invariant_split_sum(x, n, c)), "0-d float32 tensor"),
    (SPLIT, lambda x, n, c: invariant_split_sum(x, n, c).numpy(), "0-d float32 tensor"),
    (SPLIT, lambda x, n, c: invariant_split_sum(x.double(), n, c), "no float64"),
    (SPLIT, lambda x, n, c: (invariant_split_sum(x, n, c), x.zero_())[0],  # "frees" the input
     "in-place operations on x"),
    (SPLIT, lambda x, n, c: invariant_split_sum(x, n, c + n - 1), "depends on the number of"),
    (SCHEDULE, lambda n, w: (math.ceil((n - 1) / w), n - 1 - math.ceil((n - 1) / w)),
     "not the counts"),  # the old exercise's answer: (rounds, fast steps)
    (SCHEDULE, lambda n, w: [(float(f), float(k)) for f, k in schedule(n, w)], "pairs of ints"),
    (SCHEDULE, lambda n, w: None, "did you forget to return it"),
    (SCHEDULE, lambda n, w: schedule(n, w)[n], "raised on this input"),
    (SCHEDULE, ch05.served_schedule, "called minikv's own"),
    (DESIGN, lambda n, o: "invariant", "nothing to replay"),  # two mistakes at once
    (DESIGN, lambda n, o: choose_determinism(n, o) == "verify", 'return "verify" or "invariant"'),
    (PASSES, lambda: {0: 19, 1: 24, 4: 34.0}, "a whole number"),
    (PASSES, lambda: {"0": 19, "1": 24, "4": 34}, r"\{0: \.\.\., 1: \.\.\., 4: \.\.\.\}"),
    (PASSES, lambda: None, "did you forget to return it"),
    (PASSES, lambda: {0: 19, 1: 24, 4: ch05.server_passes(4)}, "a prediction is made before"),
    (PASSES, lambda: {0: 19, 1: 23, 4: 39}, "the last window is partial"),  # two at once
    *[(PASSES, lambda wrong=wrong: {d: wrong(d) for d in ch05.PREDICT_D}, re.escape(hint) + r"\Z")
      for hint, wrong in ch05.PASSES_MISTAKES.items()],
    (WINDOW, partial(verify_window, judge_at=-1, own_at=-1), "verify_window_buggy unchanged"),
    (WINDOW, partial(verify_window, own_at=-1), "the verifier's own token wrong"),
    (WINDOW, partial(verify_window, crop_first=False), "replay the window's rows in ONE pass"),
    (WINDOW, partial(verify_window, crop_after=False), "the cache wrong"),  # padding's K/V kept
    (WINDOW, ch05._engine_window, "called minikv's own"),
]


def _id(v):
    return v.replace(" ", "_")[:20] if isinstance(v, str) else getattr(v, "__name__", None)


@pytest.mark.parametrize("checker, solution", SOLUTIONS, ids=_id)
def test_the_solutions_pass_and_the_random_state_stays(checker, solution, capsys):
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    checker(solution)
    assert "✓ " in capsys.readouterr().out
    assert torch.equal(before, torch.random.get_rng_state())


@pytest.mark.parametrize("checker", [CHOOSE, PASSES, WINDOW], ids=_id)
def test_a_stub_goes_through(checker):
    with pytest.raises(NotImplementedError):
        checker(stub)


@pytest.mark.parametrize("checker, wrong, fragment", WRONG, ids=_id)
def test_every_mistake_is_named(checker, wrong, fragment):
    with pytest.raises(CheckFailed, match=fragment):
        checker(wrong)


def test_the_engine_chooses_as_the_exercise_asks():
    """The solution is the engine's own SamplingParams.choose, token for token."""
    for i in range(50):
        logits = ch05._logits(i, vocab=20)
        for t in (0.0, 0.7, 1.5):
            want = minikv.SamplingParams(t, seed=i).choose(logits, 3 * i)
            assert choose(logits, i, 3 * i, t) == want
