"""The memory plan (engine/cache.py memory_plan): free memory x utilization, less the weights
and a reserve, is the KV pool; the pool the server then allocates has exactly those bytes, and
the requests the plan says fit run to their last position together, one more does not."""
import pytest
import torch

import minikv
from minikv.course.checkpoint import load_course_model
from minikv.course.device import free_memory
from minikv.engine.cache import memory_plan
from minikv.engine.radix import block_bytes
from minikv.server import create_app

MODEL, TOK = load_course_model("draft", device="cpu")


def test_the_plan_spends_the_budget_and_no_more():
    plan = memory_plan(MODEL, 64 * 2**20, 0.5, page_size=16, request_len=100)
    assert plan.budget == 32 * 2**20
    assert plan.weights == sum(p.nbytes for p in MODEL.parameters())  # the tied head once
    assert plan.weights + plan.reserve + plan.pool <= plan.budget
    assert plan.budget - (plan.weights + plan.reserve + plan.pool) < plan.block  # no block left
    assert plan.block == minikv.kv_cache_bytes(MODEL.config, 16, dtype=torch.float32)
    assert plan.request_blocks == 7 and plan.requests == plan.num_blocks // 7


def test_the_server_allocates_the_planned_pool():
    plan = memory_plan(MODEL, 8 * 2**20, 0.9, page_size=8, reserve=0)
    app = create_app(MODEL, TOK, "draft", num_blocks=plan.num_blocks, page_size=8)
    pool = app.state.worker.engine.pool
    assert pool.num_blocks == plan.num_blocks and block_bytes(pool) == plan.block
    assert sum(t.nbytes for t in pool.keys + pool.values) == plan.pool


def test_with_cuda_graphs_the_reserve_holds_the_largest_graphs_gathered_kv():
    """GraphDecode's pass hands attention every row's whole table, a layer at a time: the
    plan keeps those bytes for the largest captured batch beside the activations."""
    from minikv.engine.paged import BlockPool
    from minikv.engine.static import GraphDecode
    plain, graphed = (memory_plan(MODEL, 2**30, 0.5, page_size=8, graphs=g) for g in (0, 8))
    pool = BlockPool(MODEL.config, 8, 8)
    batch = GraphDecode(MODEL, pool, (8,)).batches[8]
    cfg = MODEL.config
    key = torch.zeros(8, cfg.kv_heads, 1, cfg.head_dim)
    with torch.inference_mode():
        k, v = batch.update(key, key, 0)
    assert graphed.reserve - plain.reserve == k.nbytes + v.nbytes
    assert graphed.num_blocks < plain.num_blocks
    with pytest.raises(ValueError, match="graphs"):
        memory_plan(MODEL, 2**30, graphs=-1)


def finished_together(n: int, num_blocks: int, page_size: int, length: int) -> bool:
    """Do n requests of `length` positions, arriving at once, all run without waiting or
    being preempted?"""
    reqs = [minikv.Request([1 + i, 2, 3, 4], length - 4) for i in range(n)]
    outs = minikv.serve(MODEL, reqs, num_blocks=num_blocks, page_size=page_size,
                        max_running=n, prefix_caching=False, trace=True)
    first = [min(e.step for e in o.trace if e.token is not None) for o in outs]
    return not any(o.stats.preempted for o in outs) and max(first) == 0


def test_the_requests_it_says_fit_run_to_the_end_together_and_one_more_does_not():
    block = minikv.kv_cache_bytes(MODEL.config, 4, dtype=torch.float32)
    weights = sum(p.nbytes for p in MODEL.parameters())
    plan = memory_plan(MODEL, weights + 30 * block, 1.0, page_size=4, request_len=16,
                       reserve=0)
    assert (plan.num_blocks, plan.request_blocks, plan.requests) == (30, 4, 7)
    assert finished_together(plan.requests, plan.num_blocks, 4, 16)
    assert not finished_together(plan.requests + 1, plan.num_blocks, 4, 16)


@pytest.mark.parametrize("kwargs, message", [
    (dict(free_bytes=2**20), "no block"),  # the weights alone need more
    (dict(free_bytes=2**30, utilization=1.5), "utilization must be a fraction"),
    (dict(free_bytes=2**30, utilization=0), "utilization must be a fraction"),
    (dict(free_bytes=-1), "free_bytes"),
    (dict(free_bytes=2**30, page_size=0), "page_size"),
])
def test_a_plan_that_cannot_be_made_says_why(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        memory_plan(MODEL, **kwargs)


def test_this_machine_reports_free_memory():
    assert free_memory(torch.device("cpu")) > 0
