"""Ctrl-C at any line of the engine, and threads (issue 31, item 3).

A tracer raises KeyboardInterrupt at the N-th line the engine executes during a call (N drawn
over every line the call runs; none lands on a with statement's own exit, which CPython
cannot guard: see `leaves_a_with`). Afterwards the interrupt has come through as itself, the
caller's cache is as it was (length, every layer's length, live K/V) and free for other
threads, the model is as it was (parameters, no hook left behind), and a retry gives exactly
what an uninterrupted call gives (tokens, stats, trace, the cache after it). `serve`'s block
pool is its own and unreachable once the call is interrupted: there the checks are that the
pool is freed with the call (nothing keeps it alive), and that the retry's pool gets every
block back (every refcount 0, every block free).

Threads: two threads on one model, each with its own cache, get what one thread gets; a cache
that a second thread tries while the first is using it is refused with a clear error, and
left alone."""
import dis
import gc
import sys
import threading
import weakref
from functools import cache
from pathlib import Path
from unittest.mock import patch

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import minikv
from minikv.engine import serving

from conftest import varied_model

ENGINE = str(Path(minikv.engine.__file__).parent) + "/"
MODEL = varied_model()                      # tiny: vocab 512, 2 layers
DRAFT = varied_model()                      # the target, a little off: it proposes right
with torch.no_grad():                       # often, and wrong often enough to roll back
    noise = torch.Generator().manual_seed(7)
    for p in DRAFT.parameters():
        p.add_(0.05 * torch.randn(p.shape, generator=noise))


@cache
def instructions(code) -> tuple[list, dict]:
    found = list(dis.get_instructions(code))
    return found, {x.offset: i for i, x in enumerate(found)}


def leaves_a_with(frame) -> bool:
    """Whether the frame is about to call a with statement's __exit__ (3.11's
    `LOAD_CONST None` x 3, `PRECALL 2`, under the with's line, after a SWAP on `return`).
    An exception raised there skips __exit__: CPython's own gap (bpo-29988, "with
    statements are not ensuring that __exit__ is called"), which no engine code can close,
    so no interrupt lands there."""
    found, at = instructions(frame.f_code)
    i = at.get(frame.f_lasti, len(found))
    while i < len(found) and found[i].opname in ("SWAP", "NOP"):  # `return` inside the with
        i += 1
    return [(x.opname, x.argval) for x in found[i:i + 4]] == [("LOAD_CONST", None)] * 3 + [
        ("PRECALL", 2)]


class Interrupter:
    """Counts the 'line' events of frames whose code is under minikv/engine (the thread's
    own: sys.settrace is per thread) and raises KeyboardInterrupt at the `at`-th, as a
    Ctrl-C landing between two lines would (`where`: the function it landed in). `at=None`
    only counts. A trace function that raises is unset by Python, so there is one
    interrupt per call."""

    def __init__(self, at: int | None = None):
        self.at = at
        self.lines = 0
        self.where = None

    def _frame(self, frame, event, arg):
        return self._line if frame.f_code.co_filename.startswith(ENGINE) else None

    def _line(self, frame, event, arg):
        if event == "line" and not leaves_a_with(frame):
            self.lines += 1
            if self.lines == self.at:
                self.where = frame.f_code.co_name
                raise KeyboardInterrupt(f"at engine line event {self.at}")
        return self._line

    def run(self, call):
        previous = sys.gettrace()
        sys.settrace(self._frame)
        try:
            return call()
        finally:
            sys.settrace(previous)


# --- what the caller can observe ---------------------------------------------------------------

def model_state(model) -> tuple:
    """Parameters and buffers, and every hook on every module (a hook left behind would count
    or change later passes)."""
    hooks = [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()]
    return {k: v.clone() for k, v in model.state_dict().items()}, hooks


def assert_same_model(before, model) -> None:
    params, hooks = before
    now_params, now_hooks = model_state(model)
    assert now_hooks == hooks, "a hook was left on the model"
    assert all(torch.equal(params[k], now_params[k]) for k in params), "the model changed"


def cache_state(c) -> tuple:
    """What a pass reads from a cache: its length, each layer's length, the live K/V."""
    if isinstance(c, minikv.SinkWindowCache):
        held = [t.shape[2] for t in c.keys + c.values]
        return (c.get_seq_length(), tuple(c.positions), held,
                [t.clone() for t in c.keys + c.values])
    n = c.get_seq_length()
    return n, c.layer_lengths, [t[:, :, :n].clone() for t in c._buffers()]


def assert_same_cache(a, b) -> None:
    assert a[:-1] == b[:-1], f"cache lengths {a[:-1]} != {b[:-1]}"
    assert all(torch.equal(x, y) for x, y in zip(a[-1], b[-1])), "the live K/V changed"


def prefilled(kind: str):
    """A caller's cache holding 4 positions of an earlier turn."""
    if kind == "window":  # sinks 2 + window 3: it evicts from the first decode on
        c = minikv.SinkWindowCache.for_model(MODEL, sinks=2, window=3)
    else:
        cls = minikv.QuantizedKVCache if kind == "int8" else minikv.KVCache
        c = cls.for_model(MODEL, max_len=40)
    with torch.no_grad():
        MODEL(torch.tensor([[1, 2, 3, 4]]), cache=c)
    return c


# --- the calls ---------------------------------------------------------------------------------

class Case:
    """A public call. `call(state)` runs it on `state` (a caller's cache, or None);
    `outcome(result, state)` is everything a caller sees of it."""

    def __init__(self, name, call, cache_kind=None, check_pool=False):
        self.name, self.call, self.cache_kind, self.check_pool = name, call, cache_kind, check_pool

    def state(self):
        return prefilled(self.cache_kind) if self.cache_kind else None

    def outcome(self, result, state):
        if isinstance(result, list):  # generate_batch, serve
            kept = [(o.tokens, o.stats) for o in result]
        else:
            kept = (result.tokens, result.stats, result.trace)
        return kept, None if state is None else cache_state(state)


def gen(**kw):
    return lambda c: minikv.generate(MODEL, [5, 6], 6, cache=c, trace=True, **kw)


SERVED = [  # two share a 4-token prefix (prefix caching); a 12-block pool preempts
    minikv.Request([9, 8, 7, 6, 5, 4], 8),
    minikv.Request([9, 8, 7, 6, 1], 7, temperature=0.8, seed=2),
    minikv.Request([3, 1, 4], 6, deterministic=True, temperature=0.8, seed=5, arrival=1),
    minikv.Request([9, 8, 7, 6, 2, 2], 5, arrival=2),
]


def serve_call(_):
    return minikv.serve(MODEL, SERVED, replay_window=2, page_size=2, num_blocks=12)


CASES = [
    Case("generate greedy", gen(), "kv"),
    Case("generate sampled", gen(temperature=0.9, top_k=40, seed=3), "kv"),
    Case("generate int8 cache", gen(temperature=0.9, seed=4), "int8"),
    Case("generate window cache", gen(), "window"),
    Case("speculative greedy", lambda c: minikv.speculative_generate(
        MODEL, DRAFT, [5, 6, 7], 8, gamma=3, trace=True)),
    Case("speculative sampled", lambda c: minikv.speculative_generate(
        MODEL, DRAFT, [5, 6, 7], 8, gamma=2, temperature=0.8, seed=1, adaptive_gamma=True,
        max_gamma=3, trace=True)),
    Case("lookup", lambda c: minikv.lookup_generate(
        MODEL, [4, 5, 6, 4, 5, 6, 4, 5], 8, gamma=3, trace=True)),
    Case("generate_batch", lambda c: minikv.generate_batch(
        MODEL, [[1, 2, 3], [7, 8], [9]], 5, temperature=0.7, seed=2, eos_id=3)),
    Case("serve", serve_call, check_pool=True),
]


@cache
def reference(case: Case):
    """(lines the engine runs in the call, what an uninterrupted call gives)."""
    case.call(case.state())  # once before counting: a first call may run one-off lines
    state = case.state()
    counter = Interrupter()
    result = counter.run(lambda: case.call(state))
    return counter.lines, case.outcome(result, state)


def assert_same_outcome(got, want) -> None:
    (kept, state), (want_kept, want_state) = got, want
    assert kept == want_kept, "the retry's tokens, stats or trace differ from an uninterrupted call"
    if want_state is not None:
        assert_same_cache(state, want_state)


def free_for_another_thread(c) -> bool:
    """Whether another thread may take the cache now: no hold was left behind."""
    took = []

    def take():
        try:
            with c.in_use():
                took.append(True)
        except RuntimeError:
            took.append(False)
    worker = threading.Thread(target=take)
    worker.start()
    worker.join()
    return took == [True]


class RecordedPool(serving.BlockPool):
    """serve's BlockPool, remembered (weakly) so a test can see whether it outlived the call."""
    made: list = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        RecordedPool.made.append(weakref.ref(self))


def interrupt_and_retry(case: Case, at: int):
    """Run `case` with Ctrl-C at engine line `at`; check what the caller sees; retry it."""
    state = case.state()
    before = (model_state(MODEL), model_state(DRAFT), state and cache_state(state))
    RecordedPool.made.clear()
    interrupter = Interrupter(at)
    with pytest.raises(KeyboardInterrupt) as caught, \
            patch.object(serving, "BlockPool", RecordedPool):
        interrupter.run(lambda: case.call(state))
    assert caught.value.args == (f"at engine line event {at}",), "not our interrupt"
    del caught  # its traceback holds the call's frames (and serve's pool)
    assert_same_model(before[0], MODEL)
    assert_same_model(before[1], DRAFT)
    if state is not None:
        assert_same_cache(cache_state(state), before[2])
        # Cache.in_use's own try/release lines are where a Ctrl-C leaves this thread holding
        # the cache (other threads refused: never corrupted). Anywhere else, nothing is held.
        if interrupter.where != "in_use":
            assert free_for_another_thread(state), "the interrupted call kept the cache held"
    if case.check_pool and RecordedPool.made:
        gc.collect()
        assert RecordedPool.made[0]() is None, "the interrupted call's block pool is still held"
    retry = case.call(state)
    assert_same_outcome(case.outcome(retry, state), reference(case)[1])
    if case.check_pool:  # a whole call gives every block back
        assert retry.pool.ref == [0] * retry.pool.num_blocks
        assert sorted(retry.pool.free) == list(range(retry.pool.num_blocks))
    return retry


# --- Ctrl-C at any line --------------------------------------------------------------------------

def test_the_calls_exercise_what_an_interrupt_could_break():
    """The uninterrupted calls take the paths worth interrupting: rollbacks, evictions,
    preemption, prefix caching, a sampled round."""
    by_name = {c.name: reference(c)[1][0] for c in CASES}
    assert all(s.rejected and s.accepted for _, s, _ in (by_name["speculative greedy"],
                                                        by_name["speculative sampled"]))
    assert by_name["lookup"][1].accepted
    served = [stats for _, stats in by_name["serve"]]
    assert sum(s.preempted for s in served) and sum(s.reused for s in served)
    assert sum(s.rounds for s in served)  # the deterministic request was verified
    assert len(reference(CASES[3])[1][1][1]) == 2 + 3  # the window cache evicted


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
@settings(derandomize=True, deadline=None, max_examples=60, database=None)
@given(data=st.data())
def test_ctrl_c_at_any_engine_line_leaves_caches_and_models_as_they_were(case, data):
    lines = reference(case)[0]
    at = data.draw(st.one_of(st.integers(1, lines), st.integers(1, min(lines, 150)),
                             st.integers(max(1, lines - 60), lines)),
                   label="interrupt at engine line")  # anywhere, setting up, or finishing
    interrupt_and_retry(case, at)


def test_ctrl_c_at_every_line_where_generate_sets_up_or_finishes():
    """Every line of the first 150 and the last 60 that generate runs: where the hooks go on
    and off, the cache is taken and given back, and the tokens are handed over (each once
    let the interrupt through with a hook left on the model, or the cache moved on)."""
    lines = reference(CASES[0])[0]
    for at in sorted({*range(1, 151), *range(lines - 59, lines + 1)}):
        interrupt_and_retry(CASES[0], at)


# --- threads -----------------------------------------------------------------------------------

def run_in_threads(work: dict) -> dict:
    """Run every `work[name]()` in its own thread, all released at once; their results."""
    results, barrier = {}, threading.Barrier(len(work))

    def run(name):
        barrier.wait()
        results[name] = work[name]()
    threads = [threading.Thread(target=run, args=(name,)) for name in work]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_two_threads_with_their_own_caches_get_what_one_thread_gets():
    """One model, two threads, each continuing its own cache (and then a speculative call,
    whose caches are its own): the tokens, stats and caches one thread alone gets."""
    def work(kind, seed):
        def call():
            c = prefilled(kind)
            outs = [minikv.generate(MODEL, [5 + seed, 6], 8, temperature=0.9, seed=seed,
                                    cache=c) for _ in range(2)]  # a second turn on the cache
            spec = minikv.speculative_generate(MODEL, DRAFT, [seed, 7], 10, gamma=3,
                                               temperature=0.8, seed=seed)
            return [(o.tokens, o.stats) for o in outs + [spec]], cache_state(c)
        return call
    jobs = {"a": work("kv", 1), "b": work("window", 2), "c": work("int8", 3)}
    alone = {name: job() for name, job in jobs.items()}
    together = run_in_threads(jobs)
    for name in jobs:
        assert together[name][0] == alone[name][0]
        assert_same_cache(together[name][1], alone[name][1])


@pytest.mark.parametrize("kind", ["kv", "int8", "window"])
def test_a_cache_in_use_by_another_thread_is_refused_and_left_alone(kind):
    """Thread A is held inside a forward pass of its generate (a hook waits on an Event);
    the main thread's generate and forward pass on A's cache are refused with a clear error
    and change nothing; A then finishes with exactly its tokens; afterwards another thread
    may use the cache (turns are allowed), and a thread may re-enter its own hold."""
    want_cache = prefilled(kind)
    want = minikv.generate(MODEL, [5, 6], 6, cache=want_cache)
    shared = prefilled(kind)
    inside, go_on, got = threading.Event(), threading.Event(), {}

    def hold(module, inputs, output):
        if threading.current_thread().name == "A" and not inside.is_set():
            inside.set()  # A's prefill is half written: layer 0 done, layer 1 to come
            assert go_on.wait(30)
    handle = MODEL.transformer.h[0].register_forward_hook(hold)
    try:
        a = threading.Thread(target=lambda: got.setdefault(
            "a", minikv.generate(MODEL, [5, 6], 6, cache=shared)), name="A")
        a.start()
        assert inside.wait(30)
        before = cache_state(shared)
        message = "in use by another thread: give each thread its own cache"
        with pytest.raises(RuntimeError, match=message):
            minikv.generate(MODEL, [1, 2], 3, cache=shared)
        with pytest.raises(RuntimeError, match=message), torch.no_grad():
            MODEL(torch.tensor([[1, 2]]), cache=shared)
        assert_same_cache(cache_state(shared), before)
    finally:
        go_on.set()
        a.join()
        handle.remove()
    assert got["a"].tokens == want.tokens
    assert_same_cache(cache_state(shared), cache_state(want_cache))
    # taking turns: a thread may use it now that A is done, and a hold re-enters
    more = run_in_threads({"b": lambda: minikv.generate(MODEL, [9], 2, cache=shared)})
    assert more["b"].tokens == minikv.generate(MODEL, [9], 2, cache=want_cache).tokens
    with shared.in_use(), shared.in_use():
        assert free_for_another_thread(shared) is False
    assert free_for_another_thread(shared)


def test_a_fork_or_a_copy_is_not_held_with_its_original():
    """The hold belongs to one cache: a fork taken while it is held is free for others."""
    c = prefilled("kv")
    with c.in_use():
        twin = c.fork()
        assert free_for_another_thread(twin) and not free_for_another_thread(c)
