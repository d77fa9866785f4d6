"""Chapter 01: the checkers accept the solutions and reject plausible wrong answers."""
import pytest
import torch

import minikv
from minikv.course.checks import CheckFailed, ch01

from conftest import stub


def greedy_decode(model, prompt, n, eos_id=None):
    cache = minikv.KVCache.for_model(model, max_len=len(prompt) + n)
    tokens, idx = [], torch.tensor([prompt])
    with torch.inference_mode():
        while len(tokens) < n:
            token = int(model(idx, cache=cache)[0, -1].argmax())
            tokens.append(token)
            if token == eos_id:
                break
            idx = torch.tensor([[token]])
    return tokens


def naive_decode(model, prompt, n, eos_id=None):
    """Right tokens, but recomputes the whole sequence every step."""
    return minikv.generate(model, prompt, n, mode="naive", eos_id=eos_id).tokens


def eos_fed_decode(model, prompt, n, eos_id=None):
    """Right tokens, but feeds the last token too (one K/V vector too many)."""
    cache = minikv.KVCache.for_model(model, max_len=len(prompt) + n + 1)
    tokens, idx = [], torch.tensor([prompt])
    with torch.inference_mode():
        for _ in range(n):
            token = int(model(idx, cache=cache)[0, -1].argmax())
            tokens.append(token)
            idx = torch.tensor([[token]])
            if token == eos_id:
                break
        model(idx, cache=cache)
    return tokens


def positions_fed(p, n):
    return [list(range(p))] + [[p + i] for i in range(n - 1)]


def cache_lengths(p, n):
    return [p + i for i in range(n)]


def test_solutions_pass(capsys):
    ch01.check_greedy_decode(greedy_decode)
    ch01.check_positions_fed(positions_fed)
    ch01.check_cache_lengths(cache_lengths)
    assert capsys.readouterr().out.count("✓") == 3


@pytest.mark.parametrize("check, wrong", [
    # no cache
    (ch01.check_greedy_decode, naive_decode),
    # feeds the last token
    (ch01.check_greedy_decode, eos_fed_decode),
    # ignores EOS
    (ch01.check_greedy_decode, lambda m, p, n, e=None: greedy_decode(m, p, n)),
    # one token short
    (ch01.check_greedy_decode, lambda m, p, n, e=None: greedy_decode(m, p, n, e)[:-1]),
    # feeds the last token
    (ch01.check_positions_fed, lambda p, n: [list(range(p))] + [[p + i] for i in range(n)]),
    # seed 003's position bug
    (ch01.check_positions_fed, lambda p, n: [list(range(p))] + [[0]] * (n - 1)),
    # off by one
    (ch01.check_cache_lengths, lambda p, n: [p + i + 1 for i in range(n)]),
    # one pass too many
    (ch01.check_cache_lengths, lambda p, n: [p + i for i in range(n + 1)]),
])
def test_wrong_answers_fail(check, wrong):
    with pytest.raises(CheckFailed):
        check(wrong)


def test_stub_fails():
    for check in (ch01.check_greedy_decode, ch01.check_positions_fed, ch01.check_cache_lengths):
        with pytest.raises(NotImplementedError):
            check(stub)
