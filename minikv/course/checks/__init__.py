"""Checkers for the course exercises (solutions/ and exercises/): one module per chapter.

A checker runs the learner's function on small cases, compares with the engine (or with a known
answer), and on the first wrong case raises CheckFailed naming the input, what was expected and
what came back. On success it prints one stable line, which nbval compares with the solution's
output.
"""
from __future__ import annotations

import random

import torch

from ...engine import GPT, GPTConfig


class CheckFailed(AssertionError):
    """An exercise gave a wrong answer; the message says on which input and how."""


def fail(exercise: str, case: str, expected, got, hint: str = "") -> None:
    message = f"{exercise}: wrong for {case}\n  expected: {expected!r}\n  got:      {got!r}"
    raise CheckFailed(message + (f"\n  hint: {hint}" if hint else ""))


def expect(condition: bool, exercise: str, case: str, expected, got, hint: str = "") -> None:
    if not condition:
        fail(exercise, case, expected, got, hint)


def call(exercise: str, case: str, fn, *args, **kwargs):
    """Run the learner's function; a crash becomes a failed case that names the input."""
    try:
        return fn(*args, **kwargs)
    except NotImplementedError:
        raise
    except Exception as e:  # noqa: BLE001 - any crash is a wrong answer for this case
        fail(exercise, case, "a result", f"{type(e).__name__}: {e}",
             "your function raised on this input")


def passed(exercise: str, n_cases: int) -> None:
    print(f"✓ {exercise}: all {n_cases} cases pass")


def random_windows(rng: random.Random, n_windows: int, lengths: tuple[int, int], vocab: int,
                   agree: float) -> list[tuple[list[int], list[int]]]:
    """Random speculative windows (proposals, verified): rng.randint(*lengths) proposals drawn from
    range(vocab), and the verifier's tokens, each the proposal's with probability `agree` (else
    drawn afresh), plus one more after the last proposal."""
    windows = []
    for _ in range(n_windows):
        n = rng.randint(*lengths)
        proposals = [rng.randrange(vocab) for _ in range(n)]
        verified = ([p if rng.random() < agree else rng.randrange(vocab) for p in proposals]
                    + [rng.randrange(vocab)])
        windows.append((proposals, verified))
    return windows


def tiny_model(seed: int, std: float = 0.1, **config_overrides) -> GPT:
    """A small random GPT (the "tiny" preset) on the CPU, in eval mode, whose weight matrices are
    re-drawn from N(0, std): larger weights than the default init, so greedy tokens vary. Seeded
    with `seed` under `torch.random.fork_rng`, so the caller's random state is left alone."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT(GPTConfig.preset("tiny", **config_overrides)).eval()
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() > 1:
                    p.normal_(0.0, std)
    return model
