"""Grouped-query and multi-query attention (n_kv_head < n_head): the cache holds n_kv_head heads,
and every decoder gives what the plain forward pass gives."""
import pytest
import torch

import minikv
from minikv.engine.attention import paged_attention

from conftest import assert_cached_equals_full, varied_model

KV_HEADS = [2, 1]  # of 4 query heads: GQA-2 and MQA


def model_with(n_kv_head, dtype=torch.float64, seed=0):
    return varied_model("tiny", seed=seed, n_kv_head=n_kv_head).to(dtype)


@pytest.mark.parametrize("n_kv_head", KV_HEADS)
def test_the_projections_and_the_cache_hold_n_kv_head_heads(n_kv_head):
    model = model_with(n_kv_head, torch.float32)
    cfg = model.config
    assert cfg.kv_heads == n_kv_head and cfg.to_dict()["n_kv_head"] == n_kv_head
    assert model.transformer.h[0].attn.c_attn.weight.shape == (
        cfg.n_embd + 2 * n_kv_head * cfg.head_dim, cfg.n_embd)
    cache = minikv.KVCache.for_model(model, max_len=40)
    with torch.no_grad():
        model(torch.arange(1, 18).view(1, -1), cache=cache)
    assert cache.keys[0].shape == (1, n_kv_head, 40, cfg.head_dim)
    for dtype in (torch.float32, torch.float16):
        assert minikv.kv_cache_bytes(cfg, 17, dtype=torch.float32) == cache.nbytes
        assert (minikv.kv_cache_bytes(cfg, 17, dtype=dtype)
                == minikv.kv_cache_bytes(minikv.GPTConfig.preset("tiny"), 17, dtype=dtype)
                * n_kv_head // cfg.n_head)


@pytest.mark.parametrize("n_kv_head", KV_HEADS)
def test_cached_equals_the_full_forward_pass(n_kv_head):
    model = model_with(n_kv_head)
    assert_cached_equals_full(model)


@pytest.mark.parametrize("n_kv_head", KV_HEADS)
def test_every_decoder_runs_a_gqa_model(n_kv_head):
    model, mha = model_with(n_kv_head), varied_model("tiny", seed=3).double()
    prompt, n = [5, 6, 7], 24
    want = minikv.generate(model, prompt, n, mode="naive").tokens
    assert minikv.generate(model, prompt, n, mode="cached").tokens == want
    assert minikv.speculative_generate(model, mha, prompt, n, gamma=3).tokens == want  # target
    assert (minikv.speculative_generate(mha, model, prompt, n, gamma=3).tokens
            == minikv.generate(mha, prompt, n).tokens)                               # draft
    assert minikv.lookup_generate(model, prompt, n).tokens == want
    assert [o.tokens for o in minikv.generate_batch(model, [prompt, [9, 8, 7, 6, 5]], n)] == [
        want, minikv.generate(model, [9, 8, 7, 6, 5], n).tokens]
    requests = [minikv.Request(prompt, n), minikv.Request([1, 2] * 10, 9, arrival=2),
                minikv.Request([4] * 5, 30, arrival=1)]
    outs = minikv.serve(model, requests, page_size=4, num_blocks=30)
    assert [o.tokens for o in outs] == [minikv.generate(model, r.prompt, r.max_new_tokens).tokens
                                        for r in requests]
    assert outs.pool.keys[0].shape[1] == n_kv_head


def test_a_deterministic_gqa_request_is_bit_identical_in_any_batch():
    model = varied_model("small", n_kv_head=2)
    det = minikv.Request([5, 6, 7, 8], 20, deterministic=True, temperature=0.8, seed=1)
    outs = {tuple(minikv.serve(model, [det] + [minikv.Request([k + 1] * (k + 3), 10 + k)
                                               for k in range(n)])[0].tokens)
            for n in range(5)}
    assert len(outs) == 1


@pytest.mark.parametrize("n_kv_head", KV_HEADS)
def test_paged_attention_reads_a_kv_head_for_its_whole_group(n_kv_head):
    g = torch.Generator().manual_seed(n_kv_head)
    nh, hs, bs, lengths = 4, 8, 4, [3, 11]
    keys = torch.randn(6, n_kv_head, bs, hs, generator=g, dtype=torch.float64)
    values = torch.randn(6, n_kv_head, bs, hs, generator=g, dtype=torch.float64)
    tables = torch.tensor([[4, -1, -1], [0, 5, 2]])
    q = torch.randn(2, nh, 1, hs, generator=g, dtype=torch.float64)
    out = paged_attention(q, keys, values, tables, torch.tensor(lengths), n_splits=2)
    for b, n in enumerate(lengths):
        blocks = [x for x in tables[b].tolist() if x >= 0]
        k = keys[blocks].transpose(0, 1).reshape(n_kv_head, -1, hs)[:, :n]
        v = values[blocks].transpose(0, 1).reshape(n_kv_head, -1, hs)[:, :n]
        want = torch.nn.functional.scaled_dot_product_attention(q[b], k, v, enable_gqa=True)
        torch.testing.assert_close(out[b], want, atol=1e-12, rtol=0)


@pytest.mark.parametrize("n_kv_head, message", [(3, "n_head by n_kv_head"),
                                                 (0, "n_kv_head must be a positive int")])
def test_bad_n_kv_head(n_kv_head, message):
    with pytest.raises(ValueError, match=message):
        minikv.GPTConfig.preset("tiny", n_kv_head=n_kv_head)


def test_the_attention_picture_shows_every_query_head_of_a_gqa_model():
    from minikv.viz.draw import attention_weights
    weights = attention_weights(model_with(1, torch.float32), [1, 2, 3, 4, 5])
    assert weights.shape == (4, 5, 5)
    torch.testing.assert_close(weights.sum(-1), torch.ones(4, 5))


def test_mean_pooling_keeps_queries_and_averages_each_groups_keys_and_values():
    from minikv.course.variants import mean_pool_kv_heads
    model = varied_model("tiny")  # 4 heads of 16
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # biases too, so pooling them is checked
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(p.numel()))
    same = mean_pool_kv_heads(model, 4)
    x = torch.arange(1, 12).view(1, -1)
    with torch.no_grad():
        torch.testing.assert_close(same(x), model(x), atol=1e-6, rtol=0)
    mqa = mean_pool_kv_heads(model, 1)
    w, pooled = model.transformer.h[1].attn.c_attn.weight, mqa.transformer.h[1].attn.c_attn.weight
    assert pooled.shape == (64 + 2 * 16, 64)
    torch.testing.assert_close(pooled[:64], w[:64], atol=0, rtol=0)                  # queries
    torch.testing.assert_close(pooled[64:80], w[64:128].view(4, 16, 64).mean(0))     # keys
    torch.testing.assert_close(pooled[80:], w[128:].view(4, 16, 64).mean(0))         # values
    gqa = mean_pool_kv_heads(model, 2)
    bias = model.transformer.h[0].attn.c_attn.bias
    pooled_bias = gqa.transformer.h[0].attn.c_attn.bias
    torch.testing.assert_close(pooled_bias[64:80], bias[64:96].view(2, 16).mean(0))  # heads 0, 1
    torch.testing.assert_close(pooled_bias[80:96], bias[96:128].view(2, 16).mean(0))  # heads 2, 3
    assert minikv.generate(gqa, [1, 2, 3], 5).tokens  # it runs
    with pytest.raises(ValueError, match="divisible"):
        mean_pool_kv_heads(model, 3)
