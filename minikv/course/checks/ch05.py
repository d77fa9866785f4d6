"""Checkers for chapter 05 (seed 001, deterministic requests: no rollback; seed 004's rollback
shape).

The commit rule is checked against the engine's own judge (`verify.accept_matching`), the
batch-invariant sum against a fixed chunked schedule bit for bit (and against itself across split
counts), and the verification schedule against the counters of real `serve` runs on a tiny random
model. Everything runs on the CPU in well under a second and leaves the caller's random state alone.
"""
from __future__ import annotations

import math
import random
from contextlib import contextmanager

import torch

from ...engine import GPT, Request, SamplingParams, serve
from ...engine.verify import accept_matching
from . import call, expect, fail, passed, random_windows, tiny_model

_MODELS: dict[str, GPT] = {}


def _tiny() -> GPT:
    """A small random GPT on the CPU whose greedy output wanders, built once, without touching the
    caller's RNG."""
    if "tiny" not in _MODELS:
        _MODELS["tiny"] = tiny_model(0)
    return _MODELS["tiny"]


@contextmanager
def _one_thread():
    """Tiny models decode fastest on one thread, and stay fast when other work shares the CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


# --- exercise 1: the first-mismatch commit rule ---------------------------------------------------

def _engine_commit(proposals: list[int], verified: list[int]) -> tuple[list[int], int]:
    """What the engine commits: accept_matching on logits whose argmax is the verifier's token at
    each row."""
    logits = torch.full((len(verified), 64), -1.0)
    logits[torch.arange(len(verified)), torch.tensor(verified)] = 1.0
    verdict = accept_matching(logits, proposals, SamplingParams(), 0)
    return proposals[:verdict.accepted] + [verdict.token], len(proposals) - verdict.accepted


def check_commit_window(commit_window) -> None:
    """commit_window(proposals, verified) -> (committed tokens, proposals rolled back), as the
    engine judges."""
    name = "commit_window"
    cases = [
        # seed 001: all three match → commit them and the verifier's T4, no rollback
        ([7, 8, 9], [7, 8, 9, 10]),
        # seed 004: T1 accepted, T2 rejected (T3 matches again, but too late)
        ([7, 8, 9], [7, 5, 9, 10]),
        ([7, 8, 9], [1, 8, 9, 10]),   # the very first proposal is wrong
        ([7, 8, 9], [7, 8, 1, 10]),   # the last proposal is wrong
        ([], [4]),                    # window 1: nothing proposed, the verifier's token alone
        ([3], [3, 3]),                # the bonus may repeat a token
        ([3], [4, 3]),
        ([5, 5, 5, 5, 5, 5, 5], [5, 5, 5, 5, 5, 5, 5, 5]),
    ]
    # small vocabulary, so long matching prefixes and late mismatches both happen
    cases += random_windows(random.Random(5), 24, lengths=(0, 8), vocab=3, agree=0.8)
    for proposals, verified in cases:
        case = f"proposals={proposals}, verified={verified}"
        want = _engine_commit(proposals, verified)
        got = call(name, case, commit_window, list(proposals), list(verified))
        if not (isinstance(got, (tuple, list)) and len(got) == 2):
            fail(name, case, want, got,
                 "return a pair: (committed tokens, number of proposals rolled back)")
        committed, rolled_back = got
        expect(isinstance(committed, (list, tuple)) and [int(t) for t in committed] == want[0],
               name, case, want, got,
               "commit the proposals up to the first mismatch, then the VERIFIER's token there "
               "(or its extra token after the last proposal when all match)")
        expect(isinstance(rolled_back, int) and not isinstance(rolled_back, bool)
               and rolled_back == want[1],
               name, case, want, got,
               "rolled back = proposals thrown away: the first mismatch and everything after it "
               "(0 means no rollback)")
    passed(name, len(cases))


# --- exercise 2: a batch-invariant sum ------------------------------------------------------------

def _fixed_schedule_sum(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """The one schedule: chunk sums x[i:i+chunk].sum(), added left to right."""
    sums = [x[i:i + chunk].sum() for i in range(0, x.numel(), chunk)]
    total = sums[0]
    for s in sums[1:]:
        total = total + s
    return total


def check_invariant_split_sum(invariant_split_sum) -> None:
    """invariant_split_sum(x, n_splits, chunk) is the same float32 bits for every n_splits, and the
    fixed schedule's."""
    name = "invariant_split_sum"
    g = torch.Generator().manual_seed(0)
    vectors = []
    for n, chunk in [(1, 16), (15, 16), (16, 16), (17, 16), (100, 16), (257, 16), (1000, 16),
                     (4096, 16), (103, 5)]:
        # magnitudes from 1e-3 to 1e3: the summation order shows in the last bits
        x = torch.randn(n, generator=g) * 10 ** (torch.rand(n, generator=g) * 6 - 3)
        vectors.append((x.float(), chunk))
    splits = [1, 2, 3, 4, 7, 8, 13, 64]
    n_cases = 0
    for x, chunk in vectors:
        want = _fixed_schedule_sum(x, chunk)
        truth = float(x.double().sum())
        first = None
        for n_splits in splits:
            case = f"x of {x.numel()} float32 values, chunk={chunk}, n_splits={n_splits}"
            got = call(name, case, invariant_split_sum, x.clone(), n_splits, chunk)
            if not (isinstance(got, torch.Tensor) and got.dim() == 0
                    and got.dtype == torch.float32):
                fail(name, case, "a 0-d float32 tensor", got,
                     "return the sum as a 0-d float32 tensor (e.g. from .sum())")
            expect(math.isclose(float(got), truth, rel_tol=1e-4, abs_tol=1e-3), name, case,
                   truth, float(got),
                   "that is not the sum of x: "
                   "is every chunk (the last, shorter one too) counted exactly once?")
            if first is None:
                first = got
            expect(torch.equal(got, first), name, case,
                   f"{float(first)!r} (what n_splits={splits[0]} gave)", float(got),
                   "your result depends on the number of splits: fix the chunk size, "
                   "never the chunk count, and merge the chunk sums in one fixed order")
            expect(torch.equal(got, want), name, case, float(want), float(got),
                   "the fixed schedule: chunk sums x[i:i+chunk].sum() "
                   "for i = 0, chunk, 2*chunk, ..., added one by one from left to right")
            n_cases += 1
    passed(name, n_cases)


# --- exercise 3: how many verifier passes and fast steps ------------------------------------------

def check_verify_schedule(verify_schedule) -> None:
    """verify_schedule(max_new_tokens, window) -> (rounds, fast_steps), against real serve()
    counters."""
    name = "verify_schedule"
    model = _tiny()
    others = [Request([11, 12, 13], 9, temperature=1.0, seed=1),
              Request([20, 21], 25, temperature=1.0, seed=2)]
    cases = [(1, 4), (2, 4), (4, 4), (5, 4), (6, 4), (10, 4), (13, 4), (30, 4), (10, 1), (7, 2),
             (8, 3), (20, 8), (5, 16), (33, 16)]
    for n, window in cases:
        with _one_thread():
            out = serve(model, [Request([1, 2, 3, 4], n, deterministic=True)] + others,
                        window=window)[0]
        assert out.stats.rollbacks == 0, ("checker case with a rollback: "
                                          "the formula only holds without rollbacks")
        want = (out.stats.rounds, out.stats.fast_steps)
        case = f"max_new_tokens={n}, window={window}"
        got = call(name, case, verify_schedule, n, window)
        expect(isinstance(got, (tuple, list)) and len(got) == 2 and tuple(got) == want,
               name, case, want, got,
               "the prefill gives the first new token for free; "
               "each verifier pass commits a whole window "
               "(window - 1 fast-path proposals + the verifier's own token), "
               "the last pass maybe fewer")
    passed(name, len(cases))
