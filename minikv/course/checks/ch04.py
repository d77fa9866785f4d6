"""Checkers for chapter 04 (seed 004, speculative decoding: verify and roll back).

The greedy accept rule is checked against the engine's own judge (`verify.accept_matching`), the
residual against `verify.residual_distribution` plus a sampling test of the whole
accept-or-resample step, and the rollback on real caches filled by a tiny random model. All on the
CPU, in well under a second, leaving the caller's random state alone.
"""
from __future__ import annotations

import random

import torch

from ...engine import GPT, GPTConfig, KVCache, SamplingParams
from ...engine.verify import accept_matching, residual_distribution
from . import call, expect, passed, random_windows

# --- exercise 1: the greedy accept rule -----------------------------------------------------------

def _greedy_cases() -> list[tuple[list[int], list[int]]]:
    cases = [([7, 8, 9], [7, 8, 9, 4]),   # all accepted: the bonus token 4
             ([7, 8, 9], [7, 5, 9, 4]),   # seed 004: T1' accepted, T2' rejected, T3' never judged
             ([7, 8, 9], [1, 8, 9, 4]),   # the first proposal is already wrong
             ([3], [3, 6]), ([3], [2, 6])]
    cases += random_windows(random.Random(4), 20, lengths=(1, 8), vocab=5, agree=0.7)
    return cases


def _as_int_pair(value):
    """(int, int) from a pair of ints or 0-d tensors; None for anything else."""
    try:
        n, token = value
        return int(n), int(token)
    except (TypeError, ValueError, RuntimeError):
        return None


def check_accept_greedy(accept_greedy) -> None:
    """accept_greedy(proposals, target_argmax) -> (n_accepted, token_to_commit)."""
    name = "accept_greedy"
    cases = _greedy_cases()
    for proposals, argmax in cases:
        # row i's argmax is argmax[i]
        logits = torch.nn.functional.one_hot(torch.tensor(argmax), 10).float()
        verdict = accept_matching(logits, proposals, SamplingParams(), 0)
        expected = (verdict.accepted, verdict.token)
        got = call(name, f"proposals={proposals}, target_argmax={argmax}", accept_greedy,
                   list(proposals), list(argmax))
        hint = ("accept while the target agrees; "
                "at the first disagreement commit the target's token; "
                "when all agree, the bonus is target_argmax[len(proposals)]")
        expect(_as_int_pair(got) == expected, name,
               f"proposals={proposals}, target_argmax={argmax}", expected, got, hint)
    passed(name, len(cases))


# --- exercise 2: the residual distribution --------------------------------------------------------

def _distributions(seed: int, n: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(n, generator=g, dtype=torch.float64) ** 3
    q = torch.rand(n, generator=g, dtype=torch.float64) ** 3
    return p / p.sum(), q / q.sum()


def check_residual(residual) -> None:
    """residual(p, q) -> norm(max(0, p - q))."""
    name = "residual"
    cases = [_distributions(s) for s in range(10)]
    cases.append((torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64),
                  torch.tensor([0.2, 0.6, 0.2], dtype=torch.float64)))
    for p, q in cases:
        case = f"p={[round(x, 3) for x in p.tolist()]}, q={[round(x, 3) for x in q.tolist()]}"
        got = call(name, case, residual, p.clone(), q.clone())
        expected = residual_distribution(p, q)
        ok = (isinstance(got, torch.Tensor) and got.shape == expected.shape
              and torch.allclose(got.double(), expected, atol=1e-9))
        expect(ok, name, case, [round(x, 4) for x in expected.tolist()],
               [round(x, 4) for x in got.tolist()] if isinstance(got, torch.Tensor) else got,
               "keep only where the target wants more than the draft, max(0, p - q), "
               "then divide by the sum")
    passed(name, len(cases))


def speculative_sample_distribution(p: torch.Tensor, q: torch.Tensor, residual,
                                    samples: int = 20000) -> torch.Tensor:
    """The distribution of one speculative step, in closed form: draw x ~ q, accept with
    min(1, p/q), else draw from residual(p, q). Leviathan et al. prove it equals p, whatever q
    is."""
    accept = torch.minimum(torch.ones_like(p), p / q.clamp(min=1e-300)) * (q > 0)
    rejected_mass = (q * (1 - accept)).sum()
    return q * accept + rejected_mass * residual(p, q)


def check_speculative_step(residual) -> None:
    """With the learner's residual, one accept-or-resample step must give exactly the target's p."""
    name = "speculative step keeps p"
    cases = [_distributions(s) for s in range(20, 30)]
    for p, q in cases:
        got = call(name, "p, q", speculative_sample_distribution, p, q, residual)
        expect(torch.allclose(got.double(), p, atol=1e-9), name,
               f"p={[round(x, 3) for x in p.tolist()]}",
               [round(x, 4) for x in p.tolist()], [round(x, 4) for x in got.tolist()],
               "the residual decides where rejected draws go; it must fill exactly p's shortfall")
    passed(name, len(cases))


# --- exercise 3: roll both caches back ------------------------------------------------------------

def _filled_caches(length: int) -> tuple[GPT, KVCache, KVCache]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = GPT(GPTConfig.preset("tiny")).eval()
        ids = torch.randint(0, model.config.vocab_size, (1, length))
    caches = []
    for _ in range(2):
        cache = KVCache.for_model(model, max_len=32)
        with torch.inference_mode():
            model(ids, cache=cache)
        caches.append(cache)
    return model, caches[0], caches[1]


def check_rollback(rollback) -> None:
    """rollback(target_cache, draft_cache, sequence_len) crops both caches to the last committed
    token."""
    name = "rollback"
    # (cached positions, committed sequence length)
    cases = [(12, 10), (12, 13), (9, 9), (5, 3), (20, 21)]
    for cached, seq_len in cases:
        case = f"both caches hold {cached} positions, the committed sequence has {seq_len} tokens"
        _, t_cache, d_cache = _filled_caches(cached)
        keep = min(cached, seq_len - 1)
        k_before = t_cache.keys[0][:, :, :keep].clone()
        call(name, case, rollback, t_cache, d_cache, seq_len)
        lengths = (t_cache.get_seq_length(), d_cache.get_seq_length())
        expect(lengths == (keep, keep), name, case, (keep, keep), lengths,
               "keep K/V up to the last committed token: the newest committed token has no K/V yet "
               "(it is fed next round); never grow a cache")
        expect(torch.equal(t_cache.keys[0][:, :, :keep], k_before), name, case,
               "the kept K/V unchanged", "the kept K/V changed",
               "crop only shortens the live length; it must not rewrite kept entries")
    passed(name, len(cases))
