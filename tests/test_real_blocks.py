"""The block choices the small open models add to the Llama-style block are config choices of
the one model, each equal to transformers' own class on random weights at a scaled-down copy of
the real config: an untied head (the bigger Llamas and Qwens), Llama 3's RoPE scaling
(Llama-3.2), q/k/v biases (Qwen2.5), q/k RMSNorm per head with a head width of its own (Qwen3)."""
import pytest
import torch

import minikv
from minikv.engine.config import LLAMA
from minikv.engine.rope import llama3_frequencies, rope_angles

from conftest import assert_cached_equals_full

transformers = pytest.importorskip("transformers")
TINY_LLAMA = dict(n_kv_head=2, n_inner=176, **LLAMA)
# Llama-3.2's scaling (factor 32, low 1, high 4) with the trained context cut from 8192 to 64,
# so that at this head width (16) pairs fall in all three bands: kept, blended and slowed
LLAMA3 = ("llama3", 32.0, 1.0, 4.0, 64)
FAMILIES = {  # name: (our choices, transformers' config class, its model class)
    "llama-untied": (dict(tied_head=False), "LlamaConfig", "LlamaForCausalLM"),
    "llama3-rope": (dict(rope_scaling=LLAMA3, rope_theta=500000.0), "LlamaConfig",
                    "LlamaForCausalLM"),
    "qwen2": (dict(qkv_bias=True, rope_theta=1000000.0), "Qwen2Config", "Qwen2ForCausalLM"),
    "qwen2-untied": (dict(qkv_bias=True, tied_head=False), "Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": (dict(qk_norm=True, head_size=32), "Qwen3Config", "Qwen3ForCausalLM"),
}


def their_rope(cfg: minikv.GPTConfig) -> dict:
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        _, factor, low, high, context = cfg.rope_scaling
        rope |= {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                 "high_freq_factor": high, "original_max_position_embeddings": context}
    return rope


def hf_pair(family: str, seed: int = 0):
    """A random transformers model of `family` at the tiny preset's shape and our config for
    it; weights drawn wide (std 0.1), norms' scales and biases not their defaults."""
    choices, config_class, model_class = FAMILIES[family]
    cfg = minikv.GPTConfig.preset("tiny", **TINY_LLAMA, **choices)
    hf_cfg = getattr(transformers, config_class)(
        vocab_size=cfg.vocab_size, hidden_size=cfg.n_embd, intermediate_size=cfg.n_inner,
        num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head,
        num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_dim,
        max_position_embeddings=cfg.block_size, rms_norm_eps=cfg.layer_norm_eps,
        tie_word_embeddings=cfg.tied_head, rope_parameters=their_rope(cfg))
    torch.manual_seed(seed)
    hf = getattr(transformers, model_class)(hf_cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.1)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
            else:
                p.uniform_(0.5, 1.5)  # the norms' scales, not all ones
    return hf, cfg


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_full_and_cached_equal_transformers(family):
    hf, cfg = hf_pair(family)
    ours = minikv.GPT.from_llama_state_dict(hf.state_dict(), cfg).eval()
    idx = torch.randint(0, cfg.vocab_size, (2, 100), generator=torch.Generator().manual_seed(0))
    cache = minikv.KVCache.for_model(ours, batch_size=2, max_len=100)
    with torch.no_grad():
        theirs, full = hf(idx).logits, ours(idx)
        cached = torch.cat([ours(idx[:, :60], cache=cache)]
                           + [ours(idx[:, i:i + 1], cache=cache) for i in range(60, 100)], 1)
    assert theirs.abs().max() > 1  # logits that tell tokens apart, not all near zero
    assert (theirs - full).abs().max() < 1e-4
    assert (theirs - cached).abs().max() < 1e-4
    assert_cached_equals_full(ours.double())


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_equal_transformers(family):
    # seeds whose random model does not settle into repeating a token or two within 100
    hf, cfg = hf_pair(family, seed={"qwen2": 3, "qwen3": 2}.get(family, 1))
    ours = minikv.GPT.from_llama_state_dict(hf.state_dict(), cfg).eval()
    prompt = [3, 14, 15, 92, 65]
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=100, do_sample=False,
                             min_new_tokens=100)[0, len(prompt):].tolist()
    mine = minikv.generate(ours, prompt, 100).tokens
    assert mine == theirs and len(set(mine)) > 10  # and the output is not one token repeated


@pytest.mark.parametrize("family, choice, off", [
    ("qwen3", "qk_norm", False), ("llama3-rope", "rope_scaling", None),
    ("qwen2", "qkv_bias", None), ("llama-untied", "tied_head", True)])
def test_each_choice_changes_the_output(family, choice, off):
    """Each choice is used: the same weights without it (the q/k norms or the biases left
    out, the head read from the embeddings) give other logits."""
    hf, cfg = hf_pair(family)
    idx = torch.arange(90)[None] % cfg.vocab_size
    ours = minikv.GPT.from_llama_state_dict(hf.state_dict(), cfg).eval()
    without = minikv.GPT(minikv.GPTConfig(**{**cfg.to_dict(), choice: off})).eval()
    weights = {k: v for k, v in ours.state_dict().items() if k != "lm_head.weight"}
    without.load_state_dict(weights, strict=False)  # a tied head: wte's, as loaded
    with torch.no_grad():
        assert (ours(idx) - without(idx)).abs().max() > 0.1


def test_llama3_scaling_keeps_fast_pairs_slows_slow_ones_and_blends_between():
    inv = 500000.0 ** (-torch.arange(0, 16, 2) / 16)
    wave = 2 * torch.pi / inv
    got = llama3_frequencies(inv, 32.0, 1.0, 4.0, 64)
    fast, slow = wave < 64 / 4, wave > 64 / 1
    assert fast.any() and slow.any() and (~fast & ~slow).any()  # all three bands are tested
    assert torch.equal(got[fast], inv[fast])
    torch.testing.assert_close(got[slow], inv[slow] / 32)
    between = ~fast & ~slow
    assert ((got[between] > inv[between] / 32) & (got[between] < inv[between])).all()
    cos, _ = rope_angles(torch.arange(3), 16, 500000.0, LLAMA3)
    assert cos.shape == (3, 16)


def test_an_untied_head_is_its_own_matrix_and_counted():
    cfg = minikv.GPTConfig.preset("tiny", **TINY_LLAMA)
    tied, untied = minikv.GPT(cfg), minikv.GPT(minikv.GPTConfig(**{**cfg.to_dict(),
                                                                   "tied_head": False}))
    assert tied.lm_head.weight is tied.transformer.wte.weight
    assert untied.lm_head.weight is not untied.transformer.wte.weight
    assert untied.num_params() - tied.num_params() == cfg.vocab_size * cfg.n_embd


def test_a_state_dict_that_does_not_fit_the_choices_is_refused():
    hf, cfg = hf_pair("llama-untied")
    sd = dict(hf.state_dict())
    tied = minikv.GPTConfig(**{**cfg.to_dict(), "tied_head": True})
    with pytest.raises(ValueError, match="tied"):
        minikv.GPT.from_llama_state_dict(sd, tied)  # an untied head into a tied model
    del sd["lm_head.weight"]
    with pytest.raises(ValueError, match="lm_head.weight is missing"):
        minikv.GPT.from_llama_state_dict(sd, cfg)
    hf2, cfg2 = hf_pair("qwen2")
    no_bias = minikv.GPTConfig(**{**cfg2.to_dict(), "qkv_bias": None})
    with pytest.raises(ValueError, match="no place for.*bias"):
        minikv.GPT.from_llama_state_dict(hf2.state_dict(), no_bias)
    hf3, cfg3 = hf_pair("qwen3")
    with pytest.raises(ValueError, match="q_norm"):
        minikv.GPT.from_llama_state_dict(
            {k: v for k, v in hf3.state_dict().items() if "q_norm" not in k}, cfg3)


@pytest.mark.parametrize("bad, match", [
    (dict(tied_head=1), "tied_head must be True or False"),
    (dict(qk_norm="yes"), "qk_norm must be True or False"),
    (dict(qkv_bias=0), "qkv_bias must be True or False"),
    (dict(rope_scaling="llama3"), "rope_scaling must be"),
    (dict(rope_scaling=("yarn", 4.0, 1.0, 4.0, 64)), r"rope_scaling\[0\] must be one of"),
    (dict(rope_scaling=("llama3", 0.0, 1.0, 4.0, 64)), "factor must be a number > 0"),
    (dict(rope_scaling=("llama3", 8.0, 4.0, 1.0, 64)), "high_freq_factor"),
    (dict(rope_scaling=("llama3", 8.0, 1.0, 4.0, 64.0)), "original context must be"),
])
def test_the_config_refuses_bad_choices(bad, match):
    with pytest.raises((TypeError, ValueError), match=match):
        minikv.GPTConfig.preset("tiny", **LLAMA, **bad)


def test_choices_outside_their_block_are_refused():
    with pytest.raises(ValueError, match="positions='rope'"):
        minikv.GPTConfig.preset("tiny", rope_scaling=LLAMA3)  # learned positions do not turn
    with pytest.raises(ValueError, match="MLA has no k or v"):
        minikv.GPTConfig.preset("tiny", kv_lora_rank=16, qk_norm=True)
    with pytest.raises(ValueError, match="scaled RoPE"):
        model = minikv.GPT(minikv.GPTConfig.preset("tiny", **LLAMA, rope_scaling=LLAMA3))
        cache = minikv.SinkWindowCache.for_model(model, rope="reindex")
        model(torch.tensor([[1, 2]]), cache=cache)


def test_a_config_with_the_choices_keeps_them_through_json():
    """A JSON list read back is the tuple again, so the config stays equal and hashable."""
    import json
    cfg = minikv.GPTConfig.preset("tiny", **LLAMA, rope_scaling=LLAMA3, qkv_bias=True,
                                  tied_head=False)
    back = minikv.GPTConfig(**json.loads(json.dumps(cfg.to_dict())))
    assert back == cfg and hash(back) == hash(cfg)
    assert "tied_head" not in minikv.GPTConfig.preset("tiny").to_dict()  # GPT-2's: left out


@pytest.mark.parametrize("family", ["llama-untied", "qwen2", "qwen3", "llama3-rope"])
def test_a_checkpoint_keeps_the_choices(family, tmp_path):
    from minikv.course.checkpoint import load_checkpoint, save_checkpoint
    hf, cfg = hf_pair(family)
    model = minikv.GPT.from_llama_state_dict(hf.state_dict(), cfg).eval()
    back = load_checkpoint(save_checkpoint(model, tmp_path / family), "cpu")
    assert back.config == cfg
    idx = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.equal(back(idx), model(idx))
    assert (back.lm_head.weight is back.transformer.wte.weight) == cfg.tied_head
