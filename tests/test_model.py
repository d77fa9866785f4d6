"""The from-scratch GPT matches GPT-2: same parameter layout, same logits as a reference
implementation."""
import pytest
import torch

import minikv

transformers = pytest.importorskip("transformers")


def hf_gpt2(vocab=300, positions=64, n_embd=128, n_layer=2, n_head=2, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=positions, n_embd=n_embd,
                                  n_layer=n_layer, n_head=n_head, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    # perturb every weight and bias so no layer is left at an identity-like init
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


@pytest.mark.parametrize("explicit_config", [True, False])
def test_logits_match_reference_gpt2(explicit_config):
    ref = hf_gpt2()
    cfg = minikv.GPTConfig(vocab_size=300, block_size=64, n_layer=2, n_head=2, n_embd=128)
    model = minikv.GPT.from_gpt2_state_dict(ref.state_dict(),
                                            cfg if explicit_config else None).eval()
    assert model.config == cfg  # inferred: n_head = 128 / 64 = 2
    idx = torch.randint(0, 300, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(idx).logits
        got = model(idx)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_cached_forward_matches_reference_with_past():
    """Our cache, fed chunk by chunk, gives the reference's full-sequence logits."""
    ref = hf_gpt2(n_embd=192, n_head=3)
    model = minikv.GPT.from_gpt2_state_dict(ref.state_dict()).eval()
    idx = torch.randint(0, 300, (2, 30), generator=torch.Generator().manual_seed(2))
    cache = minikv.KVCache.for_model(model, batch_size=2, max_len=30)
    with torch.no_grad():
        expected = ref(idx).logits
        chunks = [model(idx[:, a:b], cache=cache)
                  for a, b in ((0, 11), (11, 12), (12, 20), (20, 30))]
    torch.testing.assert_close(torch.cat(chunks, dim=1), expected, atol=1e-5, rtol=0)


def test_gpt2_preset_has_124m_parameters():
    model = minikv.GPT(minikv.GPTConfig.preset("gpt2"))
    assert model.num_params() == 124_439_808  # GPT-2 small, with the LM head tied to wte
    assert model.lm_head.weight is model.transformer.wte.weight


def test_parameter_names_follow_gpt2_layout():
    names = set(minikv.GPT(minikv.GPTConfig.preset("tiny")).state_dict())
    for name in ("transformer.wte.weight", "transformer.wpe.weight", "transformer.h.0.ln_1.weight",
                 "transformer.h.1.attn.c_attn.weight", "transformer.h.1.mlp.c_proj.bias",
                 "transformer.ln_f.bias"):
        assert name in names


def test_state_dict_without_transformer_prefix_loads():
    ref = hf_gpt2()
    sd = {k.removeprefix("transformer."): v for k, v in ref.state_dict().items()}
    model = minikv.GPT.from_gpt2_state_dict(sd)
    assert torch.equal(model.transformer.h[1].mlp.c_fc.weight,
                       ref.transformer.h[1].mlp.c_fc.weight.t())


@pytest.mark.parametrize("corrupt, error, message", [
    (lambda sd: sd.pop("transformer.h.1.ln_2.weight"), RuntimeError, "Missing key.*h.1.ln_2"),
    (lambda sd: sd.update({"transformer.h.0.attn.extra": torch.zeros(1)}), RuntimeError,
     "Unexpected key.*attn.extra"),
    (lambda sd: sd.update({"transformer.h.0.mlp.c_fc.weight": torch.zeros(128, 500)}),
     RuntimeError, "size mismatch for h.0.mlp.c_fc.weight"),
    (lambda sd: sd.pop("transformer.wte.weight"), ValueError, "GPT-2 state dict"),
    (lambda sd: sd.update({"lm_head.weight": torch.zeros(300, 128)}), ValueError, "not tied"),
])
def test_bad_state_dict_is_rejected(corrupt, error, message):
    """Torch's strict load_state_dict names a missing, extra or misshapen tensor."""
    sd = dict(hf_gpt2().state_dict())
    corrupt(sd)
    with pytest.raises(error, match=message):
        minikv.GPT.from_gpt2_state_dict(sd)


def test_positions_start_where_the_cache_ends(tiny):
    """Seed 003's correct approach: after a 3-token prefill, the next token sits at position 3."""
    seen = []
    hook = tiny.transformer.wpe.register_forward_hook(lambda m, i, o: seen.append(i[0].tolist()))
    cache = minikv.KVCache.for_model(tiny, max_len=8)
    with torch.no_grad():
        tiny(torch.tensor([[5, 6, 7]]), cache=cache)
        tiny(torch.tensor([[8]]), cache=cache)
    hook.remove()
    assert seen == [[0, 1, 2], [3]]


def test_position_bug_changes_the_logits(tiny):
    """Feeding position 0 instead of 3 (the seed's bug) gives different logits than the full
    forward."""
    idx = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        full = tiny(idx)[0, -1]
        cache = minikv.KVCache.for_model(tiny, max_len=8)
        tiny(idx[:, :3], cache=cache)
        right = tiny(idx[:, 3:], cache=cache)[0, -1]
        cache.crop(3)
        wrong = tiny(idx[:, 3:], cache=cache, positions=torch.tensor([0]))[0, -1]
    torch.testing.assert_close(right, full, atol=1e-5, rtol=0)
    assert (wrong - full).abs().max() > 1e-2


def test_config_validation():
    with pytest.raises(ValueError, match="divisible"):
        minikv.GPTConfig(n_embd=100, n_head=12)
    with pytest.raises(ValueError, match="positive int"):
        minikv.GPTConfig(n_layer=0)
    with pytest.raises(ValueError, match="preset must be one of.*gpt2.*got 'gpt5'"):
        minikv.GPTConfig.preset("gpt5")
    assert minikv.GPTConfig.preset("tiny", vocab_size=1000).vocab_size == 1000


@pytest.mark.parametrize("block", [{}, minikv.engine.config.LLAMA])
def test_a_head_width_of_its_own(block):
    """head_size (Qwen3's head_dim): heads wider than n_embd / n_head, q and the output
    projection n_head * head_size wide; the cache holds head_size per head, cached = full."""
    from conftest import assert_cached_equals_full
    cfg = minikv.GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=24,
                           n_kv_head=2, head_size=10, **block)
    torch.manual_seed(0)
    model = minikv.GPT(cfg).double()
    assert model.transformer.h[0].attn.c_attn.weight.shape == (4 * 10 + 2 * 2 * 10, 24)
    assert model.transformer.h[0].attn.c_proj.weight.shape == (24, 40)
    assert cfg.kv_shape == (2, 10, 10)
    assert_cached_equals_full(model)
    with pytest.raises(ValueError, match="head_size"):
        minikv.GPTConfig(n_embd=30, n_head=4)
