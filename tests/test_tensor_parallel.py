"""Tensor parallelism (engine/parallel.py): a model split over ranks (processes in one gloo
group) decodes the tokens the whole model decodes, with every decoder and cache kind that
reads its heads alone; each rank's cache holds only its K/V heads (all of them replicated
once ranks outnumber K/V heads; MLA's latent on every rank)."""
import multiprocessing
import os

import pytest
import torch

import minikv
from minikv.engine.eagle import FeatureHead
from minikv.engine.parallel import launch, plan, run_sharded, shard, tensor_parallel
from minikv.engine.scheduler import FirstComeFirstServed
from minikv.engine.speculative import Speculation

from conftest import varied_model

P, P2 = [5, 9, 2, 7, 1, 3], [11, 4, 4, 8]
LOOPY = [3, 4, 5, 6, 3, 4, 5, 6, 3, 4, 5]  # prompt lookup finds its n-grams


def decoders(m, draft, head) -> dict:
    """Every decoder's tokens on `m` (a whole model, or a rank's shard of it: the feature
    head is sharded beside it)."""
    if hasattr(m, "shard"):
        head = shard(head, m.shard.rank, m.shard.world)
    fcfs = FirstComeFirstServed(8, chunked_prefill=True)
    reqs = [minikv.Request(P, 10), minikv.Request(P2, 10, arrival=2),
            minikv.Request(P + [6], 10, temperature=1.0, top_k=20, seed=7, arrival=1)]
    return {
        "greedy": minikv.generate(m, P, 20).tokens,
        "naive": minikv.generate(m, P, 8, mode="naive").tokens,
        "sampled": minikv.generate(m, P, 20, temperature=1.0, top_k=20, seed=3).tokens,
        "batch": [o.tokens for o in minikv.generate_batch(m, [P, P2], 12)],
        "draft": minikv.speculative_generate(m, draft, P, 20, gamma=3).tokens,
        "draft sampled": minikv.speculative_generate(m, draft, P, 20, gamma=3,
                                                     temperature=1.0, seed=5).tokens,
        "lookup": minikv.lookup_generate(m, LOOPY, 16).tokens,
        "feature tree": minikv.feature_generate(m, head, P, 16, gamma=2, tree=(2, 2)).tokens,
        "quantized": minikv.generate(
            m, P, 12, cache=minikv.QuantizedKVCache.for_model(m, max_len=20, bits=8)).tokens,
        "window": minikv.generate(
            m, P, 12, cache=minikv.SinkWindowCache.for_model(m, sinks=2, window=6)).tokens,
        "serve": [o.tokens for o in minikv.serve(m, reqs, policy=fcfs, page_size=4)],
        "serve draft": [o.tokens for o in minikv.serve(
            m, reqs[:2], speculative=Speculation(draft=draft, gamma=2), page_size=4)],
    }


def greedy(m) -> list[int]:
    return minikv.generate(m, P, 20).tokens


def model(**kw):
    """A wandering float64 model whose biases and norm scales are not 0 and 1 either (a bias
    split by heads, or added on every rank before the sum, would show)."""
    m = varied_model("tiny", **kw).double()
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 1:
                p.uniform_(-0.05, 0.05) if p.abs().sum() == 0 else p.uniform_(0.9, 1.1)
    return m


@pytest.fixture(scope="module")
def gpt2_run():
    """One launch: the GPT-2 block (4 heads, every one its own K/V), every decoder, 2 ranks."""
    m, draft = model(), varied_model("tiny", seed=1, n_layer=1).double()
    torch.manual_seed(2)
    head = FeatureHead(FeatureHead.config_for(m)).double().eval()
    return m, decoders(m, draft, head), tensor_parallel(m, 2, decoders, draft, head)


def test_every_decoder_decodes_what_one_process_decodes(gpt2_run):
    _, whole, ranks = gpt2_run
    for rank in ranks:
        for name, tokens in whole.items():
            assert rank["output"][name] == tokens, name
    assert len(set(whole["greedy"])) > 5  # the output wanders: equality means something


def test_each_rank_holds_its_heads_and_runs_two_all_reduces_a_layer_a_pass(gpt2_run):
    m, _, ranks = gpt2_run
    assert [r["shard"].q_heads for r in ranks] == [range(0, 2), range(2, 4)]
    assert [r["shard"].kv_heads for r in ranks] == [range(0, 2), range(2, 4)]
    assert [r["config"].kv_shape for r in ranks] == [(2, 16, 16)] * 2
    one = minikv.kv_cache_bytes(m.config, 100)
    assert sum(minikv.kv_cache_bytes(r["config"], 100) for r in ranks) == one
    assert ranks[0]["all_reduces"] == ranks[1]["all_reduces"] > 0
    assert ranks[0]["all_reduces"] % (2 * m.config.n_layer) == 0


@pytest.mark.parametrize("kw, world, kv_heads", [
    (dict(n_kv_head=2, **minikv.engine.config.LLAMA), 2, [range(0, 1), range(1, 2)]),
    (dict(n_kv_head=1, **minikv.engine.config.LLAMA), 2, [range(0, 1), range(0, 1)]),
    (dict(n_kv_head=2), 4, [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]),
    (dict(n_kv_head=2, qk_norm=True, qkv_bias=True, tied_head=False,  # a Qwen3-style block
          **minikv.engine.config.LLAMA), 2, [range(0, 1), range(1, 2)]),
])
def test_grouped_heads_split_and_past_n_kv_head_replicate(kw, world, kv_heads):
    """GQA at world = n_kv_head: a K/V head each; MQA, or more ranks than K/V heads: the
    ranks of one group hold (replicate) its K/V head, so a rank's cache stops shrinking."""
    m = model(**kw)
    ranks = tensor_parallel(m, world, greedy)
    assert all(r["output"] == greedy(m) for r in ranks)
    assert [r["shard"].kv_heads for r in ranks] == kv_heads
    per_rank = {minikv.kv_cache_bytes(r["config"], 64) for r in ranks}
    assert per_rank == {minikv.kv_cache_bytes(m.config, 64) * len(kv_heads[0])
                        // m.config.kv_heads}


def test_mla_keeps_its_whole_latent_on_every_rank_and_cla_splits_its_groups():
    mla, cla = model(kv_lora_rank=12), model(n_kv_head=2, layers_per_kv=2)
    for m in (mla, cla):
        ranks = tensor_parallel(m, 2, greedy)
        assert all(r["output"] == greedy(m) for r in ranks)
    assert ranks[0]["config"].kv_layers == 1  # one cache layer for the group of two
    mla_shard = plan(mla.config, 1, 2)
    assert mla_shard.q_heads == range(2, 4) and mla.config.kv_shape == (1, 12, 0)


@pytest.mark.parametrize("world", [3, 8])
def test_a_world_that_does_not_split_the_heads_is_refused_before_any_process(world):
    m = model(n_kv_head=2)
    with pytest.raises(ValueError, match=f"world={world} does not split"):
        tensor_parallel(m, world, greedy)


def test_plan_covers_every_head_once_and_each_query_reads_its_own_kv_head():
    cfg = minikv.GPTConfig.preset("target", n_kv_head=4)
    for world in (1, 2, 4, 8):
        shards = [plan(cfg, r, world) for r in range(world)]
        assert sorted(h for s in shards for h in s.q_heads) == list(range(cfg.n_head))
        group = cfg.n_head // cfg.kv_heads
        for s in shards:  # every query head's K/V head lives on its rank
            assert {q // group for q in s.q_heads} <= set(s.kv_heads)


def test_a_shard_is_a_smaller_gpt_whose_slices_tile_the_whole():
    m = model(**minikv.engine.config.LLAMA, n_kv_head=2)
    parts = [shard(m, r, 2) for r in range(2)]  # built without a group: no pass is run
    fc = torch.cat([p.transformer.h[0].mlp.c_fc.weight.chunk(2)[0] for p in parts])
    assert torch.equal(fc, m.transformer.h[0].mlp.c_fc.weight.chunk(2)[0])  # the gates
    out = torch.cat([p.transformer.h[1].attn.c_proj.weight for p in parts], dim=1)
    assert torch.equal(out, m.transformer.h[1].attn.c_proj.weight)
    assert parts[0].config.head_dim == m.config.head_dim and parts[0].config.n_head == 2


def fails(rank, world):
    if rank == 1:
        raise ValueError("rank one's bad day")
    return rank


def test_a_failing_rank_is_named_and_no_process_is_left():
    with pytest.raises(RuntimeError, match="(?s)rank 1 failed:.*rank one's bad day"):
        launch(fails, 2)
    assert not multiprocessing.active_children()


def test_run_sharded_reports_its_rank():
    out = launch(run_sharded, 2, model(), greedy)
    assert [o["shard"].rank for o in out] == [0, 1]


def test_the_bench_times_both_ways_and_counts_what_a_rank_holds():
    """bench-tp's machinery on a tiny model (its timings are not checked: a benchmark's)."""
    from minikv.bench.tensor_parallel import bench
    torch.manual_seed(0)
    r = bench(minikv.GPT(minikv.GPTConfig.preset("tiny")).eval(), quick=True)
    assert [row["name"] for row in r["rows"]] == [
        "1 process, 1 thread", "1 process, 2 threads", "2 ranks, 1 thread each"]
    assert r["same_tokens"] and r["all_reduces_per_token"] == 2 * 2
    assert r["cache_bytes_per_rank"] * 2 == r["cache_bytes_one_process"]
    assert all(row["decode_tokens_per_s"] > 0 for row in r["rows"])


ORPHAN_FN = '''import os, time


def fn(rank, world, folder):
    with open(os.path.join(folder, f"rank{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(3)  # the parent is killed meanwhile: nobody will read this or set `done`
    return rank
'''
ORPHAN_SCRIPT = '''import os, signal, sys, threading, time
folder = sys.argv[1]
sys.path.insert(0, folder)
from minikv.engine.parallel import launch
from orphan_fn import fn


def kill_me_once_the_ranks_run():
    while sum(name.endswith(".pid") for name in os.listdir(folder)) < 2:
        time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    threading.Thread(target=kill_me_once_the_ranks_run, daemon=True).start()
    launch(fn, 2, folder)
'''


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's parent may never reap it)."""
    try:
        return "State:\tZ" not in open(f"/proc/{pid}/status").read()
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc (Linux)")
def test_ranks_whose_parent_is_killed_exit_instead_of_waiting_forever(tmp_path):
    """A SIGKILLed parent never tells its ranks they may go (`done`): each notices it was
    orphaned and exits, within seconds, instead of waiting for good."""
    import signal
    import subprocess
    import sys
    import time
    (tmp_path / "orphan_fn.py").write_text(ORPHAN_FN)
    (tmp_path / "orphan.py").write_text(ORPHAN_SCRIPT)
    run = subprocess.run([sys.executable, str(tmp_path / "orphan.py"), str(tmp_path)],
                         timeout=120)
    assert run.returncode == -signal.SIGKILL
    pids = [int(p.read_text()) for p in tmp_path.glob("rank*.pid")]
    assert len(pids) == 2
    deadline = time.time() + 30
    while time.time() < deadline and any(_running(p) for p in pids):
        time.sleep(0.2)
    left = [p for p in pids if _running(p)]
    for p in left:  # not to leave them behind for the rest of the run
        os.kill(p, signal.SIGKILL)
    assert not left, f"ranks {left} still waiting for a parent that is gone"
