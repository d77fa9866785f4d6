"""Chapter 09's pictures: a decode query walking its block table tile by tile (the running max,
the running sum and the output as it converges), drawn from `engine.flash.walk`'s steps, with a
stepper through them; and FlashAttention's causal tile schedule, from `engine.flash.tile_kind`."""
from __future__ import annotations

import torch
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle

from ..engine.flash import WalkStep, tile_kind
from .draw import COLORS, NotebookFigure
from .widgets import Stepper

# Tiles and running numbers are no token state: hues used nowhere else in the course (not
# draw.COLORS, not draw.SERIES, not pool.OWNER_COLORS), none near a state's (no red, yellow,
# green or light blue). A slot of the walk keeps its token's colour (prompt or generated, as
# everywhere); "read" is a neutral mark on it, not a colour.
TILE_COLORS = {"full": "#52796f", "masked": "#cad2c5", "skipped": "#ffffff"}
RUNNING = {"max": "#b5179e", "sum": "#003049", "out": "#6d6875"}
READ_MARK = "#222222"


def tile_grid(T: int, L: int, block_q: int, block_k: int) -> list[list[str]]:
    """The kind of every (query tile, key tile) under the causal mask, row by row."""
    return [[tile_kind(i, j, block_q, block_k, T, L) for j in range(-(-L // block_k))]
            for i in range(-(-T // block_q))]


def draw_tile_schedule(T: int, L: int, block_q: int, block_k: int, ax=None):
    """The causal tile schedule: a square per (query tile, key tile), computed whole, computed
    with the mask (the diagonal crosses it) or skipped, with the count of each."""
    grid = tile_grid(T, L, block_q, block_k)
    if ax is None:
        fig = NotebookFigure(figsize=(3.2 + 0.25 * len(grid[0]), 1.2 + 0.25 * len(grid)))
        ax = fig.add_subplot()
    for i, row in enumerate(grid):
        for j, kind in enumerate(row):
            ax.add_patch(Rectangle((j, -i - 1), 1, 1, facecolor=TILE_COLORS[kind],
                                   edgecolor="#777777", linewidth=0.6, gid=f"{i}:{j}:{kind}"))
    counts = {k: sum(r.count(k) for r in grid) for k in TILE_COLORS}
    ax.set(xlim=(0, len(grid[0])), ylim=(-len(grid), 0), aspect="equal", xticks=[], yticks=[],
           xlabel=f"key tiles of {block_k} (positions 0..{L - 1})",
           ylabel=f"query tiles of {block_q}")
    ax.legend(handles=[Patch(facecolor=TILE_COLORS[k], edgecolor="#777777",
                             label=f"{k}: {counts[k]}") for k in TILE_COLORS],
              loc="upper left", bbox_to_anchor=(1.02, 1), fontsize=8, frameon=False)
    ax.set_title(f"causal attention, {T} queries x {L} keys", fontsize=9)
    return ax.figure


def walk_caption(steps: list[WalkStep], index: int, head: int = 0) -> str:
    """What tile `index` of a walk did, in words: where its keys came from, and whether it
    raised the running max (then everything summed so far was rescaled)."""
    s = steps[index]
    where = (f"block {s.block}, slots {s.slot}-{s.slot + s.n - 1} "
             f"(positions {s.position}-{s.position + s.n - 1})")
    if index == 0:
        return f"{where}: the first scores set max m = {s.max[head]:.3f}"
    before = steps[index - 1].max[head]
    if s.max[head] > before:
        factor = float(torch.exp(before - s.max[head]))
        return (f"{where}: a larger score, m {before:.3f} → {s.max[head]:.3f}; the sum and "
                f"output so far rescaled by exp(old m − new m) = {factor:.3f}")
    return f"{where}: m stays {s.max[head]:.3f}; nothing rescaled, the tile's exps added"


def draw_walk(steps: list[WalkStep], index: int, table: list[int], page: int, length: int,
              final: torch.Tensor, head: int = 0, title: str = "",
              prompt_len: int | None = None):
    """Step `index` of a walk: the block table, each slot in its token's colour (prompt, or
    generated from `prompt_len` on), the slots read so far marked with a dot and the tile read
    now outlined; the caption (with the rescale factor where the max rose) under it; the running
    max and sum (head `head`) tile by tile, and the head's output so far against the final one."""
    fig = NotebookFigure(figsize=(9.5, 6.0))
    grid = fig.add_gridspec(3, 2, height_ratios=[1.0, 1.3, 1.3], hspace=1.15, wspace=0.28)
    pages, runs, out = (fig.add_subplot(grid[0, :]), fig.add_subplot(grid[1:, 0]),
                        fig.add_subplot(grid[1:, 1]))
    s = steps[index]
    read = s.position + s.n
    prompt_len = length if prompt_len is None else prompt_len
    for b, block in enumerate(table):       # the table's pages in order, slot by slot
        for slot in range(page):
            p = b * page + slot
            state = "prompt" if p < prompt_len else "generated"
            face = COLORS[state] if p < length else "#ffffff"  # a slot past the cache: empty
            pages.add_patch(Rectangle((p, 0), 0.92, 0.8, facecolor=face, linewidth=0.6,
                                      edgecolor="#777777" if p < length else "#dddddd",
                                      gid=f"slot:{p}:{state if p < length else 'empty'}"))
            if p < read:                                        # read so far: a neutral dot
                pages.plot(p + 0.46, -0.2, "o", color=READ_MARK, markersize=3.5,
                           gid=f"read:{p}")
        pages.text(b * page + page / 2 - 0.04, 1.05, f"block {block}", ha="center", fontsize=7)
    pages.add_patch(Rectangle((s.position - 0.08, -0.08), s.n, 0.96, fill=False,
                              edgecolor="#000000", linewidth=2.0))
    pages.set(xlim=(-0.2, len(table) * page), ylim=(-0.45, 1.5), yticks=[],
              xlabel=f"positions 0..{length - 1} through the block table (page size {page})")
    pages.set_title(title or "one decode query walks its block table", fontsize=9, loc="left",
                    pad=18)
    handles = [Patch(facecolor=COLORS[k], edgecolor="#777777", label=label)
               for k, label in (("prompt", "prompt"), ("generated", "generated by the model"))
               if k == "prompt" or prompt_len < length]
    handles += [Line2D([], [], marker="o", color=READ_MARK, linestyle="", markersize=3.5,
                       label="read so far"),
                Patch(fill=False, edgecolor="#000000", linewidth=2.0, label="this tile")]
    pages.legend(handles=handles, loc="lower right", bbox_to_anchor=(1.0, 1.12), fontsize=7,
                 frameon=False, ncol=len(handles), handletextpad=0.4, columnspacing=1.0)
    pages.text(0.0, -0.8, f"tile {index + 1}: {walk_caption(steps, index, head)}",
               transform=pages.transAxes, fontsize=8, gid="caption")
    x = range(1, len(steps) + 1)
    maxes = [float(t.max[head]) for t in steps]
    sums = [float(t.sum[head]) for t in steps]
    runs.plot(x, maxes, color=RUNNING["max"], alpha=0.25)
    runs.plot(x[:index + 1], maxes[:index + 1], "o-", color=RUNNING["max"], label="running max m")
    runs.set(xlabel="tiles read", ylabel="m", xlim=(0.5, len(steps) + 0.5))
    twin = runs.twinx()
    twin.plot(x, sums, color=RUNNING["sum"], alpha=0.25)
    twin.plot(x[:index + 1], sums[:index + 1], "s-", color=RUNNING["sum"],
              label="running sum of exp(score − m)")
    twin.set_ylabel("sum")
    runs.legend(handles=runs.lines[1:] + twin.lines[1:], fontsize=7, loc="upper left")
    hs = final.size(-1)
    now = s.out[head]
    out.bar(range(hs), now.tolist(), color=RUNNING["out"], label=f"output after tile {index + 1}")
    out.plot(range(hs), final[head].tolist(), "_", color="#000000", markersize=9,
             markeredgewidth=1.6, label="after the last tile")
    gap = float((now - final[head]).abs().max())
    out.set(xlabel=f"the head's {hs} output numbers", title=f"head {head}: max |now − final| = "
            f"{gap:.3g}")
    out.title.set_fontsize(9)
    out.legend(fontsize=7, loc="lower right")
    return fig


class WalkStepper(Stepper):
    """Step through a walk (engine.flash.walk(..., steps=...)): which tile is read, the running
    max and sum, the output converging to the final one."""

    def __init__(self, steps: list[WalkStep], table: list[int], page: int, length: int,
                 head: int = 0, title: str = "", prompt_len: int | None = None):
        if not steps:
            raise ValueError("no steps: pass steps=[] to engine.flash.walk and walk first")
        self.steps, self.table, self.page, self.length = steps, table, page, length
        self.head, self.title, self.prompt_len = head, title, prompt_len
        self.final = steps[-1].out
        super().__init__(len(steps), f"<b>{title or 'a decode query walks its block table'}</b>",
                         play=True)

    def draw(self, index: int):
        return draw_walk(self.steps, index, self.table, self.page, self.length, self.final,
                         self.head, self.title, self.prompt_len)

    def info(self, index: int) -> str:
        s = self.steps[index]
        return (f"KV cache: {self.length} positions · read so far: {s.position + s.n} · "
                f"head {self.head}: m = {s.max[self.head]:.3f}, sum = {s.sum[self.head]:.3f}")

    def describe(self, index: int) -> str:
        return walk_caption(self.steps, index, self.head)
