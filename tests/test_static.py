"""static.py: a decode step of fixed shapes gives generate's greedy tokens, for every block
choice it takes, eager and compiled, and a compiled step is traced once, not once a length.
The server's decode batch at fixed shapes (GraphDecode): the engine's tokens, padded or not,
its padding rows touching no block but row 0's slot, with row 0's own bits; on a GPU,
replayed as CUDA graphs."""
import shutil

import pytest
import torch

import minikv
from minikv.engine.config import LLAMA
from minikv.engine.paged import BlockPool, BlockTable
from minikv.engine.serving import Engine
from minikv.engine.static import GraphDecode, StaticCache, forward, static_generate

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


def serve_steps(model, graphs, requests, num_blocks=64, **kwargs) -> dict:
    """Every request's tokens from an Engine (graphs: the decode through GraphDecode)."""
    engine = Engine(model, num_blocks, graphs=graphs, **kwargs)
    for r in requests:
        engine.add(r)
    out = {i: [] for i in range(len(requests))}
    while engine.has_work():
        for i, (tokens, _) in engine.step().items():
            out[i] += tokens
    return out


MIXED = [minikv.Request([3, 1, 4, 1, 5], 21), minikv.Request(list(range(2, 19)), 9),
         minikv.Request([7], 30, arrival=2),
         minikv.Request([9, 9, 2], 12, temperature=0.8, seed=5),
         minikv.Request([4, 4, 4, 4], 14, deterministic=True, temperature=1.0, seed=1)]


@pytest.mark.parametrize("name", ["gpt2", "gqa", "llama", "shared layers"])
def test_the_engine_through_graph_decode_gives_the_eager_engines_tokens(name):
    """Batches of 1..4 rows in sizes (1, 2, 4) (3 rows: one padding row), a batch of 5 past
    the largest size (the eager pass), a request that arrives later, sampled and
    deterministic rows, a page of 4 positions so tables cross blocks every few steps."""
    model = varied_model(seed=3, **BLOCKS[name])
    want = serve_steps(model, None, MIXED, page_size=4)
    assert serve_steps(model, (1, 2, 4), MIXED, page_size=4) == want
    assert serve_steps(model, (8,), MIXED, page_size=4) == want  # every batch padded to 8


def test_padding_rows_write_row_0s_own_kv_to_row_0s_slot_and_nothing_else():
    """The same two rows alone (size 2) and with six padding rows (size 8): the same
    slots written, the same logits (up to a matmul's batch-dependent rounding)."""
    model = varied_model(seed=1, n_kv_head=2)
    logits = []
    for sizes in ((2,), (8,)):
        torch.manual_seed(0)
        pool = BlockPool(model.config, 8, 4)
        for layer in pool.keys + pool.values:
            layer.normal_()  # every slot holds something a stray write would change
        before = torch.stack(pool.keys + pool.values)
        tables = [BlockTable(0, [4, 1], 5), BlockTable(1, [2], 2)]
        with torch.inference_mode():
            logits.append(GraphDecode(model, pool, sizes)(tables, [7, 3]).clone())
        assert [t.length for t in tables] == [6, 3]  # the new positions are live
        changed = (torch.stack(pool.keys + pool.values) != before).any(-1)  # (2L, blocks, H, page)
        written = changed.nonzero()[:, [1, 3]].unique(dim=0).tolist()
        assert written == [[1, 1], [2, 2]], sizes  # (block, slot): position 5 of row 0, 2 of row 1
    assert logits[0].shape == logits[1].shape == (2, model.config.vocab_size)
    torch.testing.assert_close(logits[1], logits[0])


def test_graph_decode_refuses_what_it_cannot_hold():
    model = varied_model(seed=1)
    pool = BlockPool(model.config, 4, 4)
    for sizes in ((), (2, 1), (0,), [1, 2], (1.0,), (1, 1)):
        with pytest.raises(ValueError, match="rising"):
            GraphDecode(model, pool, sizes)
    with pytest.raises(ValueError, match="MLA's latent"):
        GraphDecode(varied_model(kv_lora_rank=16), pool)
    with pytest.raises(ValueError, match="record sizes up to 4"):
        GraphDecode(model, pool, (1, 8))  # 8 rows would need 8 blocks
    graphs = GraphDecode(model, pool, (1, 2))
    assert graphs.fits([BlockTable(0, [0])] * 2) and not graphs.fits([BlockTable(0, [0])] * 3)
    assert [graphs.size_for(n) for n in (1, 2, 3)] == [1, 2, None]
    with pytest.raises(TypeError, match="must be a minikv.GPT"):
        GraphDecode(torch.nn.Linear(2, 2), pool)


@pytest.mark.cuda
def test_on_a_gpu_the_engines_decode_replayed_as_cuda_graphs_gives_the_eager_tokens():
    model = varied_model(seed=3, n_kv_head=2).cuda()
    want = serve_steps(model, None, MIXED, page_size=4)
    engine = Engine(model, 64, graphs=(1, 2, 4), page_size=4)
    assert sorted(engine.runner.graphs.graphs) == [1, 2, 4]  # captured, one a size
    assert serve_steps(model, (1, 2, 4), MIXED, page_size=4) == want


def test_bench_compiles_server_rows_compare_the_same_engines_tokens():
    """bench-compile's second table: per batch size, the eager engine's row first (× 1.00),
    then the fixed-shape pass's, each saying whether its tokens are the eager engine's."""
    from minikv.bench.compile import graph_rows
    model = varied_model(seed=3, n_kv_head=2)
    rows, table = graph_rows(model, list(range(3, 40)), (1, 3), 2)
    assert table == -(-model.config.block_size // 16) * 16  # a row's whole table, pages of 16
    assert [(r["batch"], r["name"]) for r in rows] == [
        (1, "eager, split-KV"), (1, "static, eager"), (3, "eager, split-KV"), (3, "static, eager")]
    assert all(r["same_tokens"] for r in rows) and rows[0]["vs_eager"] == 1.0
