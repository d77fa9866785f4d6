"""static.py: a decode step of fixed shapes gives generate's greedy tokens, for every block
choice it takes, eager and compiled, and a compiled step is traced once, not once a length."""
import shutil

import pytest
import torch

import minikv
from minikv.engine.config import LLAMA
from minikv.engine.static import StaticCache, forward, static_generate

from conftest import varied_model

BLOCKS = {"gpt2": {}, "gqa": dict(n_kv_head=2), "mqa": dict(n_kv_head=1),
          "llama": dict(n_kv_head=2, n_inner=176, **LLAMA),
          "qwen3": dict(n_kv_head=2, n_inner=176, qk_norm=True, qkv_bias=True, **LLAMA),
          "shared layers": dict(layers_per_kv=2)}


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_static_greedy_tokens_are_generates(name):
    model = varied_model(seed=3, **BLOCKS[name])
    for prompt in ([5], [3, 1, 4, 1, 5, 9, 2, 6], list(range(30))):
        want = minikv.generate(model, prompt, 24).tokens
        assert static_generate(model, prompt, 24) == want, (name, prompt)


def test_the_cache_hands_attention_every_slot_and_writes_at_the_positions():
    model = varied_model(seed=1)
    cache, cfg = StaticCache(model, 12), model.config
    with torch.inference_mode():
        forward(model, cache, torch.tensor([[1, 2, 3]]), torch.arange(3))
    k = cache.keys[0]
    assert k[0, :, 3:].abs().sum() == 0 and (k[0, :, :3].abs().sum(-1) > 0).all()  # at 0..2
    cache.positions = torch.tensor([5])
    ones = torch.ones(1, cfg.kv_heads, 1, cfg.head_dim)
    with torch.inference_mode():
        k, v = cache.update(ones, 2 * ones, 0)
    assert k.shape[2] == v.shape[2] == 12  # every slot, whatever the length
    assert (k[0, :, 5] == 1).all() and (v[0, :, 5] == 2).all() and k[0, :, 4].abs().sum() == 0


def test_bad_calls_are_refused_before_anything_is_allocated():
    model = varied_model(seed=1)
    with pytest.raises(ValueError, match="max_new_tokens"):
        static_generate(model, [1, 2], 0)
    with pytest.raises(ValueError, match="block_size"):
        static_generate(model, [1] * model.config.block_size, 2)
    with pytest.raises(ValueError, match="MLA's latent"):
        StaticCache(varied_model(kv_lora_rank=16), 8)
    with pytest.raises(ValueError, match="max_len"):
        StaticCache(model, model.config.block_size + 1)


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="torch.compile on a CPU needs a C++ compiler")
def test_a_compiled_step_gives_the_same_tokens_and_is_traced_once():
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    model = varied_model(seed=3, n_kv_head=2)
    step = torch.compile(forward, fullgraph=True, dynamic=False)
    want = minikv.generate(model, [3, 1, 4], 20).tokens
    assert static_generate(model, [3, 1, 4], 20, step=step) == want
    assert counters["stats"]["unique_graphs"] == 1  # one trace for the 19 decode steps
    again = static_generate(model, [2, 7, 5], 20, step=step)  # a new cache of the same size
    assert again == minikv.generate(model, [2, 7, 5], 20).tokens
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.cuda
def test_on_a_gpu_the_step_replayed_as_a_cuda_graph_gives_the_same_tokens():
    """mode="reduce-overhead": the step's launches captured once, replayed each step."""
    model = varied_model(seed=3, n_kv_head=2).cuda()
    step = torch.compile(forward, fullgraph=True, dynamic=False, mode="reduce-overhead")
    want = minikv.generate(model, [3, 1, 4], 20).tokens
    assert static_generate(model, [3, 1, 4], 20, step=step) == want
    assert static_generate(model, [2, 7, 5], 20, step=step) == \
        minikv.generate(model, [2, 7, 5], 20).tokens
