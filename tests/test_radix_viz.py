"""Chapter 11's tree pictures and stepper (minikv/viz/radix.py) are drawn from the engine's own
state: every snapshot is the tree, the pool and the running tables as they were after that
step, and its caption says what the step changed (a split, a copy on write, an eviction to the
tier, a copy back)."""
import matplotlib.colors as mcolors

from minikv import Radix
from minikv.engine.serving import Engine
from minikv.engine.session import Session, turn
from minikv.viz.draw import COLORS
from minikv.viz.radix import (
    TIER_COLOR,
    TREE_COLOR,
    RadixStepper,
    TreeRecorder,
    draw_tree,
    snapshot_of,
    tree_caption,
    tree_info,
    tree_lines,
)

from conftest import varied_model

MODEL = varied_model().double()


def recorded(num_blocks=22, tier_blocks=16):
    """Two users, as chapter 11's section 4 serves them, on a tiny model (token ids)."""
    engine = Engine(MODEL, num_blocks, page_size=4,
                    prefix_caching=Radix(tier_blocks=tier_blocks))
    recorder = TreeRecorder(engine)
    a, b = Session(engine), Session(engine)
    statement = [3, 1, 4, 1, 5, 9, 2]
    a.say(statement + [6, 5, 3, 5, 8, 9, 7, 9, 3, 2], 2)
    b.say(statement + [7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5], 2)
    turn([a, b], [[11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22],
                  [31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42]], 2)
    a.say([50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63, 64], 2)
    b.say([70, 71, 72, 73, 74, 75, 76, 77, 78, 79], 2)
    return engine, recorder


def test_every_snapshot_is_the_engines_state_after_its_step():
    engine, recorder = recorded()
    assert len(recorder.snapshots) == engine.scheduler.now + 1  # before any step, then each
    last, tree = recorder.snapshots[-1], engine.scheduler.prefix
    assert sorted((n.start, n.tokens, n.blocks, n.tiered) for n in last.nodes) == sorted(
        (n.start, tuple(n.tokens), tuple(n.blocks), n.tiered) for n in tree.nodes())
    assert last.ref == tuple(engine.pool.ref) and last.tier_ref == tuple(tree.tier.ref)
    assert last.counts == tree.counts and not last.tables
    drawn = [(n.start, n.tokens, n.blocks, n.tiered) for n in snapshot_of(tree).nodes]
    assert drawn == [(n.start, n.tokens, n.blocks, n.tiered) for n in last.nodes]
    logged = [entry for snap in recorder.snapshots for entry in snap.log]
    assert logged == engine.pool.log  # each step's log once, in order


def test_the_captions_say_what_each_step_did_to_the_tree():
    _, recorder = recorded()
    said = " | ".join(tree_caption(s) for s in recorder.snapshots)
    for words in ("request 0 admitted: 0 of its", "split at position 7", "in both halves",
                  "copy-on-write", "evicted to the tier", "copied back from the tier",
                  "finished: its positions inserted"):
        assert words in said, words
    assert tree_caption(recorder.snapshots[0]).startswith("before any step")
    running = next(s for s in recorder.snapshots if s.tables)
    assert tree_info(running).startswith(f"KV cache: {sum(running.lengths.values())} positions")
    assert any(n.readers for n in running.nodes)  # the nodes a running request reads
    lines = tree_lines(recorder.snapshots[-1])
    assert len(lines) == len(recorder.snapshots[-1].nodes) and "tier blocks" in "".join(lines)


def test_the_stepper_walks_the_snapshots():
    _, recorder = recorded()
    stepper = RadixStepper(recorder.snapshots, title="tree")
    pictures = set()
    for i in (0, 3, len(recorder.snapshots) - 1):
        stepper.go(i)
        snap = recorder.snapshots[i]
        assert stepper.caption.value.endswith(tree_caption(snap))
        assert stepper.cache_info.value == tree_info(snap)
        pictures.add(stepper.image.value)
    assert len(pictures) == 3


def test_the_tree_picture_uses_no_token_states_colour():
    """Nodes in the tree's own colours (pool or tier), blocks in a request's, the tree's or
    the tier's: never a token state's (COURSE.md: one colour, one meaning)."""
    _, recorder = recorded()
    states = {mcolors.to_hex(c) for c in COLORS.values()}
    seen: dict[str, set] = {}
    for snap in recorder.snapshots:
        for patch in draw_tree(snap).axes[0].patches:
            if patch.get_gid():
                kind = patch.get_gid().split(":")[0]  # node, pool or tier
                seen.setdefault(kind, set()).add(mcolors.to_hex(patch.get_facecolor()))
    assert seen["node"] == {mcolors.to_hex(TREE_COLOR), mcolors.to_hex(TIER_COLOR)}
    assert seen["pool"] and seen["tier"]
    assert not set().union(*seen.values()) & states
