"""serving.Engine, serve()'s loop a step at a time (what the HTTP server and the load benchmark
drive): requests added while it runs get what serve() gives them, step() hands out each token
once, abort() frees a request's blocks at once, and a bad request is refused before anything
changes."""
import pytest

import minikv
from minikv.engine.scheduler import FirstComeFirstServed
from minikv.engine.serving import Engine

from conftest import varied_model

MODEL = varied_model().double()


def drain(engine, out=None):
    out = {} if out is None else out
    while engine.has_work():
        for i, (tokens, _) in engine.step().items():
            out.setdefault(i, []).extend(tokens)
    return out


@pytest.mark.parametrize("policy", [None, FirstComeFirstServed(8, chunked_prefill=True)],
                         ids=["fcfs", "chunked"])
def test_requests_added_while_it_runs_get_what_serve_gives(policy):
    requests = [minikv.Request([3 + k, 1, 4, 1, 5][: 2 + k], 6 + k) for k in range(4)]
    want = [o.tokens for o in minikv.serve(MODEL, requests, policy=policy)]
    engine = Engine(MODEL, 64, policy=policy)
    got = {}
    for r in requests:  # one more request every step
        engine.add(r)
        for i, (tokens, _) in engine.step().items():
            got.setdefault(i, []).extend(tokens)
    drain(engine, got)
    assert [got[i] for i in range(4)] == want
    assert engine.stats()["free_blocks"] == 64 and engine.step() == {}


def test_every_token_is_handed_out_once_and_finished_once():
    engine = Engine(MODEL, 32)
    engine.add(minikv.Request([1, 2, 3], 5))
    seen, done_flags = [], []
    while engine.has_work():
        for tokens, done in engine.step().values():
            seen += tokens
            done_flags.append(done)
    assert seen == minikv.generate(MODEL, [1, 2, 3], 5).tokens
    assert done_flags.count(True) == 1 and done_flags[-1]


def test_abort_frees_the_blocks_and_the_others_go_on():
    engine = Engine(MODEL, 32, page_size=4)
    keep = engine.add(minikv.Request([1, 2, 3], 12))
    gone = engine.add(minikv.Request(list(range(5, 25)), 12))
    waiting = engine.add(minikv.Request([7, 7], 4, arrival=50))
    engine.step()
    held = engine.stats()["free_blocks"]
    with pytest.raises(ValueError, match="still running: abort it first"):
        engine.forget(gone)
    engine.abort(gone)
    engine.forget(gone)  # a server's memory: the record goes too
    assert gone not in engine.outputs()
    assert engine.stats()["free_blocks"] > held  # its blocks came back at once
    engine.abort(waiting)  # still queued: it simply leaves
    out = drain(engine)
    assert out[keep][-1] == minikv.generate(MODEL, [1, 2, 3], 12).tokens[-1]
    assert gone not in out and waiting not in out and engine.stats()["free_blocks"] == 32
    with pytest.raises(ValueError, match="no request 9 in this engine"):
        engine.abort(9)


@pytest.mark.parametrize("request_, error, message", [
    (minikv.Request([1] * 40, 4), ValueError, "needs more than the pool"),
    (minikv.Request([10_000], 4), ValueError, "outside the vocabulary|token id must be"),
    (minikv.Request([1, 2], 0), ValueError, "max_new_tokens"),
    ([1, 2, 3], TypeError, "must be a minikv.Request"),
])
def test_a_bad_request_is_refused_and_changes_nothing(request_, error, message):
    engine = Engine(MODEL, 4, page_size=4)
    with pytest.raises(error, match=message):
        engine.add(request_)
    assert not engine.has_work() and engine.outputs() == {}
    assert engine.stats()["free_blocks"] == 4


def test_an_index_in_use_is_refused_and_a_new_one_never_reuses_one():
    engine = Engine(MODEL, 16, page_size=4)
    assert engine.add(minikv.Request([1, 2], 3), index=1) == 1
    with pytest.raises(ValueError, match="request 1 is already in this engine"):
        engine.add(minikv.Request([3, 4], 3), index=1)
    assert [engine.add(minikv.Request([5], 2)) for _ in range(2)] == [0, 2]
    assert sorted(engine.outputs()) == [0, 1, 2]
    for bad in (-1, "3", 2.0, True):  # an identity is a non-negative int, nothing else
        with pytest.raises((TypeError, ValueError), match="index must be"):
            engine.add(minikv.Request([5], 2), index=bad)
    assert sorted(engine.outputs()) == [0, 1, 2]


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="num_blocks must be a positive int"):
        Engine(MODEL, 0)
    with pytest.raises(TypeError, match="policy must be a scheduling policy"):
        Engine(MODEL, 8, policy="chunked")
