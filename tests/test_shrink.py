"""Caches that hold less: quantized (int8, int4) and sink-and-window. The quantization error is
bounded by the scale; the window cache never holds more than sinks + window positions and gives
exactly what a full model gives when it masks the same positions."""
import pytest
import torch
import torch.nn.functional as F

import minikv
from minikv.engine.attention import window_attention
from minikv.engine.quantized import QuantizedKVCache, dequantize, quantize
from minikv.engine.window import SinkWindowCache, feed

from conftest import varied_model

MODEL = varied_model().double()


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("head_dim", [16, 7])
def test_dequantization_error_is_at_most_half_a_scale(bits, head_dim):
    x = torch.randn(3, 4, 50, head_dim, generator=torch.Generator().manual_seed(bits),
                    dtype=torch.float64) * torch.logspace(-3, 2, 50, dtype=torch.float64)[:, None]
    codes, scale = quantize(x, bits)
    assert codes.dtype == torch.uint8 and codes.shape[-1] == (head_dim if bits == 8
                                                              else -(-head_dim // 2))
    error = (dequantize(codes, scale, bits, head_dim) - x).abs()
    assert (error <= scale / 2 * (1 + 1e-9)).all()
    assert (scale == x.abs().amax(-1, keepdim=True) / (2 ** (bits - 1) - 1)).all()


@pytest.mark.parametrize("bits", [8, 4])
def test_a_quantized_cache_is_a_cache_of_fewer_bytes(bits):
    model = varied_model()  # fp32
    cache = QuantizedKVCache.for_model(model, max_len=40, bits=bits)
    out = minikv.generate(model, [3, 1, 4, 1, 5], 20, cache=cache, return_logits=True)
    full = minikv.generate(model, [3, 1, 4, 1, 5], 20, return_logits=True)
    cfg = model.config
    codes = cfg.head_dim if bits == 8 else cfg.head_dim // 2  # bytes of one head's codes
    assert cache.nbytes == 2 * cfg.n_layer * cfg.kv_heads * (codes + 4) * 24
    assert cache.nbytes < minikv.kv_cache_bytes(cfg, 24, dtype=torch.float32) / (3 if bits == 8
                                                                                  else 5)
    # close to the full-precision cache, not equal; int8 much closer than int4
    error = (out.logits - full.logits).abs().max()
    assert 0 < error < (0.05 if bits == 8 else 0.5)
    twin = cache.fork()
    cache.crop(10)
    assert twin.get_seq_length() == 24 and cache.get_seq_length() == 10
    torch.testing.assert_close(twin.update(*[torch.zeros(1, 4, 1, 16)] * 2, 0)[0][:, :, :10],
                               dequantize(cache.keys[0][:, :, :10], cache.key_scales[0][:, :, :10],
                                          bits, 16))


def masked_full_pass(model, ids, visible):
    """Logits of the plain full forward pass where query t sees key j iff visible(t, j)."""
    T = len(ids)
    mask = torch.tensor([[visible(t, j) for j in range(T)] for t in range(T)])
    with torch.no_grad():
        return model(torch.tensor([ids]),
                     attention=lambda q, k, v: F.scaled_dot_product_attention(q, k, v,
                                                                               attn_mask=mask))[0]


@pytest.mark.parametrize("sinks, window", [(0, 5), (2, 5), (4, 12), (1, 1)])
def test_a_window_cache_is_a_full_model_that_masks_the_evicted_positions(sinks, window):
    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(window)).tolist()
    cache = SinkWindowCache.for_model(MODEL, sinks=sinks, window=window)
    streamed = []
    with torch.no_grad():
        for t, token in enumerate(ids):  # one token per pass: the window applies to every one
            streamed.append(MODEL(torch.tensor([[token]]), cache=cache)[0, -1])
            assert len(cache.positions) <= sinks + window
            assert cache.positions == sorted(set(range(min(sinks, t + 1)))
                                             | set(range(max(0, t + 1 - window), t + 1)))
            assert cache.keys[0].shape[2] == len(cache.positions)
            assert cache.get_seq_length() == t + 1
    # query t sees the sinks, the `window` positions before it and itself: the cache evicts
    # after a pass, so a full window and the new token are there together
    want = masked_full_pass(MODEL, ids, lambda t, j: j <= t and (j < sinks or j >= t - window))
    torch.testing.assert_close(torch.stack(streamed), want, atol=1e-10, rtol=0)
    # window_attention is that mask, for measuring many texts in one pass each
    with torch.no_grad():
        fast = MODEL(torch.tensor([ids] * 2), attention=window_attention(sinks, window))
    torch.testing.assert_close(fast, want.expand(2, -1, -1), atol=1e-10, rtol=0)


def test_a_prompt_fed_in_one_pass_is_read_whole_then_forgotten():
    prompt, sinks, window = list(range(10, 30)), 2, 4
    cache = SinkWindowCache.for_model(MODEL, sinks=sinks, window=window)
    out = minikv.generate(MODEL, prompt, 6, cache=cache, return_logits=True)
    P = len(prompt)
    full = masked_full_pass(MODEL, prompt + out.tokens[:-1],
                            lambda t, j: j <= t and (t < P or j < sinks or j >= t - window))
    torch.testing.assert_close(out.logits, full[P - 1:].float(), atol=1e-5, rtol=0)  # fp32 logits
    assert cache.positions == [0, 1] + list(range(P + 5 - window, P + 5))


def test_window_attention_refuses_a_cache():
    cache = minikv.KVCache.for_model(MODEL, max_len=8)
    MODEL(torch.tensor([[1, 2, 3]]), cache=cache)
    with pytest.raises(ValueError, match="one full pass without a cache"):
        MODEL(torch.tensor([[4]]), cache=cache, attention=window_attention(1, 2))


def test_feed_and_the_window_cache_refuse_what_they_cannot_do():
    cache = SinkWindowCache.for_model(MODEL, sinks=1, window=3)
    feed(MODEL, [1, 2, 3, 4, 5], cache)
    before = (list(cache.positions), cache.get_seq_length())
    with pytest.raises(ValueError, match="cannot roll back"):
        cache.crop(2)
    with pytest.raises(ValueError, match="no position embedding past"):
        feed(MODEL, [1] * MODEL.config.block_size, cache)
    assert (cache.positions, cache.get_seq_length())[1] >= before[1]
    with pytest.raises(ValueError, match="window must be a positive int"):
        SinkWindowCache.for_model(MODEL, sinks=1, window=0)
    with pytest.raises(ValueError, match=r"bits must be one of \(8, 4\)"):
        QuantizedKVCache.for_model(MODEL, bits=2)


def test_a_failed_pass_leaves_the_window_cache_as_it_was():
    cache = SinkWindowCache.for_model(MODEL, sinks=1, window=3)
    feed(MODEL, [1, 2, 3, 4, 5], cache)
    state = (list(cache.positions), cache.get_seq_length(), [t.clone() for t in cache.keys])

    def boom(q, k, v):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt), cache.restored_on_error():
        MODEL(torch.tensor([[7]]), cache=cache, attention=boom)
    assert (cache.positions, cache.get_seq_length()) == state[:2]
    assert all(torch.equal(a, b) for a, b in zip(cache.keys, state[2]))


def test_a_forked_window_cache_goes_its_own_way():
    cache = SinkWindowCache.for_model(MODEL, sinks=1, window=3)
    feed(MODEL, [1, 2, 3, 4, 5], cache)
    twin = cache.fork()
    feed(MODEL, [6, 7], twin)
    assert cache.positions == [0, 2, 3, 4] and cache.get_seq_length() == 5
    assert twin.positions == [0, 4, 5, 6] and twin.get_seq_length() == 7
    assert cache.keys[0].shape[2] == 4 and twin.keys[0].shape[2] == 4
