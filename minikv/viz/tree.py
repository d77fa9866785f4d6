"""Chapter 10's pictures: one token-tree round, drawn from the engine's own record of it (a
`verify.Round` with its tree): the tree the head proposed, the mask the target's one pass used,
the target's choice walking down the tree depth by depth, and what the commit kept. A stepper
goes through the round."""
from __future__ import annotations

from matplotlib.patches import FancyBboxPatch, Patch

from ..engine.tree import children, depths, tree_mask, tree_positions
from ..engine.verify import Round
from .draw import COLORS, HATCH, NotebookFigure
from .widgets import Stepper

MASK_COLORS = {True: "#4a4e69", False: "#ffffff"}  # sees / does not see: no token state


def tree_layout(parents: list[int]) -> dict[int, tuple[float, float]]:
    """node (-1: the root) -> (x, y): depth down the x axis, leaves spread on y in order."""
    kids, place, next_y = children(parents), {}, [0.0]

    def visit(node: int, depth: int) -> float:
        ys = [visit(c, depth + 1) for c in kids[node]]
        y = sum(ys) / len(ys) if ys else next_y[0]
        if not ys:
            next_y[0] += 1.0
        place[node] = (float(depth), -y)
        return y
    visit(-1, 0)
    return place


def round_steps(rnd: Round) -> list[dict]:
    """The round as steps: the proposal, then the target's choice at each depth of the walk
    (the committed token there), then the commit. Each step: a title and every node's state."""
    path, parents = rnd.verdict.nodes, rnd.parents
    kids = children(parents)
    committed = [rnd.proposals[i] for i in path] + [rnd.verdict.token]
    state = {i: "proposed" for i in range(len(parents))}
    steps = [dict(kind="proposed", depth=0, state=dict(state), choice=None)]
    for d, choice in enumerate(committed):
        at = path[d - 1] if d else -1
        for c in kids[at]:
            state[c] = "accepted" if d < len(path) and c == path[d] else "rejected"
        steps.append(dict(kind="judge", depth=d + 1, state=dict(state), choice=choice, at=at))
    final = {i: s if s == "accepted" else "stale" for i, s in state.items()}
    steps.append(dict(kind="commit", depth=len(path) + 1, state=final, choice=rnd.verdict.token))
    return steps


def tree_caption(rnd: Round, index: int, label, root_label: str) -> str:
    """What step `index` of round_steps(rnd) shows, in words; label(token id) -> its text."""
    steps, parents = round_steps(rnd), rnd.parents
    s = steps[index]
    n, deep = len(parents), max(depths(parents))
    if s["kind"] == "proposed":
        return (f"the head proposed {n} tokens, {deep} deep, after {root_label!r}: one target "
                f"pass reads them all, each seeing only its own ancestors")
    if s["kind"] == "commit":
        before, after = rnd.cache_lens["verifier"]
        return (f"commit {len(rnd.verdict.nodes)} accepted + the target's {label(s['choice'])!r}; "
                f"the accepted path's K/V moved into place, the other branches dropped: cache "
                f"{before} → {after} positions")
    at = root_label if s["at"] < 0 else label(rnd.proposals[s["at"]])
    offered = [label(rnd.proposals[c]) for c in children(parents)[s["at"]]]
    if s["depth"] <= len(rnd.verdict.nodes):
        return (f"depth {s['depth']}: after {at!r} the target chooses {label(s['choice'])!r}, "
                f"one of the children {offered}: accepted, go down")
    if not offered:
        return (f"depth {s['depth']}: {at!r} is a leaf; the target's own token there, "
                f"{label(s['choice'])!r}, is the bonus")
    return (f"depth {s['depth']}: after {at!r} the target chooses {label(s['choice'])!r}, none "
            f"of {offered}: the round ends with the target's token")


def draw_tree_round(rnd: Round, index: int, label, root_label: str, title: str = ""):
    """Step `index` of the round: the tree (node colours: proposed, accepted, rejected, stale
    after rollback) beside the mask of the target's pass (its rows: the root, then each node)."""
    steps, parents = round_steps(rnd), rnd.parents
    s = steps[index]
    place = tree_layout(parents)
    n = len(parents)
    height = max(2.6, 0.42 * max(1, -min(y for _, y in place.values()) + 1) + 1.2)
    fig = NotebookFigure(figsize=(10.5, height + 0.6))
    ax, mx = fig.add_axes([0.01, 0.2, 0.62, 0.7]), fig.add_axes([0.70, 0.2, 0.28, 0.68])
    positions = tree_positions(parents, rnd.start)  # the root is the first row
    for node, (x, y) in place.items():
        parent = parents[node] if node >= 0 else None
        if parent is not None:
            px, py = place[parent]
            ax.plot([px + 0.62, x], [py, y], color="#888888", linewidth=0.8, zorder=1)
        state = "generated" if node < 0 else s["state"][node]
        text = root_label if node < 0 else rnd.proposals[node]
        text = text if isinstance(text, str) else label(text)
        ax.add_patch(FancyBboxPatch((x, y - 0.3), 0.62, 0.6, boxstyle="round,pad=0.02",
                                    facecolor=COLORS[state], hatch=HATCH.get(state),
                                    edgecolor="#444444", linewidth=0.6, zorder=2,
                                    gid=f"node:{node}:{state}"))
        ax.text(x + 0.31, y, repr(text)[1:-1][:9], ha="center", va="center", fontsize=7,
                zorder=3, bbox=dict(facecolor="white", edgecolor="none", alpha=0.8, pad=0.8))
        if node >= 0:
            ax.text(x + 0.31, y + 0.38, f"{node}·p{positions[node]}", ha="center", fontsize=5.5,
                    color="#555555")
    # the target's own token: from the step where the walk stops (a correction, or a leaf's bonus)
    if s["kind"] == "commit" or s["depth"] > len(rnd.verdict.nodes):
        last = rnd.verdict.nodes[-1] if rnd.verdict.nodes else -1
        x, y = place[last]
        ax.add_patch(FancyBboxPatch((x + 1, y - 0.3), 0.62, 0.6, boxstyle="round,pad=0.02",
                                    facecolor=COLORS["generated"], edgecolor="#444444",
                                    linewidth=1.2, zorder=2, gid="target-token"))
        ax.text(x + 1.31, y, repr(label(rnd.verdict.token))[1:-1][:9], ha="center",
                va="center", fontsize=7, zorder=3)
    deep = max(depths(parents))
    ys = [y for _, y in place.values()]
    ax.set(xlim=(-0.2, deep + 1.8), ylim=(min(ys) - 0.7, max(ys) + 0.7), xticks=[], yticks=[])
    ax.axis("off")
    ax.legend(handles=[Patch(facecolor=COLORS[k], hatch=HATCH.get(k), edgecolor="#444444",
                             label=name) for k, name in
                       (("generated", "committed (the root; the target's token)"),
                        ("proposed", "proposed, not judged yet"), ("accepted", "accepted"),
                        ("rejected", "rejected"), ("stale", "dropped with its branch"))],
              loc="upper left", bbox_to_anchor=(0.0, -0.02), fontsize=6.5, frameon=False,
              ncol=3)
    mask = tree_mask(parents, prefix=1)
    for i in range(n + 1):
        for j in range(n + 1):
            mx.add_patch(FancyBboxPatch((j, -i - 1), 1, 1, boxstyle="square,pad=0",
                                        facecolor=MASK_COLORS[bool(mask[i, j])],
                                        edgecolor="#cccccc", linewidth=0.4))
    names = ["root"] + [str(i) for i in range(n)]
    mx.set(xlim=(0, n + 1), ylim=(-n - 1, 0), aspect="equal",
           xticks=[j + 0.5 for j in range(n + 1)], yticks=[-i - 0.5 for i in range(n + 1)])
    mx.set_xticklabels(names, fontsize=5.5, rotation=90)
    mx.set_yticklabels(names, fontsize=5.5)
    mx.set_title("the pass's mask: row sees column\n(and every cached position)", fontsize=7)
    ax.set_title(title or "one token-tree round", fontsize=9, loc="left")
    return fig


class TreeStepper(Stepper):
    """Step through one tree round: proposed, judged depth by depth, committed."""

    def __init__(self, rnd: Round, label, root_label: str, title: str = ""):
        if rnd.parents is None:
            raise ValueError("a TreeStepper shows a tree's round: verify with parents=...")
        self.rnd, self.label, self.root_label, self.title = rnd, label, root_label, title
        self.steps = round_steps(rnd)
        super().__init__(len(self.steps), f"<b>{title or 'one token-tree round'}</b>")

    def draw(self, index: int):
        return draw_tree_round(self.rnd, index, self.label, self.root_label, self.title)

    def info(self, index: int) -> str:
        """The cache's length (every node's K/V until the commit drops the other branches),
        the tree, and how many nodes are in each state."""
        s = self.steps[index]
        before, after = self.rnd.cache_lens["verifier"]
        counts = {k: sum(v == k for v in s["state"].values())
                  for k in ("proposed", "accepted", "rejected", "stale")}
        return (f"KV cache: {after if s['kind'] == 'commit' else before} positions · tree: "
                f"{len(self.rnd.parents)} tokens, {max(depths(self.rnd.parents))} deep · "
                + " · ".join(f"{k}: {v}" for k, v in counts.items() if v))

    def describe(self, index: int) -> str:
        return tree_caption(self.rnd, index, self.label, self.root_label)
