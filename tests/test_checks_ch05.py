"""Chapter 05's checkers accept the solutions and reject stubs and plausible wrong answers,
quickly."""
import math

import pytest
import torch

from minikv.course.checks import CheckFailed, ch05

from conftest import stub


# --- exercise 1: the first-mismatch commit rule ---------------------------------------------------
def commit_window(proposals, verified):
    for i, token in enumerate(proposals):
        if token != verified[i]:
            return proposals[:i] + [verified[i]], len(proposals) - i
    return proposals + [verified[-1]], 0


def commit_keeps_the_proposal(proposals, verified):  # commits the rejected fast-path token itself
    for i, token in enumerate(proposals):
        if token != verified[i]:
            return proposals[:i + 1], len(proposals) - i
    return proposals + [verified[-1]], 0


def commit_without_bonus(proposals, verified):  # forgets the verifier's extra token when all match
    for i, token in enumerate(proposals):
        if token != verified[i]:
            return proposals[:i] + [verified[i]], len(proposals) - i
    return list(proposals), 0


def commit_every_match(proposals, verified):  # keeps matches after the first mismatch too
    kept = [p for p, v in zip(proposals, verified) if p == v]
    return kept + [verified[len(kept)]], len(proposals) - len(kept)


# does not count the mismatching proposal as rolled back
def commit_off_by_one(proposals, verified):
    committed, rolled_back = commit_window(proposals, verified)
    return committed, max(rolled_back - 1, 0)


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


# n_splits equal pieces, as split-KV attention cuts its keys
def split_kv_style_sum(x, n_splits, chunk=16):
    size = math.ceil(x.numel() / n_splits)
    total = torch.zeros((), dtype=x.dtype)
    for w in range(n_splits):
        total = total + x[w * size:(w + 1) * size].sum()
    return total


def whole_sum(x, n_splits, chunk=16):  # invariant, but not the fixed schedule: torch's own order
    return x.sum()


def drops_last_chunk(x, n_splits, chunk=16):  # whole chunks only
    full = x.numel() // chunk * chunk
    return invariant_split_sum(x[:full], 1, chunk) if full else torch.zeros((), dtype=x.dtype)


def returns_float(x, n_splits, chunk=16):
    return float(invariant_split_sum(x, n_splits, chunk))


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


CHECKS = {
    "commit_window": (ch05.check_commit_window, commit_window,
                      [commit_keeps_the_proposal, commit_without_bonus, commit_every_match,
                       commit_off_by_one]),
    "invariant_split_sum": (ch05.check_invariant_split_sum, invariant_split_sum,
                            [split_kv_style_sum, whole_sum, drops_last_chunk, returns_float]),
    "verify_schedule": (ch05.check_verify_schedule, verify_schedule,
                        [schedule_forgets_prefill, schedule_floor, schedule_fast_counts_all]),
}


@pytest.mark.parametrize("name", CHECKS)
def test_solution_passes(name, capsys):
    checker, solution, _ = CHECKS[name]
    checker(solution)
    assert capsys.readouterr().out.startswith(f"✓ {name}: all ")


@pytest.mark.parametrize("name", CHECKS)
def test_stub_fails(name):
    with pytest.raises(NotImplementedError):
        CHECKS[name][0](stub)


@pytest.mark.parametrize("name, wrong", [(n, w) for n, (_, _, ws) in CHECKS.items() for w in ws],
                         ids=lambda v: v if isinstance(v, str) else v.__name__)
def test_wrong_answer_rejected(name, wrong):
    with pytest.raises(CheckFailed):
        CHECKS[name][0](wrong)


def test_split_kv_style_sum_really_depends_on_the_split_count():
    """The lesson's premise: cutting into n_splits pieces changes the bits of a float32 sum."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1000, generator=g) * 10 ** (torch.rand(1000, generator=g) * 6 - 3)
    assert len({float(split_kv_style_sum(x, n)) for n in (1, 2, 3, 5, 8)}) > 1
    assert len({float(invariant_split_sum(x, n)) for n in (1, 2, 3, 5, 8)}) == 1


def test_checkers_leave_the_random_state_alone():
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    for checker, solution, _ in CHECKS.values():
        checker(solution)
    assert torch.equal(before, torch.random.get_rng_state())
