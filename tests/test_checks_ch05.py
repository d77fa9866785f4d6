"""Chapter 05's checkers accept the solutions, let a stub's NotImplementedError through, and reject
plausible wrong answers with a hint that names the mistake, quickly, leaving the caller's random
state alone."""
import math

import numpy as np
import pytest
import torch

from minikv.course.checks import CheckFailed, ch05

from conftest import stub

# --- exercise 1: the same request draws the same tokens wherever it runs --------------------------


def choose(logits, seed, position, temperature):
    if temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    g = torch.Generator(device=logits.device).manual_seed(seed * 1_000_003 + position)
    return int(torch.multinomial(probs, 1, generator=g))


def choose_global_rng(logits, seed, position, temperature):
    if temperature == 0:
        return int(logits.argmax())
    return int(torch.multinomial(torch.softmax(logits / temperature, -1), 1))


def choose_reseeds_global_rng(logits, seed, position, temperature):
    if temperature == 0:
        return int(logits.argmax())
    torch.manual_seed(seed * 1_000_003 + position)
    return int(torch.multinomial(torch.softmax(logits / temperature, -1), 1))


_SHARED = torch.Generator().manual_seed(0)


def choose_shared_generator(logits, seed, position, temperature):
    if temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits / temperature, -1)
    return int(torch.multinomial(probs, 1, generator=_SHARED))


_PER_SEED = {}


def choose_generator_per_seed(logits, seed, position, temperature):  # made once per request
    if temperature == 0:
        return int(logits.argmax())
    g = _PER_SEED.setdefault(seed, torch.Generator().manual_seed(seed))
    return int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=g))


def choose_seed_only(logits, seed, position, temperature):
    if temperature == 0:
        return int(logits.argmax())
    g = torch.Generator().manual_seed(seed)
    return int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=g))


def choose_position_only(logits, seed, position, temperature):
    if temperature == 0:
        return int(logits.argmax())
    g = torch.Generator().manual_seed(position)
    return int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=g))


def choose_seed_plus_position(logits, seed, position, temperature):
    if temperature == 0:
        return int(logits.argmax())
    g = torch.Generator().manual_seed(seed + position)
    return int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=g))


def choose_ignores_temperature(logits, seed, position, temperature):
    if temperature == 0:
        return int(logits.argmax())
    return choose(logits, seed, position, 1.0)


def choose_multiplies_temperature(logits, seed, position, temperature):
    if temperature == 0:
        return int(logits.argmax())
    return choose(logits * temperature * temperature, seed, position, temperature)


def choose_samples_at_zero(logits, seed, position, temperature):
    return choose(logits, seed, position, temperature or 1.0)  # "avoid dividing by zero"


def choose_divides_by_zero(logits, seed, position, temperature):
    g = torch.Generator().manual_seed(seed * 1_000_003 + position)
    return int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=g))


def choose_always_argmax(logits, seed, position, temperature):
    return int(logits.argmax())


def choose_multinomial_on_logits(logits, seed, position, temperature):
    if temperature == 0:
        return int(logits.argmax())
    g = torch.Generator().manual_seed(seed * 1_000_003 + position)
    return int(torch.multinomial(logits / temperature, 1, generator=g))


def choose_in_place(logits, seed, position, temperature):
    if temperature == 0:
        return int(logits.argmax())
    logits /= temperature
    g = torch.Generator().manual_seed(seed * 1_000_003 + position)
    return int(torch.multinomial(torch.softmax(logits, -1), 1, generator=g))


def choose_returns_tensor(logits, seed, position, temperature):
    if temperature == 0:
        return logits.argmax()
    g = torch.Generator().manual_seed(seed * 1_000_003 + position)
    return torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=g)


def choose_by_the_engine(logits, seed, position, temperature):
    import minikv
    return minikv.SamplingParams(temperature, seed=seed).choose(logits, position)


def _mixed(mix, name):
    def choose_mixed(logits, seed, position, temperature):
        if temperature == 0:
            return int(logits.argmax())
        g = torch.Generator().manual_seed(mix(seed, position))
        return int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=g))
    choose_mixed.__name__ = name
    return choose_mixed


choose_seed_times_position = _mixed(lambda s, p: s * p, "choose_seed_times_position")
choose_seed_xor_position = _mixed(lambda s, p: s ^ p, "choose_seed_xor_position")
choose_small_multiplier = _mixed(lambda s, p: s * 1_000 + p, "choose_small_multiplier")
choose_multiplier_10k = _mixed(lambda s, p: s * 100_000 + p, "choose_multiplier_10k")
choose_hashed_pair = _mixed(lambda s, p: hash((s, p)) % 2**63, "choose_hashed_pair")
choose_string_pair = _mixed(lambda s, p: int.from_bytes(
    __import__("hashlib").sha256(f"{s}/{p}".encode()).digest()[:8], "big"), "choose_string_pair")


def test_other_good_mixes_are_accepted():
    """The exercise asks for a mix without collisions, not for the engine's constant."""
    ch05.check_choose(choose_hashed_pair)
    ch05.check_choose(choose_string_pair)


CHOOSE_WRONG = [
    (choose_seed_times_position, "seed \\* position"),
    (choose_seed_xor_position, "symmetric in seed and position"),
    (choose_small_multiplier, "seed \\* 1,000 \\+ position"),
    (choose_multiplier_10k, "seed \\* 100,000 \\+ position"),
    (choose_global_rng, "global RNG"),
    (choose_reseeds_global_rng, "torch.manual_seed inside choose"),
    (choose_shared_generator, "a generator shared across calls"),
    (choose_generator_per_seed, "a generator shared across calls"),
    (choose_seed_only, "seeded by the seed alone"),
    (choose_position_only, "seeded by the position alone"),
    (choose_seed_plus_position, r"seed \+ position"),
    (choose_ignores_temperature, "ignore the temperature"),
    (choose_multiplies_temperature, "multiply the logits by the temperature"),
    (choose_samples_at_zero, "sample at temperature 0"),
    (choose_divides_by_zero, "at temperature 0 choose is greedy"),
    (choose_always_argmax, "must DRAW from softmax"),
    (choose_multinomial_on_logits, "takes probabilities, not logits"),
    (choose_in_place, "in-place operation"),
    (choose_returns_tensor, "as a Python int"),
    (choose_by_the_engine, "called minikv's own minikv.engine.sampling.SamplingParams.choose"),
]

# --- exercise 2: a batch-invariant sum ------------------------------------------------------------


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


def split_kv_style_sum(x, n_splits, chunk=16):  # n_splits equal pieces, as split-KV cuts its keys
    size = math.ceil(x.numel() / n_splits)
    total = torch.zeros((), dtype=x.dtype)
    for w in range(n_splits):
        total = total + x[w * size:(w + 1) * size].sum()
    return total


def worker_totals_sum(x, n_splits, chunk=16):  # each worker adds up its own chunks first
    n_chunks = math.ceil(x.numel() / chunk)
    per_worker = math.ceil(n_chunks / n_splits)
    totals = []
    for w in range(n_splits):
        mine = [x[c * chunk:(c + 1) * chunk].sum()
                for c in range(w * per_worker, min((w + 1) * per_worker, n_chunks))]
        if mine:
            totals.append(sum(mine[1:], mine[0]))
    return sum(totals[1:], totals[0])


def stacked_merge_sum(x, n_splits, chunk=16):
    return torch.stack([x[i:i + chunk].sum() for i in range(0, x.numel(), chunk)]).sum()


def whole_sum(x, n_splits, chunk=16):  # invariant, but not the fixed schedule: torch's own order
    return x.sum()


def drops_last_chunk(x, n_splits, chunk=16):  # whole chunks only
    full = x.numel() // chunk * chunk
    return invariant_split_sum(x[:full], 1, chunk) if full else torch.zeros((), dtype=x.dtype)


def returns_float(x, n_splits, chunk=16):
    return float(invariant_split_sum(x, n_splits, chunk))


def returns_numpy(x, n_splits, chunk=16):
    return invariant_split_sum(x, n_splits, chunk).numpy()


def sums_in_float64(x, n_splits, chunk=16):
    return invariant_split_sum(x.double(), n_splits, chunk)


def sums_in_place(x, n_splits, chunk=16):
    total = invariant_split_sum(x, n_splits, chunk)
    x.zero_()  # "free" the input
    return total


SPLIT_SUM_WRONG = [
    (split_kv_style_sum, "n_splits equal pieces"),
    (worker_totals_sum, "each worker returns the total of its chunks"),
    (stacked_merge_sum, r"torch.stack\(...\).sum\(\)"),
    (whole_sum, r"x.sum\(\)"),
    (drops_last_chunk, "drop the last, shorter chunk"),
    (returns_float, "0-d float32 tensor"),
    (returns_numpy, "0-d float32 tensor"),
    (sums_in_float64, "no float64"),
    (sums_in_place, "in-place operations on x"),
]

# --- exercise 3: the verifier's schedule ----------------------------------------------------------


def verify_schedule(max_new_tokens, window):
    passes, first = [], 0
    while first < max_new_tokens - 1:
        k = min(window - 1, max_new_tokens - 2 - first)
        passes.append((first, k))
        first += k + 1
    return passes


def schedule_full_windows(max_new_tokens, window):
    return [(f, window - 1) for f, _ in verify_schedule(max_new_tokens, window)]


def schedule_floor(max_new_tokens, window):
    return [p for p in verify_schedule(max_new_tokens, window) if p[1] == window - 1]


def schedule_forgets_prefill(max_new_tokens, window):
    return verify_schedule(max_new_tokens + 1, window)


def schedule_first_proposal(max_new_tokens, window):
    return [(f + 1, k) for f, k in verify_schedule(max_new_tokens, window)]


def schedule_counts_own_token(max_new_tokens, window):
    return [(f, k + 1) for f, k in verify_schedule(max_new_tokens, window)]


def schedule_window_proposals(max_new_tokens, window):
    return verify_schedule(max_new_tokens, window + 1)


def schedule_counts(max_new_tokens, window):  # the old exercise's answer: (rounds, fast steps)
    rounds = math.ceil((max_new_tokens - 1) / window)
    return rounds, max_new_tokens - 1 - rounds


def schedule_floats(max_new_tokens, window):
    return [(float(f), float(k)) for f, k in verify_schedule(max_new_tokens, window)]


def schedule_numpy(max_new_tokens, window):
    return np.array(verify_schedule(max_new_tokens, window))  # a 2-D array is fine


SCHEDULE_WRONG = [
    (schedule_full_windows, "every pass judges window - 1 proposals"),
    (schedule_floor, "leave out the last, partial window"),
    (schedule_forgets_prefill, "forget the prefill"),
    (schedule_first_proposal, "not the first proposal"),
    (schedule_counts_own_token, "counts the pass's own token as a proposal"),
    (schedule_window_proposals, "window proposals per pass"),
    (schedule_counts, "return the list of passes"),
    (schedule_floats, "pairs of ints"),
]


def test_a_numpy_schedule_is_accepted():
    ch05.check_verify_schedule(schedule_numpy)


# --- exercise 4 (predict, then measure): the server's passes --------------------------------------

def predict_server_passes():
    steps, rounds = 19, 5
    return {0: steps, 1: steps + rounds, 4: steps - rounds + 4 * rounds}


def _predicting(**changes):
    def predict():
        return {**predict_server_passes(), **{int(k[1:]): v for k, v in changes.items()}}
    predict.__name__ = "predict_" + "_".join(f"{k}_{v}" for k, v in changes.items())
    return predict


PREDICT_WRONG = [
    (_predicting(d0=20), "19 decode steps make the other 19"),
    (_predicting(d0=76), "count passes, not rows"),
    (_predicting(d1=19), "verification is not free"),
    (_predicting(d1=23), "the last window is partial"),
    (_predicting(d4=39), "no batched pass runs at that step"),
    (_predicting(d4=24), "one pass per request per window"),
    (_predicting(d4=34.0), "a whole number"),
    (lambda: {"0": 19, "1": 24, "4": 34}, r"\{0: \.\.\., 1: \.\.\., 4: \.\.\.\}"),
    (lambda: None, "did you forget to return it"),
    (lambda: {0: 19, 1: 24, 4: ch05.server_passes(4)}, "a prediction is made before"),
]


def test_the_measured_passes_are_the_prediction():
    assert {d: ch05.server_passes(d) for d in range(5)} == {0: 19, 1: 24, 2: 29, 3: 34, 4: 34}


# --- exercise 5 (debug): a verifier window --------------------------------------------------------

def verify_window(model, seq, proposals, cache, sampling, start, window):
    rows = seq[start:] + proposals
    cache.crop(min(cache.get_seq_length(), start))
    padded = rows + [0] * (window - len(rows))
    logits = model(torch.tensor([padded]), cache=cache)[0]
    cache.crop(start + len(rows))
    first = len(seq) - 1 - start
    accepted = 0
    while accepted < len(proposals):
        if sampling.choose(logits[first + accepted], len(seq) + accepted) != proposals[accepted]:
            break
        accepted += 1
    token = sampling.choose(logits[first + accepted], len(seq) + accepted)
    seq.extend(proposals[:accepted] + [token])
    cache.crop(min(cache.get_seq_length(), len(seq) - 1))
    return accepted


def window_fixes_judging_only(model, seq, proposals, cache, sampling, start, window):
    """Judges at the right positions, but still draws its own token one position early."""
    rows = seq[start:] + proposals
    cache.crop(min(cache.get_seq_length(), start))
    logits = model(torch.tensor([rows + [0] * (window - len(rows))]), cache=cache)[0]
    cache.crop(start + len(rows))
    first, accepted = len(seq) - 1 - start, 0
    while accepted < len(proposals):
        if sampling.choose(logits[first + accepted], len(seq) + accepted) != proposals[accepted]:
            break
        accepted += 1
    token = sampling.choose(logits[first + accepted], len(seq) + accepted - 1)
    seq.extend(proposals[:accepted] + [token])
    cache.crop(min(cache.get_seq_length(), len(seq) - 1))
    return accepted


def window_without_crop_first(model, seq, proposals, cache, sampling, start, window):
    """Replays on top of the fast path's K/V: the rows land at the wrong positions."""
    rows = seq[start:] + proposals
    logits = model(torch.tensor([rows + [0] * (window - len(rows))]), cache=cache)[0]
    first, accepted = len(seq) - 1 - start, 0
    while accepted < len(proposals):
        if sampling.choose(logits[first + accepted], len(seq) + accepted) != proposals[accepted]:
            break
        accepted += 1
    token = sampling.choose(logits[first + accepted], len(seq) + accepted)
    seq.extend(proposals[:accepted] + [token])
    cache.crop(len(seq) - 1)
    return accepted


def window_keeps_padding(model, seq, proposals, cache, sampling, start, window):
    """Forgets the final rollback: the padding rows' K/V stay in the cache."""
    rows = seq[start:] + proposals
    cache.crop(min(cache.get_seq_length(), start))
    logits = model(torch.tensor([rows + [0] * (window - len(rows))]), cache=cache)[0]
    first, accepted = len(seq) - 1 - start, 0
    while accepted < len(proposals):
        if sampling.choose(logits[first + accepted], len(seq) + accepted) != proposals[accepted]:
            break
        accepted += 1
    seq.extend(proposals[:accepted] + [sampling.choose(logits[first + accepted],
                                                       len(seq) + accepted)])
    return accepted


def window_by_the_engine(model, seq, proposals, cache, sampling, start, window):
    return ch05._engine_window(model, seq, proposals, cache, sampling, start, window)


WINDOW_WRONG = [
    (ch05.verify_window_buggy, "verify_window_buggy unchanged"),
    (window_fixes_judging_only, "the verifier's own token wrong"),
    (window_without_crop_first, "replay the window's rows in ONE pass"),
    (window_keeps_padding, "the cache wrong"),
    (window_by_the_engine, "called minikv's own"),
]


# --- exercise 6 (design): batch-invariant kernels, or verification? -------------------------------

def choose_determinism(n_det, overhead):
    n, steps, rounds = 8, 19, 5
    verify = steps + n_det * rounds if n_det < n else steps - rounds + n * rounds
    return "verify" if verify <= steps * (1 + overhead) else "invariant"


def determinism_all_add(n_det, overhead):
    return "verify" if 19 + 5 * n_det <= 19 * (1 + overhead) else "invariant"


def determinism_one_pass_for_all(n_det, overhead):
    return "verify" if 19 + 5 * (n_det > 0) <= 19 * (1 + overhead) else "invariant"


def determinism_verify_free(n_det, overhead):
    return "verify"


def determinism_always_invariant(n_det, overhead):
    return "invariant"


def determinism_overhead_on_share(n_det, overhead):
    verify = 19 + 5 * n_det if n_det < 8 else 54
    return "verify" if verify <= 19 * (1 + overhead * n_det / 8) else "invariant"


def determinism_bool(n_det, overhead):
    return choose_determinism(n_det, overhead) == "verify"


DETERMINISM_WRONG = [
    (determinism_all_add, "no batched pass runs at that step"),
    (determinism_one_pass_for_all, "replayed ALONE"),
    (determinism_verify_free, "verification is not free"),
    (determinism_always_invariant, "nothing to verify"),
    (determinism_overhead_on_share, "on all the traffic"),
    (determinism_bool, 'return "verify" or "invariant"'),
]


CHECKS = {
    "choose": (ch05.check_choose, choose, CHOOSE_WRONG),
    "invariant_split_sum": (ch05.check_invariant_split_sum, invariant_split_sum, SPLIT_SUM_WRONG),
    "verify_schedule": (ch05.check_verify_schedule, verify_schedule, SCHEDULE_WRONG),
    "predict_server_passes": (ch05.check_predict_server_passes, predict_server_passes,
                              PREDICT_WRONG),
    "verify_window": (ch05.check_verify_window, verify_window, WINDOW_WRONG),
    "choose_determinism": (ch05.check_choose_determinism, choose_determinism,
                           DETERMINISM_WRONG),
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


def test_split_kv_style_sum_really_depends_on_the_split_count():
    """The lesson's premise: cutting into n_splits pieces changes the bits of a float32 sum."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1000, generator=g) * 10 ** (torch.rand(1000, generator=g) * 6 - 3)
    assert len({float(split_kv_style_sum(x, n)) for n in (1, 2, 3, 5, 8)}) > 1
    assert len({float(invariant_split_sum(x, n)) for n in (1, 2, 3, 5, 8)}) == 1


def test_the_engine_chooses_as_the_exercise_asks():
    """The solution is the engine's own SamplingParams.choose, token for token."""
    import minikv
    for i in range(50):
        logits = ch05._logits(i, vocab=20)
        for t in (0.0, 0.7, 1.5):
            want = minikv.SamplingParams(t, seed=i).choose(logits, 3 * i)
            assert choose(logits, i, 3 * i, t) == want


def test_checkers_leave_the_random_state_alone():
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    for checker, solution, _ in CHECKS.values():
        checker(solution)
    assert torch.equal(before, torch.random.get_rng_state())


def test_checkers_are_fast():
    import time
    for checker, solution, _ in CHECKS.values():
        start = time.perf_counter()
        checker(solution)
        assert time.perf_counter() - start < 5, checker.__name__


def test_a_patched_checker_does_not_silence_the_check_cell(monkeypatch):
    """An exercise cell that replaces the checker changes nothing: the check cell loads a fresh
    copy from the package."""
    import minikv.course.checks as checks
    monkeypatch.setattr(ch05, "check_choose", lambda fn: print("✓ choose: all cases pass"))
    with pytest.raises(CheckFailed):
        checks.fresh("ch05").check_choose(choose_global_rng)
