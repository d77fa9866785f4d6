"""Chapter 04's checkers accept the solutions and reject plausible wrong answers."""
import pytest

from minikv.course.checks import CheckFailed, ch04

from conftest import stub


def accept_greedy(proposals, argmax):
    n = 0
    while n < len(proposals) and proposals[n] == argmax[n]:
        n += 1
    return n, argmax[n]


def residual(p, q):
    r = (p - q).clamp(min=0)
    return r / r.sum()


def rollback(t, d, n):
    for c in (t, d):
        c.crop(min(c.get_seq_length(), n - 1))


def test_solutions_pass(capsys):
    ch04.check_accept_greedy(accept_greedy)
    ch04.check_residual(residual)
    ch04.check_speculative_step(residual)
    ch04.check_rollback(rollback)
    assert capsys.readouterr().out.count("✓") == 4


@pytest.mark.parametrize("wrong", [
    # commits the draft's token
    lambda p, a: (accept_greedy(p, a)[0], p[min(accept_greedy(p, a)[0], len(p) - 1)]),
    # counts matches, not a prefix
    lambda p, a: (sum(x == y for x, y in zip(p, a)), a[accept_greedy(p, a)[0]]),
    # no bonus token
    lambda p, a: (accept_greedy(p, a)[0], None),
])
def test_wrong_accept_rules_fail(wrong):
    with pytest.raises(CheckFailed):
        ch04.check_accept_greedy(wrong)


@pytest.mark.parametrize("wrong", [
    # not normalised
    lambda p, q: (p - q).clamp(min=0),
    # |p - q| puts mass where the draft over-proposed
    lambda p, q: (p - q).abs() / (p - q).abs().sum(),
    # resample from p: biased towards the draft's tokens
    lambda p, q: p,
])
def test_wrong_residuals_fail(wrong):
    with pytest.raises(CheckFailed):
        ch04.check_residual(wrong)
    with pytest.raises(CheckFailed):
        ch04.check_speculative_step(wrong)


@pytest.mark.parametrize("wrong", [
    # keeps the uncomputed token's slot
    lambda t, d, n: [c.crop(min(c.get_seq_length(), n)) for c in (t, d)],
    # forgets the draft's cache
    lambda t, d, n: t.crop(min(t.get_seq_length(), n - 1)),
    # throws everything away
    lambda t, d, n: [c.reset() for c in (t, d)],
])
def test_wrong_rollbacks_fail(wrong):
    with pytest.raises(CheckFailed):
        ch04.check_rollback(wrong)


def test_stub_is_not_accepted():
    for check in (ch04.check_accept_greedy, ch04.check_residual, ch04.check_rollback):
        with pytest.raises(NotImplementedError):
            check(stub)
