"""Steppers driven like a student would, without a browser: set the slider, click, read caption
and image."""
import base64

import pytest
import torch

import minikv
from minikv.viz.draw import attention_weights, draw_attention, draw_step, png
from minikv.viz.replay import replay
from minikv.viz.widgets import CompareStepper, TraceStepper

from conftest import varied_model
from test_serving import MODEL16, det_request, find_seed, run
from test_speculative import FAR, TARGET


def spec_trace():
    return minikv.speculative_generate(TARGET, FAR, [1, 2, 3], 14, gamma=3, trace=True).trace


def check_against_trace(stepper, trace):
    """Walk every step with Next and check what is shown against the trace itself."""
    stepper.go(0)
    seen_images = set()
    for i, event in enumerate(trace):
        snap = stepper.snapshot
        assert snap.event is event and stepper.index == i and stepper.slider.value == i + 1
        assert f"step {i + 1}/{len(trace)}" in stepper.caption.value  # slider and caption agree
        assert event.kind in stepper.caption.value
        expected_len = event.cache_len_after if event.kind != "draft" else snap.cache_len
        assert snap.cache_len == expected_len
        assert stepper.cache_info.value.startswith(f"KV cache: {snap.cache_len} positions")
        if snap.has_draft:
            assert f"draft cache: {snap.draft_cache_len} positions" in stepper.cache_info.value
        if event.kind == "rollback":
            assert (f"cache {event.cache_len_before} → {event.cache_len_after}"
                    in stepper.caption.value)
            stale = snap.slots()[event.cache_len_after:event.cache_len_before]
            assert stale and set(stale) == {"stale"}
        if event.kind == "verify":
            for p in event.accepted:
                assert snap.status[p] == "accepted"
            for p in event.rejected:
                assert snap.status[p] == "rejected"
            assert (" rejected" in stepper.caption.value) == bool(event.rejected)
        if event.kind == "commit":
            assert len(snap.tokens) == event.sequence_len
            assert all(s != "proposed" for s in snap.slots()[: snap.cache_len])
        seen_images.add(stepper.image.value)
        assert stepper.next_button.disabled == (i == len(trace) - 1)
        stepper.next_button.click()
    assert len(seen_images) == len(trace)  # every step draws something different


def test_stepper_walks_a_speculative_trace():
    trace = spec_trace()
    assert {"draft", "verify", "rollback", "commit"} <= {e.kind for e in trace}
    check_against_trace(TraceStepper(trace), trace)


def test_stepper_walks_a_deterministic_trace():
    seed, _ = find_seed(lambda v, r, c: r is not None)
    out = run(MODEL16, det_request(seed=seed, n=30), 3, 3, trace=True)
    trace = out.trace
    assert {"prefill", "decode", "verify", "rollback", "commit"} <= {e.kind for e in trace}
    stepper = TraceStepper(trace)
    check_against_trace(stepper, trace)
    decode_step = next(i for i, e in enumerate(trace) if e.kind == "decode")
    stepper.go(decode_step)
    assert "unverified" in stepper.caption.value and "KV splits" in stepper.caption.value
    # the fast path's own proposals are yellow in the cache too, as in seed 001
    fed = [stepper.snapshots[i].slots()[e.positions[0]] for i, e in enumerate(trace)
           if e.kind == "decode"]
    assert fed[0] == "generated" and "proposed" in fed  # T0 came from the prefill; T1' on


def test_prev_and_bounds():
    stepper = TraceStepper(spec_trace())
    assert stepper.prev_button.disabled
    stepper.go(3)
    before = stepper.image.value
    stepper.prev_button.click()
    assert stepper.index == 2 and stepper.image.value != before
    stepper.go(10_000)
    assert stepper.slider.value == stepper.slider.max == len(stepper.snapshots)
    stepper.go(-5)
    assert stepper.slider.value == stepper.slider.min == 1


def test_compare_view_counts_the_seed_003_work():
    model = varied_model()
    naive = minikv.generate(model, [10, 11, 12], 5, mode="naive", trace=True).trace
    cached = minikv.generate(model, [10, 11, 12], 5, mode="cached", trace=True).trace
    view = CompareStepper(naive, cached)
    view.slider.value = 5  # the last step, counted from 1
    assert view.cached.index == 4
    assert "naive <b>25</b>, cached <b>7</b>" in view.work.value
    assert "recompute K/V for all 7 positions" in view.naive.caption.value


def test_saved_notebook_gets_a_static_picture():
    bundle = TraceStepper(spec_trace())._repr_mimebundle_()
    assert bundle["image/png"] and bundle["text/plain"].startswith("TraceStepper:")
    assert "application/vnd.jupyter.widget-view+json" in bundle


def test_compare_view_has_a_static_picture_of_both_decoders():
    """GitHub and nbviewer show a saved notebook's image/png, not its widgets."""
    model = varied_model()
    view = CompareStepper(minikv.generate(model, [10, 11, 12], 5, mode="naive", trace=True).trace,
                          minikv.generate(model, [10, 11, 12], 5, trace=True).trace)
    first = view._repr_mimebundle_()["image/png"]
    view.slider.value = 3
    bundle = view._repr_mimebundle_()
    assert bundle["image/png"] and bundle["image/png"] != first
    assert len(base64.b64decode(bundle["image/png"])) > 8_000  # really drawn, not a blank canvas


def test_pictures_follow_the_engine():
    """Change the prompt and the drawing changes: nothing is a canned image."""
    a = minikv.generate(TARGET, [1, 2, 3], 4, trace=True).trace
    b = minikv.generate(TARGET, [1, 2, 9], 4, trace=True).trace
    assert png(draw_step(replay(a)[2])) != png(draw_step(replay(b)[2]))


def test_attention_weights_full_triangle_vs_one_row():
    model = varied_model()
    ids = [3, 4, 5, 6, 7]
    full = attention_weights(model, ids)                    # (nh, 5, 5)
    assert full.shape[1:] == (5, 5) and torch.equal(full.triu(1), torch.zeros_like(full))
    cache = minikv.KVCache.for_model(model, max_len=8)
    with torch.no_grad():
        model(torch.tensor([ids[:-1]]), cache=cache)
    # (nh, 1, 5): the cached step's single row
    row = attention_weights(model, ids[-1:], cache=cache)
    assert row.shape[1:] == (1, 5)
    torch.testing.assert_close(row[:, 0], full[:, -1], atol=1e-6, rtol=0)
    assert png(draw_attention(row.mean(0))) != png(draw_attention(full.mean(0)))


def test_empty_trace_is_refused():
    with pytest.raises(ValueError, match="trace=True"):
        TraceStepper([])


def test_notes_go_before_each_caption_and_must_match_the_trace():
    """A note per event says where it ran (a fork, the main cache): caption and picture title."""
    trace = spec_trace()
    notes = [f"note {i}: " for i in range(len(trace))]
    stepper = TraceStepper(trace, notes=notes)
    stepper.go(3)
    assert f"</code> note 3: {stepper.snapshot.event.kind}" in stepper.caption.value
    assert stepper.describe(3).startswith("note 3: ")
    with pytest.raises(ValueError, match="one per event"):
        TraceStepper(trace, notes=notes[:-1])


# --- chapter 06: the block pool stepper -----------------------------------------------------------

def pool_steps():
    """A served run with every kind of pool step: prefix sharing, allocations, a preemption, and
    requests that finish while another still holds their shared blocks."""
    statement = list(range(10, 23))
    requests = [minikv.Request(statement + [30, 31, 32, 33, 34], 6),
                minikv.Request(statement + [40, 41, 42, 43, 44, 45, 46], 6, arrival=1),
                minikv.Request([50, 51, 52, 53], 24, arrival=2),
                minikv.Request([60, 61, 62, 63], 12, arrival=2),
                minikv.Request([70, 71, 72], 20, arrival=3)]
    return minikv.serve(varied_model(), requests, page_size=4, num_blocks=10,
                        trace=True).pool_steps


def test_pool_stepper_walks_the_pool_steps():
    """Every step, reached with Next or go(): the slider, the caption (pool_caption of that step),
    the numbers line and the picture follow the engine's records."""
    from minikv.viz.pool import PoolStepper, pool_caption, pool_info
    steps = pool_steps()
    kinds = {what for step in steps for _, what, _, _ in step.log}
    assert {"allocate", "share", "preempt", "free", "unshare"} <= kinds
    stepper = PoolStepper(steps, title="pool")
    assert stepper.index == 0 and stepper.prev_button.disabled
    images = set()
    for i, step in enumerate(steps):
        assert stepper.index == i and stepper.slider.value == i + 1
        assert stepper.caption.value == f"<code>step {i + 1}/{len(steps)}</code> " \
                                        f"{pool_caption(step)}"
        assert stepper.cache_info.value == pool_info(step)
        assert stepper.cache_info.value.startswith(
            f"KV cache: {sum(step.lengths.values())} positions in {len(step.tables)} block")
        assert f"{sum(r == 0 for r in step.ref)} free" in stepper.cache_info.value
        assert stepper.next_button.disabled == (i == len(steps) - 1)
        images.add(stepper.image.value)
        stepper.next_button.click()
    assert len(images) == len(steps)  # every step draws something different
    share = next(i for i, s in enumerate(steps) if any(w == "share" for _, w, _, _ in s.log))
    stepper.go(share)
    assert ("shared by running request(s) [1]" in stepper.caption.value
            or "reused by request(s) [1] from the prefix cache" in stepper.caption.value)
    preempt = next(i for i, s in enumerate(steps) if any(w == "preempt" for _, w, _, _ in s.log))
    stepper.go(preempt + 1)
    stepper.prev_button.click()
    assert stepper.index == preempt and "preempted (to be recomputed)" in stepper.caption.value
    stepper.go(10_000)
    assert stepper.slider.value == stepper.slider.max == len(steps)
    stepper.go(-5)
    assert stepper.slider.value == stepper.slider.min == 1


def test_pool_caption_tells_sharing_from_reuse():
    """A prefix-cache hit on a block a running request holds is sharing (two tables, one copy);
    on a block a finished request left behind it is reuse: the caption says which."""
    from minikv.engine.records import PoolStep
    from minikv.viz.pool import pool_caption
    live = PoolStep(step=3, tables={0: (0, 1), 1: (0, 2)}, lengths={0: 8, 1: 5}, ref=(2, 1, 1, 0),
                    log=((3, "share", 0, 1), (3, "allocate", 2, 1)))
    revived = PoolStep(step=7, tables={1: (0, 2)}, lengths={1: 5}, ref=(1, 0, 1, 0),
                       log=((7, "share", 0, 1), (7, "allocate", 2, 1)))
    assert "1 block(s) shared by running request(s) [1]" in pool_caption(live)
    assert "reused" not in pool_caption(live)
    assert "1 block(s) reused by request(s) [1] from the prefix cache" in pool_caption(revived)
    assert "shared by running" not in pool_caption(revived)


def test_pool_stepper_has_the_browser_hooks_and_a_static_picture():
    """The same CSS hooks as TraceStepper's (the browser test finds the stepper by them), and a
    PNG of the shown step for viewers without a kernel."""
    from minikv.viz.pool import PoolStepper
    stepper = PoolStepper(pool_steps())
    for widget, name in ((stepper.prev_button, "prev"), (stepper.next_button, "next"),
                         (stepper.caption, "caption"), (stepper.cache_info, "cache"),
                         (stepper.image, "image")):
        assert f"minikv-{name}" in widget._dom_classes
    first = stepper._repr_mimebundle_()
    stepper.go(5)
    bundle = stepper._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert bundle["text/plain"] == f"PoolStepper: {len(stepper.steps)} steps"
    png_bytes = base64.b64decode(bundle["image/png"])
    assert png_bytes == stepper.image.value and len(png_bytes) > 8_000
    assert bundle["image/png"] != first["image/png"]


def test_empty_pool_steps_are_refused():
    from minikv.viz.pool import PoolStepper
    with pytest.raises(ValueError, match="trace=True"):
        PoolStepper([])


def legend_labels(fig) -> list[str]:
    return [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().texts]


def test_legends_list_only_the_states_a_trace_shows():
    """Plain decoding never proposes, accepts, rejects or rolls back: its legend says so; a
    speculative trace's stepper lists every state its steps take, on every step."""
    from minikv.viz.draw import states_shown
    plain = minikv.generate(varied_model(), [1, 2, 3], 5, trace=True).trace
    labels = legend_labels(draw_step(replay(plain)[-1]))
    assert "prompt" in labels and "generated by the model" in labels
    never = {"accepted", "rejected", "proposed, not verified", "stale after rollback"}
    assert not never & set(labels)
    trace = spec_trace()
    stepper = TraceStepper(trace)
    shown = states_shown(stepper.snapshots)
    assert {"accepted", "rejected", "stale"} <= shown
    assert "rejected" in legend_labels(stepper.draw(0))  # step 0 has no rejection yet


def test_the_walk_stepper_shows_each_tile_of_the_walk():
    """Chapter 09's stepper: a step per tile, its caption naming the block and, where the max
    rose, the rescale factor exp(old m - new m) the walk applied; every picture drawn."""
    import math

    from minikv.engine.flash import walk
    from minikv.viz.tiles import WalkStepper
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(6, 2, 4, 8, generator=g), torch.randn(6, 2, 4, 8, generator=g)
    keys[3, :, 1] *= 4  # a key in the second tile of the table stands out: the max rises there
    q, steps = torch.randn(4, 8, generator=g), []
    walk(q, keys, values, [5, 3, 0], 0, 11, steps=steps)
    stepper = WalkStepper(steps, [5, 3, 0], 4, 11, head=1)
    assert stepper.n_steps == 3
    stepper.go(1)
    assert "block 3, slots 0-3 (positions 4-7)" in stepper.caption.value
    rose = steps[1].max[1] > steps[0].max[1]
    assert ("rescaled by exp(old m − new m) = "
            f"{math.exp(steps[0].max[1] - steps[1].max[1]):.3f}" in stepper.caption.value) == rose
    assert stepper.cache_info.value.startswith("KV cache: 11 positions · read so far: 8")
    assert all(len(stepper.picture(i)) > 8000 for i in range(3))
    with pytest.raises(ValueError, match="no steps"):
        WalkStepper([], [0], 4, 1)


def test_the_tile_schedule_draws_what_the_kernel_counts():
    from minikv.engine.flash import IO, tiled_attention
    from minikv.viz.tiles import draw_tile_schedule
    fig = draw_tile_schedule(40, 56, 8, 16)
    drawn = [p.get_gid().split(":")[2] for p in fig.axes[0].patches if p.get_gid()]
    io = IO()
    tiled_attention(*(torch.zeros(1, 1, n, 4) for n in (40, 56, 56)), True, 8, 16, io)
    assert {k: drawn.count(k) for k in io.tiles} == io.tiles
