"""Checkers for the course exercises (solutions/ and exercises/): one module per chapter.

A checker runs the learner's function on small cases, compares with the engine (or with a known
answer), and on the first wrong case raises CheckFailed naming the input, what was expected and what
came back. On success it prints one stable line, which nbval compares with the solution's output.
"""
from __future__ import annotations


class CheckFailed(AssertionError):
    """An exercise gave a wrong answer; the message says on which input and how."""


def fail(exercise: str, case: str, expected, got, hint: str = "") -> None:
    message = f"{exercise}: wrong for {case}\n  expected: {expected!r}\n  got:      {got!r}"
    raise CheckFailed(message + (f"\n  hint: {hint}" if hint else ""))


def expect(condition: bool, exercise: str, case: str, expected, got, hint: str = "") -> None:
    if not condition:
        fail(exercise, case, expected, got, hint)


def passed(exercise: str, n_cases: int) -> None:
    print(f"✓ {exercise}: all {n_cases} cases pass")
