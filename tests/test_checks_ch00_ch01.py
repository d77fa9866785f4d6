"""Chapters 00 and 01: the checkers accept the solutions and reject plausible wrong answers."""
import pytest
import torch

import minikv
from minikv.checks import CheckFailed, ch00, ch01


def count_params(cfg):
    C = cfg.n_embd
    return cfg.vocab_size * C + cfg.block_size * C + cfg.n_layer * (12 * C * C + 13 * C) + 2 * C


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


def positions_fed(p, n):
    return [list(range(p))] + [[p + i] for i in range(n - 1)]


def test_solutions_pass(capsys):
    ch00.check_count_params(count_params)
    ch00.check_next_tokens(lambda logits: logits[:, -1].argmax(-1))
    ch01.check_greedy_decode(greedy_decode)
    ch01.check_positions_fed(positions_fed)
    assert capsys.readouterr().out.count("✓") == 4


@pytest.mark.parametrize("check, wrong", [
    (ch00.check_count_params, lambda cfg: count_params(cfg) + cfg.vocab_size * cfg.n_embd),   # counts the tied head twice
    (ch00.check_count_params, lambda cfg: count_params(cfg) - 2 * cfg.n_embd),                # forgets ln_f
    (ch00.check_next_tokens, lambda logits: logits[:, 0].argmax(-1)),                          # first position
    (ch00.check_next_tokens, lambda logits: logits.argmax(-1)),                                # every position
    (ch01.check_greedy_decode, naive_decode),                                                  # no cache
    (ch01.check_greedy_decode, lambda m, p, n, e=None: greedy_decode(m, p, n)),                # ignores EOS
    (ch01.check_positions_fed, lambda p, n: [list(range(p))] + [[p + i] for i in range(n)]),  # feeds the last token
    (ch01.check_positions_fed, lambda p, n: [list(range(p))] + [[0]] * (n - 1)),              # seed 003's position bug
])
def test_wrong_answers_fail(check, wrong):
    with pytest.raises(CheckFailed):
        check(wrong)
