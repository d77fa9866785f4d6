"""Disaggregated serving (engine/disagg.py): a prompt computed by the prefill worker process, its
K/V sent to this process's pool, the request decoding here. Every request gets the tokens it
gets from serve() in one process (greedy and seeded sampling, random arrivals); neither pool
leaks a block; bad input, a closed engine and a dead worker are clear errors, not hangs.

Starting a worker costs a second or two, so one engine serves the module (`shared`), restarted
only after a test that closes or kills it."""
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import minikv
from minikv.engine import Engine
from minikv.engine.disagg import DisaggregatedEngine
from minikv.engine.radix import Radix

from conftest import varied_model

MODEL = varied_model().double()  # float64: a prompt computed in two passes flips no token
BLOCKS, PAGE = 48, 8
_engine = []  # the module's one live engine (one process group per process)


def shared() -> DisaggregatedEngine:
    if not _engine or _engine[0].closed:
        _engine[:] = [DisaggregatedEngine(MODEL, BLOCKS, page_size=PAGE, timeout=30)]
    return _engine[0]


def fresh(**kwargs) -> DisaggregatedEngine:
    if _engine:
        _engine.pop().close()
    return DisaggregatedEngine(MODEL, BLOCKS, page_size=PAGE, timeout=30, **kwargs)


@pytest.fixture(scope="module", autouse=True)
def close_at_the_end():
    yield
    if _engine:
        _engine.pop().close()


def requests_from(seed: int, n: int) -> list[minikv.Request]:
    """n requests: random prompts (a shared beginning for some), budgets, arrival steps, half
    of them sampled with their own seed."""
    rng = random.Random(seed)
    system = [rng.randrange(512) for _ in range(12)]
    out = []
    for k in range(n):
        prompt = [rng.randrange(512) for _ in range(rng.randint(1, 60))]
        sampled = dict(temperature=0.9, top_k=50, seed=rng.randrange(100)) if k % 2 else {}
        out.append(minikv.Request(system * (k % 3 == 0) + prompt, rng.randint(1, 10),
                                  arrival=rng.randrange(6), **sampled))
    return out


def run(engine, requests) -> list[list[int]]:
    for i, r in enumerate(requests):
        engine.add(r, index=i)
    while engine.has_work():
        engine.step()
    outputs = engine.outputs()
    tokens = [outputs[i].tokens for i in range(len(requests))]
    for i in range(len(requests)):
        engine.forget(i)
    return tokens


def assert_every_block_free(engine: DisaggregatedEngine) -> None:
    """Nothing but the tree holds a block; once it lets go, every block is free, refs 0."""
    engine.tree.evict(engine.pool.num_blocks)
    assert engine.pool.n_free == engine.pool.num_blocks
    assert all(c == 0 for c in engine.pool.ref)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), n=st.integers(1, 6))
def test_every_request_gets_what_it_gets_in_one_process(seed, n):
    requests = requests_from(seed, n)
    alone = [o.tokens for o in minikv.serve(MODEL, requests, page_size=PAGE)]
    engine = shared()
    assert run(engine, requests) == alone
    assert not engine.transfers and not engine.has_work()  # forgotten with their requests
    assert_every_block_free(engine)


def test_the_prompt_travels_and_only_its_last_position_is_computed_here():
    """The decode side computes one position of a transferred prompt (its K/V came from the
    worker: bit for bit what this process computes), and counts the bytes and seconds."""
    engine = shared()
    prompt = list(range(3, 43))  # 40 tokens: 39 travel, the last is computed here
    engine.add(minikv.Request(prompt, 5), index=0)
    engine.add(minikv.Request([9, 8, 7], 30), index=1)  # running while the other transfers
    while engine.has_work():
        engine.step()
    out, moved = engine.outputs()[0], engine.transfers[0]
    assert out.stats.reused == 39 and out.tokens == minikv.serve(MODEL, [out.request])[0].tokens
    cfg = MODEL.config
    assert moved["positions"] == 39
    assert moved["bytes"] == 39 * 2 * cfg.n_layer * cfg.n_embd * 8  # K and V, float64
    assert engine.stats()["bytes_moved"] == moved["bytes"] + engine.transfers[1]["bytes"]
    assert moved["seconds"] > 0 and moved["prefill_s"] > 0
    assert len(moved["blocks_there"]) == -(-39 // PAGE)  # the worker's block ids
    local = Engine(MODEL, BLOCKS, page_size=PAGE, prefix_caching=Radix())
    local.add(minikv.Request(prompt[:-1], 1))
    while local.has_work():
        local.step()
    n, keys, values = local.scheduler.prefix.export(prompt[:-1])
    here = engine.tree.export(prompt[:-1])
    assert here[0] == n == 39
    assert torch.equal(here[1], keys) and torch.equal(here[2], values)
    engine.forget(0)
    engine.forget(1)
    assert_every_block_free(engine)


def test_the_worker_ends_with_every_block_free():
    engine = shared()
    run(engine, requests_from(3, 4))
    report = engine.close()
    assert report["kept"] > 0  # its tree kept the prompts it computed ...
    assert report["free"] == report["num_blocks"] == BLOCKS and report["refs"] == 0  # ... only
    assert engine.close() == report  # closing twice is harmless


def test_bad_requests_are_refused_and_leave_the_engine_as_it_was():
    engine = shared()
    before = engine.stats()
    with pytest.raises(ValueError, match="lower max_new_tokens"):
        engine.add(minikv.Request([1, 2, 3], 250))
    with pytest.raises(ValueError, match="deterministic request is not served disaggregated"):
        engine.add(minikv.Request([1, 2, 3], 4, deterministic=True))
    with pytest.raises(TypeError, match="must be a minikv.Request"):
        engine.add([1, 2, 3])
    engine.add(minikv.Request([1, 2, 3], 2), index=0)
    with pytest.raises(ValueError, match="already in this engine"):
        engine.add(minikv.Request([4, 5], 2), index=0)
    with pytest.raises(ValueError, match="index must be"):
        engine.add(minikv.Request([4, 5], 2), index=-1)
    engine.abort(0)
    assert engine.stats() == before and not engine.has_work()


def test_a_request_aborted_anywhere_leaves_nothing_behind():
    """Aborted before its arrival step, while its prompt is at the worker, while decoding: gone,
    the others unaffected, every block back."""
    engine = shared()
    others = [minikv.Request([4, 5, 6], 12), minikv.Request(list(range(7, 30)), 6)]
    for i, r in enumerate(others):
        engine.add(r, index=i)
    engine.add(minikv.Request(list(range(1, 50)), 5, arrival=50), index=2)  # not yet arrived
    engine.add(minikv.Request(list(range(2, 60)), 5), index=3)
    engine.step()  # 3's prompt is at the worker (or back already)
    engine.abort(2)
    engine.abort(3)
    engine.step()
    engine.abort(0)  # decoding
    while engine.has_work():
        engine.step()
    outputs = engine.outputs()
    assert set(outputs) <= {0, 1} and outputs[1].tokens == minikv.serve(MODEL, others)[1].tokens
    for i in list(outputs):
        engine.forget(i)
    assert_every_block_free(engine)


def test_kv_that_finds_no_room_here_is_computed_here_instead(monkeypatch):
    """K/V that comes back to a pool too full to hold it (the tree's restore: MemoryError; made
    to happen here, its timing depends on the machine) is dropped; the request computes its
    prompt here once admitted: the same tokens, every block back."""
    engine = shared()

    def full(tokens, keys, values):
        raise MemoryError("the pool cannot hold them")
    monkeypatch.setattr(engine.tree, "restore", full)
    requests = [minikv.Request([4, 5, 6], 20), minikv.Request(list(range(2, 42)), 3, arrival=4)]
    for i, r in enumerate(requests):
        engine.add(r, index=i)
    while engine.has_work():
        engine.step()
    outputs = engine.outputs()
    assert [outputs[i].tokens for i in (0, 1)] == [
        o.tokens for o in minikv.serve(MODEL, requests, page_size=PAGE)]
    assert engine.transfers[1]["recomputed"] and outputs[1].stats.reused == 0
    engine.forget(0)
    engine.forget(1)
    monkeypatch.undo()
    assert_every_block_free(engine)


def test_a_prompt_longer_than_the_workers_pool_is_refused():
    with fresh(prefill_blocks=2) as engine:
        with pytest.raises(ValueError, match="prefill worker's pool.*prefill_blocks"):
            engine.add(minikv.Request(list(range(1, 40)), 2))
        assert run(engine, [minikv.Request([5, 6, 7], 3)]) == [
            minikv.serve(MODEL, [minikv.Request([5, 6, 7], 3)])[0].tokens]


def test_a_closed_engine_and_a_second_engine_are_clear_errors():
    engine = shared()
    with pytest.raises(RuntimeError, match="already in a torch.distributed group"):
        DisaggregatedEngine(MODEL, BLOCKS)
    engine.close()
    assert not engine.worker.is_alive()
    for call in (lambda: engine.add(minikv.Request([1], 1)), engine.step):
        with pytest.raises(RuntimeError, match="closed: start a new one"):
            call()


def test_a_dead_worker_is_a_clear_error_not_a_hang():
    engine = fresh()
    engine.worker.kill()
    engine.add(minikv.Request(list(range(1, 30)), 3))
    with pytest.raises(RuntimeError, match="prefill worker failed, died or timed out"):
        for _ in range(100):
            engine.step()
    assert engine.closed and not torch.distributed.is_initialized()


def test_in_lockstep_a_request_joins_at_its_arrival_step_as_on_one_engine():
    """lockstep=True: every step waits for the K/V it sent, so the decode side computes, step
    by step, what one Engine computes less each prompt but its last position; traced, its
    steps are the same on every run."""
    from minikv.viz.pool import step_composition
    requests = [minikv.Request([4, 5, 6], 12), minikv.Request([7, 8], 12),
                minikv.Request(list(range(10, 43)), 4, arrival=3)]
    one = Engine(MODEL, BLOCKS, page_size=PAGE, trace=True)
    for r in requests:
        one.add(r)
    while one.has_work():
        one.step()
    with fresh(lockstep=True, trace=True) as engine:
        for i, r in enumerate(requests):
            engine.add(r, index=i)
        while engine.has_work():
            engine.step()
        outs = list(engine.outputs().values())
        run_traced = step_composition(outs)
        tokens = [o.tokens for o in outs]
    assert tokens == [o.tokens for o in one.outputs().values()]
    alone = step_composition(list(one.outputs().values()))
    assert sorted(run_traced) == sorted(alone)  # the same steps
    for step, rows in alone.items():
        want = [(r, kind, 1 if kind == "prompt" else n) for r, kind, n in rows]
        assert run_traced[step] == want, step  # a prompt: only its last position here
    with pytest.raises(TypeError, match="lockstep must be True or False"):
        DisaggregatedEngine(MODEL, BLOCKS, lockstep=1)
