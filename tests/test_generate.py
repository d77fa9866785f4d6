"""Naive and cached decoding agree, and the engine's own counters reproduce seed 003's
arithmetic."""
import pytest
import torch

import minikv
from minikv.course.bugs import PositionsFromZero

from conftest import varied_model


def test_cached_equals_naive_for_200_greedy_tokens(tiny):
    naive = minikv.generate(tiny, [1, 2, 3], 200, mode="naive", return_logits=True)
    cached = minikv.generate(tiny, [1, 2, 3], 200, mode="cached", return_logits=True)
    assert len(set(naive.tokens)) >= 20, ("the random model must not collapse to one token, "
                                          "or this proves little")
    assert cached.tokens == naive.tokens
    torch.testing.assert_close(cached.logits, naive.logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cached_equals_naive_when_sampling(tiny, seed):
    kwargs = dict(temperature=0.9, top_k=50, seed=seed)
    naive = minikv.generate(tiny, [4, 5], 60, mode="naive", **kwargs)
    cached = minikv.generate(tiny, [4, 5], 60, mode="cached", **kwargs)
    assert cached.tokens == naive.tokens


def test_cached_equals_naive_on_gpt2_124m():
    torch.manual_seed(0)
    model = minikv.GPT(minikv.GPTConfig.preset("gpt2")).eval()
    prompt = [464, 3124, 286, 3290]
    naive = minikv.generate(model, prompt, 20, mode="naive", return_logits=True)
    cached = minikv.generate(model, prompt, 20, mode="cached", return_logits=True)
    assert cached.tokens == naive.tokens
    torch.testing.assert_close(cached.logits, naive.logits, atol=1e-5, rtol=0)


def test_seed_003_kv_table(tiny):
    """3-token prompt, 5 steps: naive computes 3+4+5+6+7 = 25 K/V vectors per layer, cached
    3+1+1+1+1 = 7."""
    naive = minikv.generate(tiny, [10, 11, 12], 5, mode="naive", trace=True)
    cached = minikv.generate(tiny, [10, 11, 12], 5, mode="cached", trace=True)
    assert [e.kv_computed for e in naive.trace] == [3, 4, 5, 6, 7]
    assert [e.kv_computed for e in cached.trace] == [3, 1, 1, 1, 1]
    assert (naive.stats.kv_computed, cached.stats.kv_computed) == (25, 7)
    assert (naive.stats.forward_passes, cached.stats.forward_passes) == (5, 5)
    assert naive.stats.positions_processed == 25 and cached.stats.positions_processed == 7


@pytest.mark.parametrize("n", [1, 10, 100])
def test_kv_work_is_quadratic_without_cache_and_linear_with(n):
    """Seed 003's scaling: for a 1-token prompt and N tokens, N(N+1)/2 without cache vs N with
    it."""
    model = varied_model()
    naive = minikv.generate(model, [7], n, mode="naive")
    cached = minikv.generate(model, [7], n, mode="cached")
    assert naive.stats.kv_computed == n * (n + 1) // 2
    assert cached.stats.kv_computed == n


def test_trace_of_prefill_and_decode(tiny):
    out = minikv.generate(tiny, [1, 2, 3, 4], 3, trace=True)
    first, second, third = out.trace
    assert (first.kind, first.input_ids, first.positions) == ("prefill", (1, 2, 3, 4), (0, 1, 2, 3))
    assert (first.cache_len_before, first.cache_len_after, first.token) == (0, 4, out.tokens[0])
    assert (second.kind, second.input_ids, second.positions) == ("decode", (out.tokens[0],), (4,))
    assert (third.cache_len_before, third.cache_len_after, third.token) == (5, 6, out.tokens[2])


def test_position_offset_bug_is_reproducible(tiny):
    """Restarting positions at 0 on each decode step (seed 003's bug) changes what the model
    says."""
    right = minikv.generate(tiny, [1, 2, 3], 30, trace=True)
    buggy = PositionsFromZero(tiny)  # the course's wrapper: the engine's loop holds no bug
    wrong = minikv.generate(buggy, [1, 2, 3], 30, trace=True)
    assert buggy.given[:3] == [[0, 1, 2], [0], [0]]
    assert [e.positions for e in wrong.trace[1:3]] == [(3,), (4,)]  # what the loop asked for
    assert wrong.tokens[0] == right.tokens[0]  # the prefill itself is right
    assert wrong.tokens != right.tokens


def test_same_seed_same_tokens_different_seed_different(tiny):
    a = minikv.generate(tiny, [1, 2], 40, temperature=1.0, seed=5)
    b = minikv.generate(tiny, [1, 2], 40, temperature=1.0, seed=5)
    c = minikv.generate(tiny, [1, 2], 40, temperature=1.0, seed=6)
    assert a.tokens == b.tokens and a.tokens != c.tokens


def test_top_k_1_is_greedy(tiny):
    greedy = minikv.generate(tiny, [3], 30)
    assert minikv.generate(tiny, [3], 30, temperature=2.0, top_k=1, seed=9).tokens == greedy.tokens


def test_stops_at_eos(tiny):
    full = minikv.generate(tiny, [1, 2, 3], 50).tokens
    eos = full[7]
    first = full.index(eos)
    for mode in ("naive", "cached"):
        out = minikv.generate(tiny, [1, 2, 3], 50, mode=mode, eos_id=eos)
        assert out.tokens == full[: first + 1] and out.stats.new_tokens == first + 1


def test_continuing_a_forked_cache_equals_a_fresh_prefill(tiny):
    """Branching from a cached prefix (chapter 03) gives what recomputing the whole prompt would."""
    prefix, question = [5, 6, 7, 8, 9], [20, 21]
    cache = minikv.KVCache.for_model(tiny, max_len=32)
    minikv.generate(tiny, prefix, 1, cache=cache)
    branch = minikv.generate(tiny, question, 6, cache=cache.fork(), trace=True)
    fresh = minikv.generate(tiny, prefix + question, 6)
    assert branch.tokens == fresh.tokens
    assert branch.stats.kv_computed == len(question) + 5  # the prefix was not recomputed
    assert branch.trace[0].positions == (5, 6)
    assert cache.get_seq_length() == len(prefix)  # the original is untouched


def test_zero_new_tokens_does_nothing(tiny):
    out = minikv.generate(tiny, [1, 2], 0)
    assert out.tokens == [] and out.stats.forward_passes == 0 and out.sequence == [1, 2]


def test_prompt_forms_are_equivalent(tiny):
    a = minikv.generate(tiny, [1, 2, 3], 5).tokens
    assert minikv.generate(tiny, torch.tensor([1, 2, 3]), 5).tokens == a
    assert minikv.generate(tiny, torch.tensor([[1, 2, 3]]), 5).tokens == a


def test_device_override(monkeypatch):
    monkeypatch.setenv("MINIKV_DEVICE", "cpu")
    assert minikv.default_device() == torch.device("cpu")
    monkeypatch.delenv("MINIKV_DEVICE")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    if not torch.cuda.is_available() and torch.backends.mps.is_available():
        expected = "mps"
    assert minikv.default_device().type == expected


@pytest.mark.cuda
def test_cached_equals_naive_on_cuda():
    model = varied_model().to("cuda")
    naive = minikv.generate(model, [1, 2, 3], 100, mode="naive", return_logits=True)
    cached = minikv.generate(model, [1, 2, 3], 100, mode="cached", return_logits=True)
    assert cached.tokens == naive.tokens
    torch.testing.assert_close(cached.logits, naive.logits, atol=1e-4, rtol=0)
    sampled = [minikv.generate(model, [1, 2], 30, temperature=1.0, seed=3).tokens for _ in range(2)]
    assert sampled[0] == sampled[1]


@pytest.mark.cuda
def test_cache_lives_on_cuda_and_counts_bytes():
    model = varied_model().to("cuda").half()
    cache = minikv.KVCache.for_model(model, max_len=16)
    assert cache.device.type == "cuda" and cache.dtype == torch.float16
    minikv.generate(model, [1, 2, 3], 4, cache=cache)
    assert cache.nbytes == minikv.kv_cache_bytes(model.config, 6, dtype=torch.float16)


@pytest.mark.cuda
@pytest.mark.parametrize("preset", ["tiny", "tiny-llama"])
def test_a_decode_step_reads_nothing_back_but_its_token(preset):
    """The engine's decode step (a pass through the cache: its checks, every layer's update,
    the logits, the argmax) never waits for the GPU; reading the chosen token back, the one
    read a step needs, is the only synchronisation. Checks on the hot path used to read the
    ids, the positions and the cache length back every pass."""
    from minikv.engine.config import LLAMA
    overrides = LLAMA if preset == "tiny-llama" else {}
    model = varied_model("tiny", **overrides).to("cuda")
    cache = minikv.KVCache.for_model(model, max_len=64)
    with torch.inference_mode():
        model(torch.tensor([[1, 2, 3]], device="cuda"), cache=cache)
        token = torch.tensor([[5]], device="cuda")  # the caller's upload, made beforehand
        torch.cuda.synchronize()
        for _ in range(4):
            torch.cuda.set_sync_debug_mode("error")
            try:
                logits = model(token, cache=cache, last_only=True)
                token = logits[:, -1].argmax(-1, keepdim=True)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            assert 0 <= int(token) < model.config.vocab_size  # the one read: the token
    assert cache.get_seq_length() == 3 + 4
