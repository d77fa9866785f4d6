"""The Llama-style block (RoPE, RMSNorm, SwiGLU, grouped-query attention, no biases) is a config
choice of the one model: equal to Hugging Face's LlamaForCausalLM on random weights, and every
decoder and cache equal to its naive reference on it."""
import pytest
import torch

import minikv
from minikv.course.bugs import PositionsFromZero
from minikv.engine.config import LLAMA
from minikv.engine.rope import rope_angles, rotate

from conftest import varied_model

transformers = pytest.importorskip("transformers")
TINY_LLAMA = dict(n_kv_head=2, n_inner=176, **LLAMA)  # the tiny preset with a Llama-style block


def hf_llama(seed: int = 0, **overrides):
    """A random LlamaForCausalLM shaped like the tiny preset with a Llama-style block, its
    weights drawn wide enough (std 0.1) that the greedy output wanders."""
    cfg = minikv.GPTConfig.preset("tiny", **TINY_LLAMA, **overrides)
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.n_embd, intermediate_size=cfg.n_inner,
        num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head,
        num_key_value_heads=cfg.kv_heads, max_position_embeddings=cfg.block_size,
        rms_norm_eps=cfg.layer_norm_eps, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta})
    torch.manual_seed(seed)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.1)
            else:
                p.uniform_(0.5, 1.5)  # the norms' scales, not all ones
    return hf, cfg


def test_logits_equal_transformers_llama():
    hf, cfg = hf_llama()
    ours = minikv.GPT.from_llama_state_dict(hf.state_dict(), cfg).eval()
    idx = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs, mine = hf(idx).logits, ours(idx)
    assert (theirs - mine).abs().max() < 1e-4


def test_120_greedy_tokens_equal_transformers_llama():
    hf, cfg = hf_llama(seed=1)
    ours = minikv.GPT.from_llama_state_dict(hf.state_dict(), cfg).eval()
    prompt = [3, 14, 15, 92, 65]
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=120, do_sample=False,
                             min_new_tokens=120)[0, len(prompt):].tolist()
    mine = minikv.generate(ours, prompt, 120).tokens
    assert mine == theirs and len(set(mine)) > 10  # and the output is not one token repeated


def test_an_untied_head_is_refused():
    hf, cfg = hf_llama()
    sd = dict(hf.state_dict())
    sd["lm_head.weight"] = sd["lm_head.weight"] + 1
    with pytest.raises(ValueError, match="tied"):
        minikv.GPT.from_llama_state_dict(sd, cfg)


def test_a_rotation_keeps_lengths_and_scores_depend_only_on_the_distance():
    """RoPE's two facts the chapter uses: a rotation keeps a vector's length, and q_m . k_n
    depends on m - n alone, so a key rotated once, at its own position, stays right for
    every later query (the cache stores K rotated and never touches it again)."""
    torch.manual_seed(0)
    q, k = torch.randn(2, 1, 1, 1, 16).unbind(0)  # (1, 1, 1, 16) each

    def at(x, p):
        cos, sin = rope_angles(torch.tensor([p]), 16, 10000.0)
        return rotate(x, cos, sin)
    assert torch.allclose(at(q, 37).norm(), q.norm(), atol=1e-5)
    scores = [(at(q, m) * at(k, n)).sum() for m, n in [(5, 2), (105, 102), (203, 200)]]
    assert torch.allclose(torch.stack(scores), scores[0].expand(3), atol=1e-4)


@pytest.fixture(scope="module")
def llama():
    return varied_model("tiny", std=0.2, **TINY_LLAMA)  # at 0.1 the SwiGLU block repeats one token


def test_the_cache_holds_keys_already_turned(llama):
    """Layer 0's cached keys are its keys turned by their positions, 0..T-1; a decode step
    appends its key turned by its own position and leaves the others as they were."""
    idx = torch.tensor([[5, 6, 7, 8]])
    cache = minikv.KVCache.for_model(llama, max_len=8)
    block, cfg = llama.transformer.h[0], llama.config
    with torch.no_grad():
        llama(idx, cache=cache)
        before = cache.keys[0][:, :, :4].clone()
        llama(torch.tensor([[9]]), cache=cache)
        x = block.ln_1(llama.transformer.wte(torch.tensor([[5, 6, 7, 8, 9]])))
        k = block.attn.c_attn(x).split([cfg.n_embd, 32, 32], dim=2)[1]
        k = k.view(1, 5, cfg.kv_heads, cfg.head_dim).transpose(1, 2)
        turned = rotate(k, *rope_angles(torch.arange(5), cfg.head_dim, cfg.rope_theta))
    assert torch.allclose(cache.keys[0][:, :, :5], turned, atol=1e-5)
    assert torch.equal(cache.keys[0][:, :, :4], before)


def test_cached_equals_naive(llama):
    naive = minikv.generate(llama, [1, 2, 3], 60, mode="naive")
    cached = minikv.generate(llama, [1, 2, 3], 60)
    assert cached.tokens == naive.tokens and len(set(naive.tokens)) > 10


def test_a_decode_step_at_position_0_breaks_rope_too(llama):
    """The position bug under RoPE: the new key is rotated as if at position 0."""
    right = minikv.generate(llama, [1, 2, 3, 4, 5], 30)
    wrong = minikv.generate(PositionsFromZero(llama), [1, 2, 3, 4, 5], 30)
    assert right.tokens != wrong.tokens


def test_speculative_and_lookup_equal_the_target(llama):
    draft = varied_model("tiny", seed=1, std=0.2, **{**TINY_LLAMA, "n_layer": 1})
    target = minikv.generate(llama, [1, 2, 3], 40).tokens
    for gamma in (1, 3, 5):
        assert minikv.speculative_generate(llama, draft, [1, 2, 3], 40, gamma=gamma).tokens \
            == target
    assert minikv.lookup_generate(llama, [1, 2, 3], 40).tokens == target


def test_batch_and_serve_equal_each_alone(llama):
    prompts = [[1, 2, 3], [9, 8, 7, 6, 5, 4], [7]]
    alone = [minikv.generate(llama, p, 12).tokens for p in prompts]
    assert [o.tokens for o in minikv.generate_batch(llama, prompts, 12)] == alone
    requests = [minikv.Request(p, 12, deterministic=True, arrival=i)
                for i, p in enumerate(prompts)]
    served = minikv.serve(llama, requests, page_size=4, num_blocks=12)
    assert [o.tokens for o in served] == alone


def test_quantized_and_sink_window_caches_run_on_rope(llama):
    """int8 keys (stored rotated) stay close; a sink + window cache keeps true positions."""
    exact = minikv.generate(llama, [1, 2, 3], 20, return_logits=True)
    q8 = minikv.QuantizedKVCache.for_model(llama, bits=8)
    quant = minikv.generate(llama, [1, 2, 3], 20, cache=q8, return_logits=True)
    assert (quant.logits - exact.logits).abs().max() < 0.1 * exact.logits.abs().max()
    window = minikv.SinkWindowCache.for_model(llama, sinks=2, window=8)
    out = minikv.generate(llama, list(range(1, 40)), 5, cache=window)
    assert len(out.tokens) == 5


def test_the_config_refuses_an_odd_rope_head_dim():
    with pytest.raises(ValueError, match="even head_dim"):
        minikv.GPTConfig.preset("tiny", **{**TINY_LLAMA, "n_embd": 60})  # head_dim 15


def test_a_checkpoint_keeps_the_block_choices(llama, tmp_path):
    from minikv.course.checkpoint import load_checkpoint, save_checkpoint
    loaded = load_checkpoint(save_checkpoint(llama, tmp_path / "llama"), "cpu")
    assert loaded.config == llama.config and "transformer.wpe.weight" not in loaded.state_dict()
    assert minikv.generate(loaded, [1, 2, 3], 20).tokens == minikv.generate(llama, [1, 2, 3],
                                                                            20).tokens
