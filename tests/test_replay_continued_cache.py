"""replay() draws a prefill that continues a cache (generate(..., cache=c) on a filled or forked
cache) at the positions it really used, on top of the tokens the trace already holds: chapter 03
steps through such traces."""
import minikv
from minikv.viz.replay import replay
from minikv.viz.widgets import TraceStepper

from conftest import varied_model


def test_prefill_continuing_a_cache_keeps_the_prefix():
    model = varied_model()
    cache = minikv.KVCache.for_model(model, max_len=32)
    fill = minikv.generate(model, [1, 2, 3, 4], 1, cache=cache, trace=True)  # cache: positions 0-3
    branch = cache.fork()
    ask = minikv.generate(model, [5, 6, 7], 3, cache=branch, trace=True)  # prefill 4-6, decode 7, 8
    more = minikv.generate(model, [8, 9], 1, cache=cache, trace=True)  # the main cache again: 4-5
    snaps = replay(fill.trace + ask.trace + more.trace)

    asked = snaps[1]
    assert asked.event.cache_len_before == 4 and list(asked.event.positions) == [4, 5, 6]
    assert asked.tokens == [1, 2, 3, 4, 5, 6, 7, ask.tokens[0]]
    assert asked.status == ["prompt"] * 7 + ["generated"]
    assert asked.slots() == ["prompt"] * 7 and asked.cache_len == 7
    assert asked.computed == [4, 5, 6]
    assert snaps[3].tokens == [1, 2, 3, 4, 5, 6, 7] + ask.tokens and snaps[3].cache_len == 9

    back = snaps[4]  # the fork is gone: the main cache continues from its own 4 positions
    assert back.tokens == [1, 2, 3, 4, 8, 9, more.tokens[0]]
    assert back.slots() == ["prompt"] * 6 and back.cache_len == 6
    assert back.status[-1] == "generated"
    assert TraceStepper(fill.trace + ask.trace + more.trace).slider.max == 5  # steps 1..5


def test_plain_prefill_unchanged():
    model = varied_model()
    out = minikv.generate(model, [1, 2, 3], 3, trace=True)
    snap = replay(out.trace)[0]
    assert snap.tokens == [1, 2, 3, out.tokens[0]] and snap.slots() == ["prompt"] * 3
    alone = minikv.generate(model, [4, 5], 2,
                            cache=minikv.KVCache.for_model(model, max_len=8).fork(), trace=True)
    assert replay(alone.trace)[0].tokens[:2] == [4, 5]  # an empty cache: an ordinary prefill
