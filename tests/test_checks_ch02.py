"""Chapter 02's checkers accept the solutions and reject stubs and plausible wrong answers,
quickly."""
import math

import pytest
import torch

from minikv.course.checks import CheckFailed, ch02

from conftest import stub


# --- exercise 1: cache bytes ---------------------------------------------------------------------
def cache_bytes(cfg, seq_len, batch_size=1, bytes_per_value=2, n_kv_head=None):
    heads = cfg.n_head if n_kv_head is None else n_kv_head
    return 2 * cfg.n_layer * batch_size * heads * seq_len * cfg.head_dim * bytes_per_value


def cache_bytes_no_v(cfg, seq_len, batch_size=1, bytes_per_value=2, n_kv_head=None):  # forgets V
    heads = cfg.n_head if n_kv_head is None else n_kv_head
    return cfg.n_layer * batch_size * heads * seq_len * cfg.head_dim * bytes_per_value


def cache_bytes_ignores_gqa(cfg, seq_len, batch_size=1, bytes_per_value=2, n_kv_head=None):
    return 2 * cfg.n_layer * batch_size * cfg.n_head * seq_len * cfg.head_dim * bytes_per_value


def cache_bytes_mib_float(cfg, seq_len, batch_size=1, bytes_per_value=2, n_kv_head=None):
    return cache_bytes(cfg, seq_len, batch_size, bytes_per_value, n_kv_head) / 2**20


# --- exercise 2: K/V work ------------------------------------------------------------------------
def kv_work(prompt_len, new_tokens):
    if new_tokens == 0:
        return 0, 0
    return new_tokens * prompt_len + new_tokens * (new_tokens - 1) // 2, prompt_len + new_tokens - 1


def kv_work_seed_formula(prompt_len, new_tokens):  # N(N+1)/2 and N: right only for a 1-token prompt
    return new_tokens * (new_tokens + 1) // 2, new_tokens


def kv_work_off_by_one(prompt_len, new_tokens):  # feeds the last new token too
    n = new_tokens
    return n * prompt_len + n * (n + 1) // 2, prompt_len + n


# --- exercise 3: position ids --------------------------------------------------------------------
def decode_positions(cache, n_new=1):
    start = cache.get_seq_length()
    return list(range(start, start + n_new))


def decode_positions_bug(cache, n_new=1):  # seed 003's wrong approach
    return list(range(n_new))


def decode_positions_capacity(cache, n_new=1):  # seed 003's size(2), on a preallocated buffer
    start = cache.keys[0].size(2)
    return list(range(start, start + n_new))


def decode_positions_plus_one(cache, n_new=1):
    start = cache.get_seq_length() + 1
    return torch.arange(start, start + n_new)


# --- exercise 4: cached attention ----------------------------------------------------------------
def cached_attention(q, k_cache, v_cache, k_new, v_new):
    k, v = torch.cat([k_cache, k_new], dim=2), torch.cat([v_cache, v_new], dim=2)
    weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.size(-1)), dim=-1)
    return weights @ v


# the training-time causal mask, misapplied
def cached_attention_tril(q, k_cache, v_cache, k_new, v_new):
    k, v = torch.cat([k_cache, k_new], dim=2), torch.cat([v_cache, v_new], dim=2)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))
    mask = torch.ones(1, k.size(2), dtype=torch.bool).tril()
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v


def cached_attention_unscaled(q, k_cache, v_cache, k_new, v_new):
    k, v = torch.cat([k_cache, k_new], dim=2), torch.cat([v_cache, v_new], dim=2)
    return torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v


def cached_attention_cache_only(q, k_cache, v_cache, k_new, v_new):  # forgets to append the new K/V
    if k_cache.size(2) == 0:
        return v_new
    return torch.softmax(q @ k_cache.transpose(-1, -2) / math.sqrt(q.size(-1)), dim=-1) @ v_cache


CASES = [
    (ch02.check_cache_bytes, cache_bytes, [cache_bytes_no_v, cache_bytes_ignores_gqa,
                                           cache_bytes_mib_float]),
    (ch02.check_kv_work, kv_work, [kv_work_seed_formula, kv_work_off_by_one]),
    (ch02.check_decode_positions, decode_positions, [decode_positions_bug,
                                                     decode_positions_capacity,
                                                     decode_positions_plus_one]),
    (ch02.check_cached_attention, cached_attention, [cached_attention_tril,
                                                     cached_attention_unscaled,
                                                     cached_attention_cache_only]),
]


@pytest.mark.parametrize("checker, solution, wrong", CASES,
                         ids=lambda x: getattr(x, "__name__", ""))
def test_checker_accepts_solution(checker, solution, wrong, capsys):
    checker(solution)
    assert capsys.readouterr().out.startswith(f"✓ {solution.__name__}: all ")


@pytest.mark.parametrize("checker, solution, wrong", CASES,
                         ids=lambda x: getattr(x, "__name__", ""))
def test_checker_rejects_wrong_answers(checker, solution, wrong):
    for fn in wrong:
        with pytest.raises(CheckFailed, match=solution.__name__):
            checker(fn)


@pytest.mark.parametrize("checker, solution, wrong", CASES,
                         ids=lambda x: getattr(x, "__name__", ""))
def test_checker_fails_on_stub(checker, solution, wrong):
    with pytest.raises(NotImplementedError):
        checker(stub)


def test_checkers_leave_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    ch02._MODELS.clear()
    ch02.check_decode_positions(decode_positions)
    assert torch.equal(torch.rand(3), expected)
