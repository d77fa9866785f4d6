"""Chunked prefill (FirstComeFirstServed(n, chunked_prefill=True), Sarathi-Serve): every step is
one packed pass of decode rows and prompt chunks within the token budget; every request still
gets what it gets alone, whatever the arrivals, budget, page size, pool and prefix sharing; a
prompt's blocks are shared only once their K/V is computed; deterministic requests stay
bit-identical."""
import random
from collections import defaultdict

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import minikv
from minikv.engine.scheduler import FirstComeFirstServed
from minikv.viz.replay import caption, replay

from conftest import varied_model

MODEL = varied_model().double()           # float64: a different packing flips no greedy token
MODEL32 = varied_model("small", seed=0)


def chunk_budget(budget: int) -> FirstComeFirstServed:
    return FirstComeFirstServed(budget, chunked_prefill=True)


def alone(request):
    return minikv.generate(MODEL, request.prompt, request.max_new_tokens,
                           eos_id=request.eos_id).tokens


def requests_from(seed, n, max_prompt=40, max_new=10, spread=6, shared=False):
    """n requests with random prompts, budgets and arrival steps; `shared`: half of them start
    with the same 24 tokens (a system prompt), so prefix caching has blocks to share."""
    rng = random.Random(seed)
    system = [rng.randrange(512) for _ in range(24)]
    out = []
    for k in range(n):
        prompt = [rng.randrange(512) for _ in range(rng.randint(1, max_prompt))]
        if shared and k % 2:
            prompt = system + prompt
        out.append(minikv.Request(prompt, rng.randint(1, max_new), arrival=rng.randrange(spread)))
    return out


def per_step(outs):
    """Per engine step: tokens computed, and whether any row was a prompt chunk."""
    tokens, chunked = defaultdict(int), defaultdict(bool)
    for o in outs:
        for e in o.trace:
            if e.kind in ("chunk", "prefill", "recompute", "decode"):
                tokens[e.step] += e.kv_computed
                chunked[e.step] |= e.kind != "decode"
    return tokens, chunked


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), n=st.integers(1, 6), budget=st.integers(1, 48),
       page_size=st.sampled_from([1, 4, 8]), tight=st.booleans(), shared=st.booleans())
def test_every_request_gets_what_it_would_get_alone(seed, n, budget, page_size, tight, shared):
    requests = requests_from(seed, n, shared=shared)
    biggest = max(-(-(len(r.prompt) + r.max_new_tokens + 4) // page_size) + 1 for r in requests)
    outs = minikv.serve(MODEL, requests, page_size=page_size, policy=chunk_budget(budget),
                        num_blocks=biggest if tight else None, max_running=budget, trace=True)
    assert [o.tokens for o in outs] == [alone(r) for r in requests]
    tokens, _ = per_step(outs)
    assert max(tokens.values()) <= budget  # no more decode rows than the budget: it binds
    for r, o in zip(requests, outs):  # each chunk within the budget, so this many at least
        if not o.stats.preempted:
            assert o.stats.prefill_chunks >= -(-(len(r.prompt) - o.stats.reused) // budget)
    assert outs.pool.n_free == outs.pool.num_blocks and all(c == 0 for c in outs.pool.ref)


def test_a_long_prompt_is_cut_into_chunks_beside_the_decodes():
    """Four short requests decoding, a 200-token prompt arriving at step 3: first come, first
    served computes it in one step of 200 + 4 tokens (the prompt, and a decode pass of the four
    others); chunked prefill in chunks that fill what the decodes leave of 32, every step
    within 32, the decodes going on in every step."""
    short = [minikv.Request([7 + k, 8, 9], 30) for k in range(4)]
    long = minikv.Request(list(range(1, 201)), 5, arrival=3)
    fcfs = minikv.serve(MODEL, short + [long], trace=True)
    chunked = minikv.serve(MODEL, short + [long], trace=True, policy=chunk_budget(32))
    assert [o.tokens for o in chunked] == [o.tokens for o in fcfs]
    assert max(per_step(fcfs)[0].values()) == 200 + 4
    tokens, with_chunk = per_step(chunked)
    assert max(tokens.values()) == 32
    assert chunked[4].stats.prefill_chunks == -(-200 // (32 - 4))  # 28 a step: 8 chunks
    chunks = [e for e in chunked[4].trace if e.kind in ("chunk", "prefill")]
    assert [e.kv_computed for e in chunks] == [28] * 7 + [4]
    assert [e.kind for e in chunks] == ["chunk"] * 7 + ["prefill"]
    assert all(e.token is None for e in chunks[:-1]) and chunks[-1].token == chunked[4].tokens[0]
    # the decodes never skip a step while the prompt is computed
    steps = [e.step for e in chunked[0].trace if e.kind == "decode"]
    assert steps == list(range(steps[0], steps[0] + len(steps)))
    assert sum(with_chunk[s] for s in steps) == 8


class AtMostEightAPrompt(FirstComeFirstServed):
    """A policy that caps every prompt's chunk at 8 tokens, however much budget is left."""

    def chunk(self, sched, s):
        return min(8, super().chunk(sched, s))


def test_a_prefix_is_shared_only_once_its_chunks_computed_it():
    """B arrives while A's 64-token prompt is still being computed 8 tokens a step; B starts
    with A's first 48 tokens. It may reuse only the blocks A's chunks have filled, and its
    output is still its own alone. (Publishing a block at admission, as a whole-prompt prefill
    may, would hand B blocks whose K/V no pass has computed yet.)"""
    a_prompt = list(range(1, 65))
    a = minikv.Request(a_prompt, 4)
    b = minikv.Request(a_prompt[:48] + [300, 301, 302], 4, arrival=2)
    outs = minikv.serve(MODEL, [a, b], page_size=8, policy=AtMostEightAPrompt(64, True), trace=True)
    assert [o.tokens for o in outs] == [alone(a), alone(b)]
    assert outs[1].stats.reused == 16  # A's chunks at steps 0 and 1 filled two blocks
    later = minikv.Request(a_prompt[:48] + [300, 301, 302], 4, arrival=20)  # after A is whole
    outs = minikv.serve(MODEL, [a, later], page_size=8, policy=AtMostEightAPrompt(64, True))
    assert outs[1].stats.reused == 48


def test_deterministic_requests_are_bit_identical_under_chunked_prefill():
    det = minikv.Request([5, 6, 7, 8], 24, deterministic=True, temperature=0.8, seed=1)
    want = minikv.serve(MODEL32, [det], page_size=4)[0].tokens
    for pattern in range(6):
        others = [minikv.Request(r.prompt, r.max_new_tokens, arrival=r.arrival, temperature=1.0,
                                 seed=pattern) for r in requests_from(pattern, 4, spread=4)]
        det.arrival = pattern % 3
        out = minikv.serve(MODEL32, [det] + others, page_size=4,
                           policy=chunk_budget(8 + 4 * pattern))
        assert out[0].tokens == want


def test_a_small_pool_preempts_a_request_midway_through_its_prompt():
    """Found by search (seeds 0-2000, pools of 8-20 blocks, budgets 4-12: the first case): a
    pool so small that a request is preempted between two chunks of its prompt; it is
    readmitted, recomputed in chunks, and every output is still right, no block lost."""
    requests = requests_from(4, 6, max_prompt=40, max_new=16, spread=2)
    outs = minikv.serve(MODEL, requests, page_size=4, num_blocks=20, trace=True,
                        policy=chunk_budget(4))
    assert [o.tokens for o in outs] == [alone(r) for r in requests]
    assert outs.pool.n_free == 20

    def cut_midway(trace):
        passes = [e.kind for e in trace if e.kind in ("chunk", "prefill", "recompute", "decode",
                                                      "preempt")]
        return any(a == "chunk" and b == "preempt" for a, b in zip(passes, passes[1:]))
    assert any(cut_midway(o.trace) for o in outs)


def test_the_trace_replays_and_captions_a_chunked_prompt():
    short = minikv.Request([7, 8, 9], 6)
    long = minikv.Request(list(range(1, 41)), 3, arrival=1)
    out = minikv.serve(MODEL, [short, long], trace=True, policy=chunk_budget(16))[1]
    snaps = replay(out.trace)
    assert [s.cache_len for s in snaps] == [15, 30, 40, 41, 42]
    assert snaps[0].tokens == long.prompt[:15] and snaps[0].newest is None
    assert snaps[2].tokens == long.prompt + [out.tokens[0]]
    assert caption(snaps[0]).startswith("prefill chunk: positions 0–14 (15 tokens, beside 1")
    assert caption(snaps[2]).startswith("prefill: 40 prompt tokens at positions 30–39")


def test_a_budget_that_never_binds_changes_no_token_and_no_prompt_is_cut():
    requests = requests_from(5, 6)
    whole = minikv.serve(MODEL, requests, policy=FirstComeFirstServed(10_000))
    chunked = minikv.serve(MODEL, requests, policy=chunk_budget(10_000))
    assert [o.tokens for o in chunked] == [o.tokens for o in whole]
    assert all(o.stats.prefill_chunks == 1 for o in chunked)


@pytest.mark.parametrize("budget", [0, -3, 2.5, True])
def test_a_chunk_budget_is_a_positive_int(budget):
    with pytest.raises((ValueError, TypeError), match="max_tokens must be a positive int"):
        chunk_budget(budget)


def test_the_step_composition_picture_shows_each_steps_chunks_and_decodes():
    from minikv.viz.pool import draw_step_composition, step_composition
    short = [minikv.Request([7 + k, 8, 9], 12) for k in range(3)]
    long = minikv.Request(list(range(1, 81)), 3, arrival=2)
    outs = minikv.serve(MODEL, short + [long], trace=True, policy=chunk_budget(24))
    steps = step_composition(outs)
    assert {s: sum(n for *_, n in rows) for s, rows in steps.items()} == dict(per_step(outs)[0])
    chunks = [n for rows in steps.values() for r, kind, n in rows if r == 3 and kind == "prompt"]
    assert chunks == [21, 21, 21, 17]  # what 3 decode rows leave of 24, then the rest
    assert all(kind == "generated" and n == 1 for s in range(2, 6) for r, kind, n in steps[s]
               if r < 3)
    fig = draw_step_composition(outs, budget=24)
    gids = {p.get_gid() for p in fig.axes[0].patches}
    assert "step:2:r3:prompt" in gids and "step:2:r0:generated" in gids
    with pytest.raises(ValueError, match="serve with trace=True"):
        step_composition(minikv.serve(MODEL, short))
