"""Speculative decoding: exact under greedy, distribution-preserving under sampling, caches
restored on rollback."""
from functools import partial

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import minikv
from minikv.engine import verify
from minikv.engine.lookup import propose_by_lookup
from minikv.engine.speculative import speculate

from conftest import varied_model


def pair(dtype=torch.float64):
    """A tiny target, a close draft (mostly agrees: full rounds and bonus tokens) and a far one
    (rollbacks)."""
    target = varied_model("tiny", seed=0).to(dtype)
    close = varied_model("tiny", seed=0).to(dtype)
    with torch.no_grad():
        for p in close.parameters():
            p.add_(torch.randn_like(p) * 0.003)
    torch.manual_seed(7)
    far = minikv.GPT(minikv.GPTConfig.preset("tiny", n_layer=1, n_head=2,
                                             n_embd=32)).to(dtype).eval()
    return target, close, far


TARGET, CLOSE, FAR = pair()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompt=st.lists(st.integers(0, 511), min_size=1, max_size=12), gamma=st.integers(1, 8),
       close=st.booleans(), n=st.integers(1, 40))
def test_greedy_speculative_equals_target_greedy(prompt, gamma, close, n):
    """In float64: fp32 near-ties between the verify pass (γ+1 rows) and one-row decode could flip
    an argmax and make the comparison flaky without the algorithm being wrong; fp64 removes those
    ties."""
    draft = CLOSE if close else FAR
    expected = minikv.generate(TARGET, prompt, n).tokens
    out = minikv.speculative_generate(TARGET, draft, prompt, n, gamma=gamma)
    assert out.tokens == expected
    s = out.stats
    assert s.accepted + s.rejected == s.proposed and s.new_tokens == len(expected)
    assert s.target_passes == s.rounds + 1


def test_both_paths_are_exercised():
    close = minikv.speculative_generate(TARGET, CLOSE, [1, 2, 3], 60, gamma=4).stats
    far = minikv.speculative_generate(TARGET, FAR, [1, 2, 3], 60, gamma=4).stats
    assert close.acceptance_rate > 0.5 and close.tokens_per_target_pass > 2.5
    assert far.rollbacks > 5


def test_adaptive_gamma_stays_exact():
    expected = minikv.generate(TARGET, [4, 5], 50).tokens
    out = minikv.speculative_generate(TARGET, CLOSE, [4, 5], 50, gamma=2, adaptive_gamma=True,
                                      max_gamma=8, trace=True)
    assert out.tokens == expected
    # γ grew
    assert max(sum(e.kind == "draft" for e in out.trace if e.step == s) for s in range(1, 20)) > 2


def test_trace_tells_the_story_of_a_round():
    out = minikv.speculative_generate(TARGET, FAR, [1, 2, 3], 12, gamma=3, trace=True)
    kinds = [e.kind for e in out.trace]
    assert kinds[0] == "prefill" and kinds[1:5] == ["draft", "draft", "draft", "verify"]
    verify_event = out.trace[4]
    assert verify_event.positions == (4, 5, 6)  # prompt 0..2, T0 at 3, proposals T1'..T3' at 4..6
    acc, rej = verify_event.accepted, verify_event.rejected
    assert acc + rej == (4, 5, 6)
    if rej:
        rollback = out.trace[5]
        assert rollback.kind == "rollback" and rollback.cache_len_after == 4 + len(acc)


# --- speculative sampling keeps the target's distribution -----------------------------------------

V = 6
SMALL = minikv.GPTConfig(vocab_size=V, block_size=16, n_layer=1, n_head=2, n_embd=16)


def small_model(seed: int) -> minikv.GPT:
    torch.manual_seed(seed)
    model = minikv.GPT(SMALL).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                # peaked, different distributions: a wrong residual shows quickly
                p.normal_(0.0, 0.6)
    return model


def exact_pair_distribution(target, prompt) -> torch.Tensor:
    """p(t1, t2 | prompt) = p(t1 | prompt) p(t2 | prompt, t1), computed exactly by the target."""
    with torch.no_grad():
        p1 = torch.softmax(target(torch.tensor([prompt]))[0, -1], -1)
        rows = torch.tensor([prompt + [t] for t in range(V)])
        p2 = torch.softmax(target(rows)[:, -1], -1)
    return p1[:, None] * p2  # (V, V)


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    stat = ((counts - expected) ** 2 / expected).sum()
    dof = counts.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def sampled_pairs(target, draft, prompt, n) -> torch.Tensor:
    counts = torch.zeros(V, V, dtype=torch.float64)
    for seed in range(n):
        t1, t2 = minikv.speculative_generate(target, draft, prompt, 3, gamma=1, temperature=1.0,
                                             seed=seed).tokens[:2]
        counts[t1, t2] += 1
    return counts


N_SAMPLES, ALPHA = 3000, 1e-3  # 36 cells; 3000 draws; reject at p < 0.001


def test_speculative_sampling_matches_the_target_distribution():
    """t2 is the draft's proposal, accepted or replaced through the residual: its law must be the
    target's."""
    target, draft, prompt = small_model(1), small_model(2), [0, 3]
    probs = exact_pair_distribution(target, prompt)
    assert chi_square_p_value(sampled_pairs(target, draft, prompt, N_SAMPLES), probs) > ALPHA


def test_the_test_catches_a_wrong_residual(monkeypatch):
    """Resampling from p instead of norm(max(0, p - q)) biases t2 toward the draft; the same test
    rejects it."""
    monkeypatch.setattr(verify, "residual_distribution", lambda p, q: p)
    target, draft, prompt = small_model(1), small_model(2), [0, 3]
    probs = exact_pair_distribution(target, prompt)
    assert chi_square_p_value(sampled_pairs(target, draft, prompt, N_SAMPLES), probs) < ALPHA


# --- the shared core: rollback restores the cache exactly -----------------------------------------

def greedy_match(first_position: int):
    return partial(verify.accept_matching, sampling=minikv.SamplingParams(),
                   first_position=first_position)


def test_rollback_then_continue_equals_fresh_prefill():
    model = TARGET
    seq = [1, 2, 3, 4, 5]
    cache = minikv.KVCache.for_model(model, max_len=32)
    with torch.no_grad():
        model(torch.tensor([seq[:-1]]), cache=cache)
    truth = minikv.generate(model, seq, 8).tokens
    # one right, then wrong: roll back to length 6
    proposals = [truth[0], (truth[1] + 1) % 512, 7, 8]
    rnd = verify.verify_and_commit(seq, proposals, cache,
                                   lambda rows, c: model(torch.tensor([rows]), cache=c)[0],
                                   greedy_match(len(seq)))
    assert rnd.verdict == minikv.Verdict(accepted=1, token=truth[1])
    assert seq == [1, 2, 3, 4, 5] + truth[:2] and cache.get_seq_length() == len(seq) - 1
    assert rnd.cache_lens["verifier"] == (9, 6)
    fresh = minikv.KVCache.for_model(model, max_len=32)
    with torch.no_grad():
        model(torch.tensor([seq[:-1]]), cache=fresh)
    for a, b in zip(cache.keys + cache.values, fresh.keys + fresh.values):
        torch.testing.assert_close(a[:, :, :6], b[:, :, :6], atol=1e-12, rtol=0)
    assert minikv.generate(model, [seq[-1]], 6, cache=cache).tokens == truth[2:8]


def test_verifier_overwrites_proposer_kv():
    """Deterministic mode's guarantee: committed K/V are the authority's, not what the fast path
    wrote."""
    model = TARGET
    seq = [1, 2, 3]
    cache = minikv.KVCache.for_model(model, max_len=16)
    with torch.no_grad():
        model(torch.tensor([seq]), cache=cache)  # pretend a proposer already wrote position 2
        for t in cache.keys + cache.values:
            t[:, :, 2:] = 1e3  # garbage
        cache._length = 3
    token = minikv.generate(model, seq, 1).tokens[0]
    verify.verify_and_commit(seq, [token], cache,
                             lambda rows, c: model(torch.tensor([rows]), cache=c)[0],
                             greedy_match(len(seq)), start=2)
    fresh = minikv.KVCache.for_model(model, max_len=16)
    with torch.no_grad():
        model(torch.tensor([seq[:-1]]), cache=fresh)
    torch.testing.assert_close(cache.keys[1][:, :, :4], fresh.keys[1][:, :, :4], atol=1e-12, rtol=0)


# --- bad input ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(gamma=0), "gamma must be a positive int"),
    (dict(gamma=2.5), "gamma must be a positive int"),
    (dict(temperature=-1.0), "temperature"),
    (dict(top_k=0), "top_k"),
    (dict(max_new_tokens=300), "block_size"),
    (dict(adaptive_gamma=True, max_gamma=1, gamma=3), "max_gamma"),
])
def test_bad_arguments(kwargs, message):
    args = dict(max_new_tokens=5) | kwargs
    before = {k: v.clone() for k, v in TARGET.state_dict().items()}
    with pytest.raises(ValueError, match=message):
        minikv.speculative_generate(TARGET, CLOSE, [1, 2], **args)
    assert all(torch.equal(before[k], v) for k, v in TARGET.state_dict().items())


def test_mismatched_pair():
    other_vocab = minikv.GPT(minikv.GPTConfig.preset("tiny", vocab_size=600)).double()
    with pytest.raises(ValueError, match="the target's tokenizer"):
        minikv.speculative_generate(TARGET, other_vocab, [1], 3)
    with pytest.raises(ValueError, match="and device"):
        minikv.speculative_generate(TARGET, CLOSE.to("meta"), [1], 3)


# --- the seam: any propose(seq, k) plugs into the one round loop ----------------------------------

def oracle(prompt, n):
    """A proposer that knows the target's own greedy continuation: right every time."""
    truth = list(prompt) + minikv.generate(TARGET, prompt, n).tokens
    return lambda seq, k: truth[len(seq):len(seq) + k]


@pytest.mark.parametrize("gamma, n", [(1, 9), (3, 20), (4, 1), (5, 17)])
def test_a_third_proposer_plugs_in(gamma, n):
    """No frame copied: a plain function is a proposer. Never wrong, it has every proposal
    accepted, nothing rolled back, and each round commits k + 1 tokens."""
    prompt = [5, 6, 7]
    out = speculate(TARGET, prompt, n, minikv.SamplingParams(), oracle(prompt, n), gamma=gamma,
                    trace=True)
    assert out.tokens == minikv.generate(TARGET, prompt, n).tokens
    s = out.stats
    assert s.rounds == -(-(n - 1) // (gamma + 1)) and s.target_passes == s.rounds + 1
    assert s.accepted == s.proposed == n - 1 - s.rounds  # each round adds the target's token
    assert s.rejected == s.rollbacks == s.draft_passes == 0
    assert not any(e.kind == "rollback" for e in out.trace)


def test_adaptive_gamma_belongs_to_the_loop():
    """Any proposer gets adaptive γ: with a proposer that is never wrong, γ grows every round."""
    prompt, n = [5, 6, 7], 60
    fixed = speculate(TARGET, prompt, n, minikv.SamplingParams(), oracle(prompt, n), gamma=2)
    grown = speculate(TARGET, prompt, n, minikv.SamplingParams(), oracle(prompt, n), gamma=2,
                      max_gamma=6, trace=True)
    assert grown.tokens == fixed.tokens
    assert grown.stats.rounds < fixed.stats.rounds
    verified = [len(e.input_ids) for e in grown.trace if e.kind == "verify"]
    assert verified[:6] == [2, 3, 4, 5, 6, 6]


def test_a_sure_proposer_under_sampling_keeps_the_targets_draws():
    """With no probabilities, a sampled round is judged by matching the target's seeded draw
    at each position: whatever it proposes, the tokens are the ones it would draw alone."""
    sp = minikv.SamplingParams(temperature=0.9, seed=4)
    prompt = [3, 7, 11, 5] * 3
    alone = speculate(TARGET, prompt, 30, sp, lambda seq, k: [], gamma=4).tokens
    right = speculate(TARGET, prompt, 30, sp, lambda seq, k: (prompt + alone)[len(seq):][:k],
                      gamma=4)
    looked = speculate(TARGET, prompt, 30, sp, partial(propose_by_lookup, ngram=2), gamma=4)
    assert right.tokens == looked.tokens == alone
    assert right.stats.rejected == 0 and right.stats.accepted > 0


def test_a_proposer_stays_within_k():
    with pytest.raises(ValueError, match="at most k"):
        speculate(TARGET, [1, 2], 5, minikv.SamplingParams(), lambda seq, k: [1] * (k + 1))
