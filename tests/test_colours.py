"""One colour per state, everywhere: a cache slot holds the K/V of the token at its position, so in
every drawn step of every kind of trace it has that token's colour (or the stale colour past the
live length); and every token's label fits inside its box."""
import matplotlib.colors as mcolors
import pytest

import minikv
from minikv.viz.draw import COLORS, draw_step, draw_steps
from minikv.viz.replay import replay

from conftest import varied_model
from test_serving import MODEL16, det_request, find_seed, run
from test_speculative import FAR, TARGET


def plain_trace():
    return minikv.generate(varied_model(), [1, 2, 3, 4], 6, trace=True).trace


def naive_trace():
    return minikv.generate(varied_model(), [1, 2, 3], 4, mode="naive", trace=True).trace


def speculative_trace():
    return minikv.speculative_generate(TARGET, FAR, [1, 2, 3], 14, gamma=3, trace=True).trace


def deterministic_trace():
    seed, _ = find_seed(lambda v, r, c: r is not None)
    return run(MODEL16, det_request(seed=seed, n=30), 3, 3, trace=True).trace


TRACES = {"plain": plain_trace, "naive": naive_trace, "speculative": speculative_trace,
          "deterministic": deterministic_trace}


def drawn(fig) -> dict[str, dict[int, str]]:
    """row -> position -> face colour (hex) of every box drawn, read back from the figure."""
    rows: dict[str, dict[int, str]] = {}
    for ax in fig.axes:
        for patch in ax.patches:
            if patch.get_gid():
                row, pos = patch.get_gid().split(":")
                rows.setdefault(row, {})[int(pos)] = mcolors.to_hex(patch.get_facecolor())
    return rows


@pytest.mark.parametrize("kind", TRACES)
def test_every_slot_has_the_colour_of_its_token(kind):
    trace = TRACES[kind]()
    stale = mcolors.to_hex(COLORS["stale"])
    for step, snap in enumerate(replay(trace)):
        rows = drawn(draw_step(snap, max_positions=64))
        tokens = rows["tokens"]
        assert tokens == {p: mcolors.to_hex(COLORS[s]) for p, s in enumerate(snap.status)}
        for row, live in (("cache", snap.cache_len), ("draft", snap.draft_cache_len),
                          ("recomputed", len(rows.get("recomputed", {})))):
            for p, colour in rows.get(row, {}).items():
                expected = tokens[p] if p < live else stale
                assert colour == expected, (f"{kind} step {step + 1} ({snap.event.kind}): "
                                            f"{row} slot {p} is {colour}, its token {tokens[p]}")


def test_the_states_are_told_apart():
    """Six states, six colours: none shares a colour with another."""
    assert len({mcolors.to_hex(c) for c in COLORS.values()}) == len(COLORS) == 6


def test_a_decoded_token_is_not_drawn_as_accepted():
    """Plain decoding verifies nothing: its tokens are the model's own, never 'accepted'."""
    assert {s for snap in replay(plain_trace()) for s in snap.status} == {"prompt", "generated"}


@pytest.mark.parametrize("max_positions", [28, 18])
def test_token_labels_fit_their_boxes(max_positions):
    """At widget size (28 positions) and figure size (18), no label spills out of its box."""
    tok = minikv.load_tokenizer()
    target, _ = minikv.load_course_model("target", "cpu")
    draft, _ = minikv.load_course_model("draft", "cpu")
    out = minikv.speculative_generate(target, draft, tok.encode("Once upon a time"), 30, gamma=3,
                                      trace=True)
    snaps = replay(out.trace)
    for fig in (draw_step(snaps[-1], tok.decode, max_positions=max_positions),
                draw_steps(snaps[-3:], tok.decode, max_positions=max_positions)):
        renderer = fig.canvas.get_renderer()
        for ax in fig.axes:
            boxes = {p.get_gid(): p.get_window_extent(renderer) for p in ax.patches
                     if p.get_gid()}
            labels = [t for t in ax.texts if t.get_gid()]
            assert labels
            for text in labels:
                inside, box = text.get_window_extent(renderer), boxes[text.get_gid()]
                assert box.x0 <= inside.x0 and inside.x1 <= box.x1, (
                    f"{text.get_text()!r} ({inside.width:.0f} px) overflows its box "
                    f"({box.width:.0f} px)")


def test_the_window_picture_draws_what_the_cache_held_and_nothing_else():
    """draw_window: a box in the prompt colour for each position SinkWindowCache held after each
    pass, an empty outline for each it had evicted."""
    from minikv.engine.window import SinkWindowCache, feed
    from minikv.viz.draw import draw_window
    model = varied_model()
    cache, held = SinkWindowCache.for_model(model, sinks=2, window=3), []
    ids = list(range(3, 12))
    for token in ids:
        feed(model, [token], cache)
        held.append(list(cache.positions))
    gids = {p.get_gid(): p for p in draw_window(held, ids, sinks=2).axes[0].patches}
    for t, positions in enumerate(held):
        for j in range(t + 1):
            if j in positions:
                assert mcolors.to_hex(gids[f"held-{t}-{j}"].get_facecolor()) == COLORS["prompt"]
                assert f"evicted-{t}-{j}" not in gids
            else:
                assert f"evicted-{t}-{j}" in gids and f"held-{t}-{j}" not in gids
    assert sum(g.startswith("held-") for g in gids) == sum(map(len, held)) == 1 + 2 + 3 + 4 + 5 * 5


def test_the_walk_picture_colours_slots_by_their_token_and_marks_reads_neutrally():
    """Chapter 09's walk: every slot in its token's colour (prompt, then generated), "read so far"
    a neutral dot, never a state's colour; the running numbers' hues are no state's either; the
    static picture carries the caption with the rescale factor."""
    import torch

    from minikv.engine.flash import walk
    from minikv.viz.tiles import READ_MARK, RUNNING, draw_walk, walk_caption
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(6, 2, 4, 8, generator=g), torch.randn(6, 2, 4, 8, generator=g)
    keys[3, :, 1] *= 4
    q, steps = torch.randn(4, 8, generator=g), []
    walk(q, keys, values, [5, 3, 0], 0, 11, steps=steps)
    fig = draw_walk(steps, 1, [5, 3, 0], 4, 11, steps[-1].out, head=1, prompt_len=7)
    pages = fig.axes[0]
    slots = {int(p.get_gid().split(":")[1]): mcolors.to_hex(p.get_facecolor())
             for p in pages.patches if (p.get_gid() or "").startswith("slot:")}
    assert slots == {p: mcolors.to_hex(COLORS["prompt" if p < 7 else "generated"]) if p < 11
                     else "#ffffff" for p in range(12)}
    reads = [line for line in pages.lines if (line.get_gid() or "").startswith("read:")]
    assert sorted(int(line.get_gid().split(":")[1]) for line in reads) == list(range(8))
    states = {mcolors.to_hex(c) for c in COLORS.values()}
    assert {mcolors.to_hex(c) for c in (READ_MARK, *RUNNING.values())}.isdisjoint(states)
    caption = next(t.get_text() for t in pages.texts if t.get_gid() == "caption")
    assert caption == f"tile 2: {walk_caption(steps, 1, 1)}"
