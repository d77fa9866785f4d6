"""Chapter 11's pictures: the radix tree of an engine's prefix cache (engine/radix.py), drawn
from its live state: every node's tokens, positions and blocks, the running requests that lock
it, whether its K/V is in the pool or in the second tier, and the pool's blocks below it (who
holds each, which are shared). `TreeRecorder` snapshots an `Engine` after each of its steps;
`RadixStepper` steps through the snapshots, each caption saying what the step did to the tree
(a node inserted, split, evicted to the tier or copied back; a block copied on write)."""
from __future__ import annotations

from dataclasses import dataclass, field

from matplotlib.figure import Figure
from matplotlib.patches import FancyBboxPatch, Patch, Rectangle

from ..engine.radix import RadixTree
from .draw import NotebookFigure
from .pool import SHARED_HATCH, owner_color
from .widgets import Stepper

# Neither a token state's hue (draw.COLORS) nor a request's (pool.OWNER_COLORS): the tree's own.
TREE_COLOR, TIER_COLOR, TIER_HATCH = "#e6ccb2", "#f4ede4", ".."
NODE_W, PITCH, BLOCK_W = 2.9, 3.3, 0.75  # a node's box, a level's width, a block's (data units)


@dataclass(frozen=True)
class NodeView:
    """One node as it was: its id (stable across snapshots), its parent's (-1: the root), its
    tokens at positions start.., its blocks (in the pool, or in the tier when `tiered`), and
    the running requests that read through it."""
    id: int
    parent: int
    tokens: tuple[int, ...]
    start: int
    blocks: tuple[int, ...]
    tiered: bool
    locks: int
    hits: int
    readers: tuple[int, ...]

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


@dataclass(frozen=True)
class TreeSnapshot:
    """The tree, the pool and the running requests after one engine step (-1: before any)."""
    step: int
    nodes: tuple[NodeView, ...]
    ref: tuple[int, ...]                       # pool blocks: references (tree's and tables')
    tier_ref: tuple[int, ...] | None           # tier blocks: references (None: no tier)
    tables: dict[int, tuple[int, ...]]         # running request -> its blocks
    lengths: dict[int, int]                    # running request -> cached positions
    log: tuple[tuple[str, int, int], ...]      # the pool's log of this step
    counts: dict[str, int]                     # tree.counts after the step
    events: tuple[str, ...] = field(default=())  # what the step did, in words

    def node(self, node_id: int) -> NodeView:
        return next(n for n in self.nodes if n.id == node_id)


class TreeRecorder:
    """Snapshots of `engine`'s radix tree after every `engine.step()` (it wraps the step, so a
    Session's turns are recorded too); `snapshots[0]` is the state when recording began."""

    def __init__(self, engine, decode=None):
        tree = engine.scheduler.prefix
        if not isinstance(tree, RadixTree):
            raise TypeError("TreeRecorder draws a radix tree: Engine(..., "
                            "prefix_caching=Radix())")
        self.engine, self.tree, self.decode = engine, tree, decode
        self._ids: dict[int, int] = {}
        self._alive: list = []  # the nodes seen, kept so that no id() is reused
        self._logged = len(engine.pool.log)
        self.snapshots = [self.snapshot(-1)]
        step = engine.step

        def recorded_step():
            out = step()
            self.snapshots.append(self.snapshot(engine.scheduler.now - 1))
            return out
        engine.step = recorded_step

    def _id(self, node) -> int:
        if id(node) not in self._ids:
            self._ids[id(node)] = len(self._ids)
            self._alive.append(node)
        return self._ids[id(node)]

    def snapshot(self, step: int) -> TreeSnapshot:
        tree, sched, pool = self.tree, self.engine.scheduler, self.engine.pool
        readers: dict[int, list[int]] = {}
        for request, (node, _) in tree.held.items():
            while node not in (None, tree.root):
                readers.setdefault(id(node), []).append(request)
                node = node.parent
        nodes = tuple(NodeView(
            self._id(n), -1 if n.parent is tree.root else self._id(n.parent), tuple(n.tokens),
            n.start, tuple(n.blocks), n.tiered, n.locks, n.hits,
            tuple(sorted(readers.get(id(n), ())))) for n in _in_order(tree))
        log, self._logged = tuple(pool.log[self._logged:]), len(pool.log)
        snap = TreeSnapshot(
            step, nodes, tuple(pool.ref), tuple(tree.tier.ref) if tree.tier else None,
            {s.index: tuple(s.table.blocks) for s in sched.running},
            {s.index: s.table.length for s in sched.running}, log, dict(tree.counts))
        if not hasattr(self, "snapshots"):
            return snap
        events = step_events(self.snapshots[-1], snap, sched, self.decode)
        return TreeSnapshot(**{**snap.__dict__, "events": tuple(events)})


def _in_order(tree: RadixTree) -> list:
    """Every node, depth first, children in the order of their first token."""
    found, todo = [], sorted(tree.root.children.values(), key=lambda n: n.tokens[0],
                             reverse=True)
    while todo:
        found.append(node := todo.pop())
        todo += sorted(node.children.values(), key=lambda n: n.tokens[0], reverse=True)
    return found


def snapshot_of(tree: RadixTree) -> TreeSnapshot:
    """A tree that serves no engine (built by hand), as a snapshot: no running requests."""
    ids: dict[int, int] = {}
    order = _in_order(tree)
    for n in order:
        ids[id(n)] = len(ids)
    nodes = tuple(NodeView(ids[id(n)], ids.get(id(n.parent), -1), tuple(n.tokens), n.start,
                           tuple(n.blocks), n.tiered, n.locks, n.hits, ()) for n in order)
    return TreeSnapshot(-1, nodes, tuple(tree.pool.ref),
                        tuple(tree.tier.ref) if tree.tier else None, {}, {}, (),
                        dict(tree.counts))


def _text(tokens, decode, width: int = 22) -> str:
    text = decode(list(tokens)) if decode else " ".join(map(str, tokens))
    text = text.replace("\n", "⏎")
    return repr(text if len(text) <= width else text[:width - 1] + "…")


def step_events(before: TreeSnapshot, after: TreeSnapshot, sched=None, decode=None) -> list[str]:
    """What happened between two snapshots, in words: requests admitted (what they found in
    the tree) and finished, nodes split, inserted, evicted (to the tier or dropped) and copied
    back, blocks copied on write."""
    events = []
    old = {n.id: n for n in before.nodes}
    new = {n.id: n for n in after.nodes}
    for r in sorted(set(after.tables) - set(before.tables)):
        s = sched.seqs[r] if sched is not None else None
        found = f": {s.stats.reused} of its {len(s.tokens)} positions found in the tree" \
            if s is not None else ""
        events.append(f"request {r} admitted{found}")
    for n in (new[i] for i in sorted(set(new) - set(old))):
        moved = [c for c in after.nodes if c.parent == n.id and c.id in old]
        if moved:  # an existing node now hangs below a new one: its edge was cut
            both = n.blocks and moved[0].blocks and n.blocks[-1] == moved[0].blocks[0]
            events.append(f"split at position {n.end}: {_text(n.tokens, decode)} | "
                          f"{_text(moved[0].tokens, decode)}" + (
                              f" (block #{n.blocks[-1]} in both halves)" if both else ""))
        else:
            events.append(f"inserted positions {n.start}–{n.end - 1} {_text(n.tokens, decode)}")
    for i in sorted(set(old) & set(new)):
        if not old[i].tiered and new[i].tiered:
            events.append(f"evicted to the tier: positions {new[i].start}–{new[i].end - 1} "
                          f"({len(new[i].blocks)} block(s) copied out)")
        elif old[i].tiered and not new[i].tiered:
            events.append(f"copied back from the tier: positions {new[i].start}–"
                          f"{new[i].end - 1} ({len(new[i].blocks)} block(s))")
    gone = set(old) - set(new)
    for i in sorted(i for i in gone if old[i].parent not in gone):  # a subtree's top
        where = "the tier" if old[i].tiered else "the pool"
        events.append(f"dropped from {where}: positions {old[i].start}–{old[i].end - 1}")
    copies = [(what, block, owner) for what, block, owner in after.log if what == "copy"]
    for _, block, owner in copies:
        events.append(f"request {owner} copied a shared, partly filled block into #{block} "
                      f"before writing (copy-on-write)")
    for r in sorted(set(before.tables) - set(after.tables)):
        events.append(f"request {r} finished: its positions inserted, its blocks let go")
    return events


def tree_caption(snap: TreeSnapshot) -> str:
    what = "; ".join(snap.events) or ("the tree before any request" if snap.step < 0
                                      else "decode: the tree unchanged")
    where = "before any step" if snap.step < 0 else f"engine step {snap.step}"
    return f"{where}: {what}"


def tree_info(snap: TreeSnapshot) -> str:
    """The numbers the picture shows, as text (the browser test reads its first words)."""
    in_pool = {b for n in snap.nodes if not n.tiered for b in n.blocks}
    tiered = sum(len(n.blocks) for n in snap.nodes if n.tiered)
    return (f"KV cache: {sum(snap.lengths.values())} positions in {len(snap.tables)} running "
            f"table(s) · tree: {len(snap.nodes)} nodes, {len(in_pool)} pool blocks, "
            f"{tiered} tier blocks · {snap.ref.count(0)} of {len(snap.ref)} pool blocks free")


def tree_lines(snap: TreeSnapshot, decode=None) -> list[str]:
    """The tree as indented text: one line per node (positions, tokens, blocks, where, locks)."""
    depth = {-1: -1}
    lines = []
    for n in snap.nodes:  # depth first: a parent comes before its children
        depth[n.id] = depth[n.parent] + 1
        where = "tier" if n.tiered else "pool"
        lock = f", read by {list(n.readers)}" if n.readers else ""
        lines.append(f"{'   ' * depth[n.id]}└─ positions {n.start}–{n.end - 1} "
                     f"{_text(n.tokens, decode, 40)}  {where} blocks {list(n.blocks)}, "
                     f"hits {n.hits}{lock}")
    return lines


def _layout(snap: TreeSnapshot) -> dict[int, tuple[float, float]]:
    """node id -> (depth, -row): children to the right of their parent, leaves one per row."""
    kids: dict[int, list[int]] = {}
    for n in snap.nodes:
        kids.setdefault(n.parent, []).append(n.id)
    place, row = {}, [0.0]

    def visit(node: int, depth: int) -> float:
        ys = [visit(c, depth + 1) for c in kids.get(node, [])]
        y = ys[0] if ys else row[0]
        if not ys:
            row[0] += 1.0
        place[node] = (float(depth), -y)
        return y
    visit(-1, 0)
    return place


def draw_tree(snap: TreeSnapshot, decode=None, title: str | None = None) -> Figure:
    """The tree (left to right: the root, then each node's edge of tokens; a node in the tree's
    colour while its K/V is in the pool, dotted when it is in the tier; outlined in the colour
    of the running requests that read through it) above the pool's blocks (a running request's
    colour when one holds it, the tree's when only the tree does, hatched when shared, white
    when free) and the tier's."""
    place = _layout(snap)
    rows = max(1, -min(y for _, y in place.values()) + 1)
    depth = max(x for x, _ in place.values())
    n_pool, n_tier = len(snap.ref), len(snap.tier_ref or ())
    width = max(depth * PITCH, 20 * BLOCK_W)
    grid = -(-n_pool // 20) + (-(-n_tier // 20) if n_tier else 0)
    fig = NotebookFigure(figsize=(max(8.0, 0.42 * (width + 2.4)), 1.5 + 0.62 * rows + 0.4 * grid))
    ax = fig.add_axes((0.01, 0.16, 0.98, 0.83 - 0.45 / fig.get_figheight()))
    box = dict(facecolor="white", edgecolor="none", alpha=0.85, pad=0.6)
    for n in snap.nodes:
        x, y = (place[n.id][0] - 1) * PITCH, place[n.id][1]
        px = -0.1 if n.parent < 0 else (place[n.parent][0] - 1) * PITCH + NODE_W
        ax.plot([px, x], [place[n.parent][1], y], color="#888888", linewidth=0.8, zorder=1)
        edge = owner_color(n.readers[0]) if n.readers else "#777777"
        ax.add_patch(FancyBboxPatch(
            (x, y - 0.36), NODE_W, 0.72, boxstyle="round,pad=0.02",
            facecolor=TIER_COLOR if n.tiered else TREE_COLOR,
            hatch=TIER_HATCH if n.tiered else None, edgecolor=edge,
            linewidth=2.4 if n.readers else 0.7, linestyle="--" if n.tiered else "-",
            zorder=2, gid=f"node:{n.id}:{'tier' if n.tiered else 'pool'}"))
        ax.text(x + NODE_W / 2, y + 0.13, _text(n.tokens, decode, 24)[1:-1], ha="center",
                va="center", fontsize=6, zorder=3, bbox=box)
        who = f" · r{',r'.join(map(str, n.readers))}" if n.readers else ""
        ax.text(x + NODE_W / 2, y - 0.19, f"p{n.start}–{n.end - 1} · "
                f"{'tier ' if n.tiered else ''}#{','.join(map(str, n.blocks))}{who}",
                ha="center", va="center", fontsize=5.5, color="#333333", zorder=3, bbox=box)
    ax.add_patch(Rectangle((-0.5, -0.25), 0.4, 0.5, facecolor="#ffffff", edgecolor="#555555"))
    ax.text(-0.6, 0, "root", ha="right", va="center", fontsize=7)
    bottom = _blocks(ax, snap, -rows + 0.3)
    ax.set_xlim(-2.0, width + 0.2)
    ax.set_ylim(bottom - 0.1, 0.6)
    ax.axis("off")
    ax.set_title(title if title is not None else tree_caption(snap), fontsize=8, loc="left",
                 wrap=True)
    handles = [Patch(facecolor=TREE_COLOR, edgecolor="#777777", label="node: K/V in the pool"),
               Patch(facecolor=TIER_COLOR, hatch=TIER_HATCH, edgecolor="#777777",
                     linestyle="--", label="node: K/V in the tier")]
    handles += [Patch(facecolor="white", edgecolor=owner_color(r), linewidth=2,
                      label=f"read by running request {r}") for r in sorted(snap.tables)]
    handles += [Patch(facecolor="#cccccc", hatch=SHARED_HATCH, label="block with k holders (×k)"),
                Patch(facecolor="white", edgecolor="#777777", label="free block")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(0.0, 0.0), fontsize=6.5,
              frameon=False, ncol=min(len(handles), 4))
    return fig


def _blocks(ax, snap: TreeSnapshot, top: float) -> float:
    """The pool's blocks, then the tier's, 20 a row, from `top` down; the lowest y drawn."""
    holders: dict[int, list[int]] = {}
    for r, blocks in snap.tables.items():
        for b in blocks:
            holders.setdefault(b, []).append(r)
    y = top
    for name, refs in (("pool", snap.ref), ("tier", snap.tier_ref)):
        if refs is None:
            continue
        ax.text(-0.6, y - 0.3, name, ha="right", va="center", fontsize=7)
        for b, ref in enumerate(refs):
            x, yb = (b % 20) * BLOCK_W, y - 0.6 - 0.7 * (b // 20)
            who = holders.get(b, []) if name == "pool" else []
            face = (owner_color(who[0]) if who else TREE_COLOR if name == "pool"
                    else TIER_COLOR) if ref else "white"
            ax.add_patch(Rectangle((x, yb), BLOCK_W * 0.92, 0.55, facecolor=face,
                                   edgecolor="#777777", linewidth=0.5,
                                   hatch=SHARED_HATCH if ref > 1 else None, gid=f"{name}:{b}"))
            ax.text(x + BLOCK_W * 0.46, yb + 0.38, f"#{b}", ha="center", va="center",
                    fontsize=5.5, color=("white" if who else "#333333") if ref else "#aaaaaa")
            if ref:
                label = (f"×{ref}" if ref > 1 else f"r{who[0]}" if who
                         else "tree" if name == "pool" else "tier")
                ax.text(x + BLOCK_W * 0.46, yb + 0.13, label, ha="center", va="center",
                        fontsize=5, color="white" if who and ref == 1 else "#333333")
        y -= 0.7 * -(-len(refs) // 20) + 0.1
    return y - 0.1


class RadixStepper(Stepper):
    """Step through a TreeRecorder's snapshots: the tree and the pool after each engine step."""

    def __init__(self, snapshots: list[TreeSnapshot], decode=None, title: str = ""):
        if not snapshots:
            raise ValueError("no snapshots: record an engine with TreeRecorder(engine)")
        self.snapshots, self.decode = list(snapshots), decode
        super().__init__(len(self.snapshots), f"<b>{title}</b>")

    def draw(self, index: int):
        return draw_tree(self.snapshots[index], self.decode)

    def info(self, index: int) -> str:
        return tree_info(self.snapshots[index])

    def describe(self, index: int) -> str:
        return tree_caption(self.snapshots[index])
