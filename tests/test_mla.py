"""The cache shrunk in the architecture, as config choices of the one model: multi-head latent
attention (MLA: one latent per position cached, not K and V; its absorbed decode equal to the
naive form up to rounding) and cross-layer attention (adjacent layers reading one K/V). Every
decoder and cache kind equal to its naive reference on each, and the bytes each cache holds
equal to the formula."""
import math

import pytest
import torch

import minikv
from minikv.engine.attention import paged_attention
from minikv.engine.config import LLAMA
from minikv.engine.model import causal_attention
from minikv.engine.scheduler import FirstComeFirstServed

from conftest import assert_cached_equals_full, varied_model

MLA = dict(kv_lora_rank=12)                                   # the tiny preset: hs 16, 4 heads
MLA_ROPE = dict(kv_lora_rank=12, qk_rope_head_dim=8, n_inner=176, **LLAMA)
CLA = dict(layers_per_kv=2)
CHOICES = {"mla": MLA, "mla-rope": MLA_ROPE, "cla": CLA, "mla+cla": {**MLA, **CLA},
           "gqa+cla": dict(n_kv_head=2, **CLA, n_layer=3)}     # 3 layers: a group of one at the top


@pytest.fixture(scope="module", params=list(CHOICES))
def model(request):
    return varied_model("tiny", std=0.2 if "rope" in request.param else 0.1,
                        **CHOICES[request.param]).double()


def latent_layer(rope: bool = False):
    cfg = minikv.GPTConfig.preset("tiny", **(MLA_ROPE if rope else MLA))
    torch.manual_seed(0)
    return minikv.GPT(cfg).double().eval()


@pytest.mark.parametrize("rope", [False, True])
def test_the_absorbed_decode_equals_the_naive_form(rope):
    """One new query against 9 cached latents: absorbed (the query moved into the latent's
    space, W_UV after) equals expanding every latent to its heads' keys and values."""
    model = latent_layer(rope)
    attn, cfg = model.transformer.h[0].attn, model.config
    x = torch.randn(2, 10, cfg.n_embd, dtype=torch.float64, generator=torch.Generator()
                    .manual_seed(1))
    positions = torch.arange(10)
    angles = (minikv.engine.rope.rope_angles(positions, cfg.qk_rope_head_dim, cfg.rope_theta)
              if rope else None)
    with torch.no_grad():
        naive = attn(x, None, 0, causal_attention, angles)[:, -1]   # 10 rows: the naive form
        cache = minikv.KVCache.for_model(model, batch_size=2)
        cache.n_layer  # one cache layer per model layer, each (2, 1, L, rank + rope)
        first = None if angles is None else tuple(a[:9] for a in angles)
        last = None if angles is None else tuple(a[9:] for a in angles)
        attn(x[:, :9], cache, 0, causal_attention, first)
        cache._length = 9  # a one-layer call: the model would move it after its last layer
        absorbed = attn(x[:, 9:], cache, 0, causal_attention, last)[:, -1]
    torch.testing.assert_close(absorbed, naive, atol=1e-12, rtol=0)
    assert cache.keys[0].shape[1:] == (1, cfg.block_size, 12 + cfg.qk_rope_head_dim)
    assert cache.values[0].shape[-1] == 0  # no values cached: V is read from the latent


def test_the_absorbed_form_never_expands_the_cache(monkeypatch):
    """In a decode step the cached latents meet the query as they are: attention gets
    (B, 1, L, rank) keys, not (B, n_head, L, head_dim) ones."""
    model = latent_layer()
    seen = []

    def watch(q, k, v):
        seen.append((tuple(q.shape), tuple(k.shape), tuple(v.shape)))
        return causal_attention(q, k, v)
    cache = minikv.KVCache.for_model(model)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3, 4]]), cache=cache, attention=watch)
        model(torch.tensor([[5]]), cache=cache, attention=watch)
    assert seen[0] == ((1, 4, 4, 16), (1, 4, 4, 16), (1, 4, 4, 16))  # prefill: naive
    assert seen[-1] == ((1, 4, 1, 12), (1, 1, 5, 12), (1, 1, 5, 12))  # decode: absorbed


def test_cached_equals_the_full_forward_pass(model):
    assert_cached_equals_full(model)


def test_every_decoder_equals_its_naive_reference(model):
    draft = varied_model("tiny", seed=3, n_layer=1).double()
    prompt, n = [5, 6, 7], 24
    want = minikv.generate(model, prompt, n, mode="naive").tokens
    assert len(set(want)) > 4  # a model that repeats one token would hide a broken cache
    assert minikv.generate(model, prompt, n, mode="cached").tokens == want
    assert minikv.speculative_generate(model, draft, prompt, n, gamma=3).tokens == want
    assert minikv.lookup_generate(model, prompt, n).tokens == want
    other = [9, 8, 7, 6, 5]
    assert [o.tokens for o in minikv.generate_batch(model, [prompt, other], n)] == [
        want, minikv.generate(model, other, n).tokens]
    requests = [minikv.Request(prompt, n), minikv.Request([1, 2] * 10, 9, arrival=2),
                minikv.Request([4] * 5, 30, arrival=1)]
    for policy in (None, FirstComeFirstServed(6, chunked_prefill=True)):  # prompts in chunks
        outs = minikv.serve(model, requests, page_size=4, num_blocks=30, policy=policy)
        assert [o.tokens for o in outs] == [
            minikv.generate(model, r.prompt, r.max_new_tokens).tokens for r in requests]
    assert len(outs.pool.keys) == model.config.kv_layers


def test_a_served_draft_and_a_deterministic_request(model):
    draft = varied_model("tiny", seed=3, n_layer=1).double()
    prompt = [5, 6, 7, 8]
    want = minikv.generate(model, prompt, 16).tokens
    spec = minikv.serve(model, [minikv.Request(prompt, 16)], page_size=4, num_blocks=20,
                        speculative=minikv.Speculation(draft=draft, gamma=3))
    assert spec[0].tokens == want
    det = minikv.Request(prompt, 12, deterministic=True, temperature=0.8, seed=1)
    outs = {tuple(minikv.serve(model, [det] + [minikv.Request([k + 1] * (k + 3), 8)
                                               for k in range(n)])[0].tokens)
            for n in range(3)}
    assert len(outs) == 1


def test_quantized_and_window_caches_hold_the_latent(model):
    exact = minikv.generate(model, [1, 2, 3], 12, return_logits=True)
    q8 = minikv.QuantizedKVCache.for_model(model, bits=8)
    quant = minikv.generate(model, [1, 2, 3], 12, cache=q8, return_logits=True)
    assert (quant.logits - exact.logits).abs().max() < 0.1 * exact.logits.abs().max()
    window = minikv.SinkWindowCache.for_model(model, sinks=2, window=8)
    out = minikv.generate(model, list(range(1, 30)), 4, cache=window)
    assert len(out.tokens) == 4 and window.keys[0].shape[2] == 10


@pytest.mark.parametrize("name", list(CHOICES) + ["mha", "gqa"])
def test_bytes_per_token_equal_the_formula(name):
    """The live cache's own count of bytes against kv_cache_bytes: layers of the cache x
    heads x (key width + value width) x bytes, per position."""
    extra = {"mha": {}, "gqa": dict(n_kv_head=2)}.get(name, CHOICES.get(name))
    model = minikv.GPT(minikv.GPTConfig.preset("tiny", **extra)).eval()
    cache = minikv.KVCache.for_model(model)
    with torch.no_grad():
        model(torch.tensor([list(range(1, 11))]), cache=cache)
    cfg = model.config
    heads, key_dim, value_dim = cfg.kv_shape
    per_token = math.ceil(cfg.n_layer / cfg.layers_per_kv) * heads * (key_dim + value_dim) * 4
    assert cache.nbytes == 10 * per_token == minikv.kv_cache_bytes(cfg, 10, dtype=torch.float32)
    want = {"mha": 2 * 2 * 4 * 16, "gqa": 2 * 2 * 2 * 16, "mla": 2 * 12, "cla": 1 * 2 * 4 * 16,
            "mla+cla": 12, "mla-rope": 2 * (12 + 8), "gqa+cla": 2 * 2 * 2 * 16}[name]
    assert per_token == 4 * want


def test_deepseek_v3_bytes_per_token():
    """DeepSeek-V3's attention config (61 layers, 128 heads, a 512-wide latent and a 64-wide
    RoPE key) caches 576 numbers per layer and token: 70,272 bytes in bf16, where its 128
    heads of 128-wide keys and values would take 61 x 2 x 128 x 128 x 2 = 3,997,696."""
    v3 = minikv.GPTConfig(vocab_size=129280, block_size=4096, n_layer=61, n_head=128,
                          n_embd=16384, kv_lora_rank=512, qk_rope_head_dim=64, **LLAMA)
    assert minikv.kv_cache_bytes(v3, 1, dtype=torch.bfloat16) == 61 * 576 * 2 == 70272
    mha = minikv.GPTConfig(vocab_size=129280, block_size=4096, n_layer=61, n_head=128,
                           n_embd=16384, **LLAMA)
    assert minikv.kv_cache_bytes(mha, 1, dtype=torch.bfloat16) == 3997696


def test_paged_attention_reads_values_narrower_than_keys():
    """MLA's decode reads (dc + dr)-wide keys and dc-wide values out of the same pool."""
    g = torch.Generator().manual_seed(0)
    latent = torch.randn(6, 1, 4, 20, generator=g, dtype=torch.float64)
    tables, lengths = torch.tensor([[4, -1, -1], [0, 5, 2]]), [3, 11]
    q = torch.randn(2, 4, 1, 20, generator=g, dtype=torch.float64)
    out = paged_attention(q, latent, latent[..., :12], tables, torch.tensor(lengths), 2)
    for b, n in enumerate(lengths):
        blocks = [x for x in tables[b].tolist() if x >= 0]
        k = latent[blocks].transpose(0, 1).reshape(1, -1, 20)[:, :n]
        want = torch.nn.functional.scaled_dot_product_attention(q[b], k, k[..., :12],
                                                                enable_gqa=True)
        torch.testing.assert_close(out[b], want, atol=1e-12, rtol=0)


def test_the_upper_layer_of_a_group_has_no_kv_projection():
    model = minikv.GPT(minikv.GPTConfig.preset("tiny", layers_per_kv=2, n_layer=3))
    widths = [b.attn.c_attn.weight.shape[0] for b in model.transformer.h]
    assert widths == [3 * 64, 64, 3 * 64]  # Q, K, V; Q only; Q, K, V
    with pytest.raises(ValueError, match="reads the K/V of the layer below"):
        model.transformer.h[1](torch.zeros(1, 2, 64), None, 1, causal_attention)


@pytest.mark.parametrize("overrides, message", [
    (dict(kv_lora_rank=0), "kv_lora_rank must be a positive int"),
    (dict(kv_lora_rank=8, qk_rope_head_dim=4), "a learned-position MLA 0"),
    (dict(kv_lora_rank=8, **LLAMA), "a rotary MLA needs an even one > 0"),
    (dict(kv_lora_rank=8, qk_rope_head_dim=3, **LLAMA), "a rotary MLA needs an even one"),
    (dict(kv_lora_rank=8, n_kv_head=2), "leave n_kv_head None"),
    (dict(layers_per_kv=0), "layers_per_kv must be a positive int"),
    (dict(qk_rope_head_dim=-1), "qk_rope_head_dim must be an int >= 0"),
    (dict(qk_rope_head_dim=8, **LLAMA), "set kv_lora_rank too"),
])
def test_bad_choices_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        minikv.GPTConfig.preset("tiny", **overrides)


def test_a_cache_for_another_shape_is_refused():
    mla, mha = latent_layer(), minikv.GPT(minikv.GPTConfig.preset("tiny")).double()
    with pytest.raises(ValueError, match="n_head, head_dim, value_dim"):
        mla(torch.tensor([[1, 2]]), cache=minikv.KVCache.for_model(mha))
    with pytest.raises(ValueError, match="not MLA"):
        rope = varied_model("tiny", **MLA_ROPE)
        minikv.generate(rope, [1, 2], 2, cache=minikv.SinkWindowCache.for_model(
            rope, sinks=1, window=4, rope="reindex"))


def test_a_checkpoint_keeps_the_choices(model, tmp_path):
    from minikv.course.checkpoint import load_checkpoint, save_checkpoint
    loaded = load_checkpoint(save_checkpoint(model.float(), tmp_path / "m"), "cpu")
    model.double()
    assert loaded.config == model.config
    assert minikv.generate(loaded.double(), [1, 2, 3], 10).tokens == minikv.generate(
        model, [1, 2, 3], 10).tokens


def test_a_session_of_latents_is_saved_and_goes_on(model, tmp_path):
    """A radix tree over a pool of latents: a conversation's cache written out and read into
    another engine gives the next turn the tokens the first engine gives it."""
    from minikv.course.sessions import load_session, save_session
    from minikv.engine.serving import Engine
    from minikv.engine.session import Session

    def engine():
        return Engine(model, 40, page_size=4, prefix_caching=minikv.Radix())
    first = Session(engine())
    first.say([3, 1, 4, 1, 5, 9, 2, 6], 5)
    path = save_session(first, tmp_path / "chat.safetensors")
    other = load_session(engine(), path)
    assert other.say([7, 7], 6) == first.say([7, 7], 6)


def test_export_refuses_what_hugging_face_has_no_class_for(tmp_path):
    from minikv.course.export import export_hf
    with pytest.raises(ValueError, match="MLA or cross-layer"):
        export_hf(latent_layer().float(), tmp_path / "out")


def test_a_tier_in_a_file_holds_latents(model, tmp_path):
    """Two conversations take turns in a pool too small for both: the one waiting is moved
    to a second tier mapped from a file and comes back as it was."""
    from minikv.engine.serving import Engine
    from minikv.engine.session import Session
    tier = minikv.Radix(tier_blocks=12, tier_file=str(tmp_path / "tier.bin"))
    small = Engine(model, 7, page_size=4, prefix_caching=tier)
    roomy = Engine(model, 40, page_size=4)
    pairs = [(Session(small), Session(roomy)) for _ in range(2)]
    for message in ([3, 1, 4, 1, 5, 9], [5, 3, 5], [8, 9]):
        for i, (a, b) in enumerate(pairs):
            assert a.say([t + i for t in message], 3) == b.say([t + i for t in message], 3)
    assert small.scheduler.prefix.counts["from_tier"] > 0


def test_the_low_rank_conversion_is_exact_at_full_rank_and_drops_only_the_key_bias():
    """MLA from a GPT-2 block: at the rank of [W_K; W_V] (2C x C: rank C) the factored model
    is the model (the key bias dropped, which the softmax ignores; the value bias moved into
    the output's); below it, an approximation that caches `rank` numbers a layer."""
    from minikv.course.variants import low_rank_kv
    model = varied_model("tiny").double()
    with torch.no_grad():
        for block in model.transformer.h:  # biases that matter if handled wrong
            block.attn.c_attn.bias.normal_(0, 0.5)
        ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
        full, low = low_rank_kv(model, 64), low_rank_kv(model, 8)
        torch.testing.assert_close(full(ids), model(ids), atol=1e-9, rtol=0)
        assert (low(ids) - model(ids)).abs().max() > 1e-3
    assert low.config.kv_shape == (1, 8, 0)
    with pytest.raises(ValueError, match="GPT-2 block"):
        low_rank_kv(low, 4)


def test_sharing_layers_keeps_every_query_and_the_lower_layers_kv():
    from minikv.course.variants import share_kv_layers
    model = varied_model("tiny", n_layer=4).double()
    shared = share_kv_layers(model, 2)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        lower = [model.transformer.h[i].attn.c_attn.weight for i in range(4)]
        mine = [shared.transformer.h[i].attn.c_attn.weight for i in range(4)]
        assert torch.equal(mine[0], lower[0]) and torch.equal(mine[1], lower[1][:64])
        assert not torch.allclose(shared(ids), model(ids))  # the upper layers read other K/V
    assert shared.config.kv_layers == 2


def test_a_scored_cache_refuses_a_model_whose_attention_reads_other_kv():
    """H2O and SnapKV score the K/V heads each layer made; MLA's and CLA's layers read a
    latent or the layer below's, so the scored caches refuse them before anything is held."""
    for choice in (MLA, CLA):
        model = minikv.GPT(minikv.GPTConfig.preset("tiny", **choice)).eval()
        for cache in (minikv.H2OCache.for_model(model, heavy=2, recent=2),
                      minikv.SnapKVCache.for_model(model, top=2, window=2)):
            with pytest.raises(ValueError, match="not an MLA or cross-layer"):
                model(torch.tensor([[1, 2, 3]]), cache=cache, attention=cache.attention)
            assert cache.get_seq_length() == 0
