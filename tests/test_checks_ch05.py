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


CHOOSE_WRONG = [
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

# --- exercise 3: verifier passes and fast steps ---------------------------------------------------


def verify_schedule(max_new_tokens, window):
    rounds = math.ceil((max_new_tokens - 1) / window)
    return rounds, max_new_tokens - 1 - rounds


def schedule_forgets_prefill(max_new_tokens, window):
    rounds = math.ceil(max_new_tokens / window)
    return rounds, max_new_tokens - rounds


def schedule_floor(max_new_tokens, window):
    rounds = (max_new_tokens - 1) // window
    return rounds, max_new_tokens - 1 - rounds


def schedule_fast_counts_all(max_new_tokens, window):
    rounds = math.ceil((max_new_tokens - 1) / window)
    return rounds, max_new_tokens - 1


def schedule_prefill_is_fast(max_new_tokens, window):
    rounds = math.ceil((max_new_tokens - 1) / window)
    return rounds, max_new_tokens - rounds


def schedule_full_windows(max_new_tokens, window):
    rounds = math.ceil((max_new_tokens - 1) / window)
    return rounds, rounds * (window - 1)


def schedule_floats(max_new_tokens, window):
    rounds = math.ceil((max_new_tokens - 1) / window)
    return float(rounds), (max_new_tokens - 1) - rounds + 0.0


def schedule_numpy(max_new_tokens, window):
    return np.array(verify_schedule(max_new_tokens, window))


def schedule_rounds_only(max_new_tokens, window):
    return math.ceil((max_new_tokens - 1) / window)


SCHEDULE_WRONG = [
    (schedule_forgets_prefill, "forget the prefill"),
    (schedule_floor, "round the number of passes down"),
    (schedule_fast_counts_all, "every token after T₀ counts as a fast step"),
    (schedule_prefill_is_fast, "T₀ counts as a fast step"),
    (schedule_full_windows, "every window is full"),
    (schedule_floats, "both counts are ints"),
    (schedule_numpy, "not a numpy.ndarray"),
    (schedule_rounds_only, "not an int"),
]

CHECKS = {
    "choose": (ch05.check_choose, choose, CHOOSE_WRONG),
    "invariant_split_sum": (ch05.check_invariant_split_sum, invariant_split_sum, SPLIT_SUM_WRONG),
    "verify_schedule": (ch05.check_verify_schedule, verify_schedule, SCHEDULE_WRONG),
}


@pytest.mark.parametrize("name", CHECKS)
def test_solution_passes(name, capsys):
    checker, solution, _ = CHECKS[name]
    checker(solution)
    assert capsys.readouterr().out.startswith(f"✓ {name}: all ")


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
