"""α, the chance that the target accepts a judged proposal, estimated the way Leviathan et al.'s
formula defines it: accepted / (accepted + rejections)."""
import random

import pytest

from minikv.engine.records import VerifyStats
from minikv.engine.verify import Round, Verdict


def a_round(proposals: list[int], accepted: int, rolled_back: bool) -> Round:
    return Round(start=0, replayed=len(proposals) + 1, proposals=proposals,
                 verdict=Verdict(accepted, 0), cache_lens={"verifier": (int(rolled_back), 0)})


def synthetic_rounds(alpha: float, gamma: int, rounds: int, seed: int) -> VerifyStats:
    """Rounds of γ proposals, each accepted with probability α independently, judged in order
    until the first rejection (what the verify core does)."""
    rng = random.Random(seed)
    stats = VerifyStats()
    for _ in range(rounds):
        accepted = 0
        while accepted < gamma and rng.random() < alpha:
            accepted += 1
        stats.record(a_round([0] * gamma, accepted, rolled_back=accepted < gamma))
    return stats


@pytest.mark.parametrize("gamma", range(1, 9))
def test_alpha_estimate_is_unbiased_at_every_gamma(gamma):
    stats = synthetic_rounds(0.8, gamma, rounds=20_000, seed=gamma)
    assert abs(stats.alpha - 0.8) <= 0.02


def test_accepted_over_proposed_is_not_alpha():
    """accepted / proposed counts the never-judged proposals after a rejection as rejected: at
    γ = 8 it reads about 0.42 for a true α of 0.8: α(1 - α^γ) / ((1 - α) γ)."""
    stats = synthetic_rounds(0.8, 8, rounds=20_000, seed=0)
    assert abs(stats.acceptance_rate - 0.8 * (1 - 0.8**8) / (0.2 * 8)) <= 0.02
    assert abs(stats.alpha - 0.8) <= 0.02


def test_record_counts_a_round():
    stats = VerifyStats()
    stats.record(a_round([1, 2, 3], 1, rolled_back=True))
    stats.record(a_round([4, 5], 2, rolled_back=False))
    assert (stats.rounds, stats.proposed, stats.accepted, stats.rejected) == (2, 5, 3, 2)
    assert (stats.rejected_rounds, stats.rollbacks) == (1, 1)
    assert stats.alpha == 3 / 4 and stats.acceptance_rate == 3 / 5


def test_alpha_is_none_when_nothing_was_judged():
    """No proposal judged estimates nothing: None, never 0.0 (which reads as "all rejected")."""
    stats = VerifyStats()
    assert stats.alpha is None
    stats.record(a_round([], 0, rolled_back=False))
    assert stats.alpha is None
    stats.record(a_round([7], 0, rolled_back=True))
    assert stats.alpha == 0.0
