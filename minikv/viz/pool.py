"""Pictures and a stepper of the server's block pool (minikv.serve(..., trace=True).pool_steps):
which request holds each block, which blocks are shared or free, and each request's block table,
engine step by engine step."""
from __future__ import annotations

from collections import Counter

from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from ..engine.records import PoolStep
from .draw import NotebookFigure
from .widgets import Stepper

# One hue per request, none of them a token-state colour (minikv.viz.draw.COLORS).
# Requests get hues used nowhere else in the course: not a token state's (COLORS), not a chart
# series' (SERIES: purple means "without cache", teal "with cache" in every chapter).
OWNER_COLORS = ("#bc6c25", "#3d405b", "#606c38", "#b5838d", "#6d597a", "#9c6644", "#4a4e69",
                "#a3a380")
SHARED_HATCH = "xx"


def owner_color(request: int) -> str:
    return OWNER_COLORS[request % len(OWNER_COLORS)]


def pool_caption(step: PoolStep) -> str:
    """What this engine step did to the pool, in words."""
    what = Counter(kind for _, kind, _, _ in step.log)
    owners = {kind: sorted({r for _, k, _, r in step.log if k == kind}) for kind in what}
    parts = []
    # A prefix-cache hit either shares a block another running request holds (two tables point
    # at it after the step) or revives one a finished request left behind (only one does).
    shares = [(b, r) for _, k, b, r in step.log if k == "share"]
    live = [(b, r) for b, r in shares if step.ref[b] > 1]
    revived = [(b, r) for b, r in shares if step.ref[b] <= 1]
    if live:
        parts.append(f"{len(live)} block(s) shared by running request(s) "
                     f"{sorted({r for _, r in live})} (prefix caching: one copy, two tables)")
    if revived:
        parts.append(f"{len(revived)} block(s) reused by request(s) "
                     f"{sorted({r for _, r in revived})} from the prefix cache (left by a "
                     f"finished request, K/V kept)")
    if what["allocate"]:
        parts.append(f"{what['allocate']} block(s) allocated to {owners['allocate']}")
    if what["copy"]:
        parts.append(f"{what['copy']} shared block(s) copied before a write (copy-on-write)")
    preempted = owners.get("preempt", [])
    leaving = sorted({r for _, k, _, r in step.log if k in ("free", "unshare")})
    for who, label in ((preempted, "preempted (to be recomputed)"),
                       ([r for r in leaving if r not in preempted], "finished")):
        if not who:
            continue
        let_go = [k for _, k, _, r in step.log if r in who and k in ("free", "unshare")]
        shared = let_go.count("unshare")
        parts.append(f"request(s) {who} {label}: {let_go.count('free')} block(s) back to the pool"
                     + (f", {shared} still held by another request" if shared else ""))
    free = sum(1 for r in step.ref if r == 0)
    return (f"engine step {step.step}: " + ("; ".join(parts) or "decode: no block changed hands")
            + f" · {free} of {len(step.ref)} blocks free")


def pool_info(step: PoolStep) -> str:
    """The numbers the picture shows, as text: positions cached over the running requests'
    tables, and the pool's blocks held (shared ones counted once) and free."""
    held = sum(1 for r in step.ref if r > 0)
    shared = sum(1 for r in step.ref if r > 1)
    return (f"KV cache: {sum(step.lengths.values())} positions in {len(step.tables)} block "
            f"table(s) · {held} of {len(step.ref)} blocks held ({shared} shared), "
            f"{len(step.ref) - held} free")


def draw_pool(step: PoolStep, columns: int = 12, ax=None) -> Figure:
    """The pool as a grid of blocks (owner colour, hatched when shared, white when free) above
    every running request's block table."""
    owners: dict[int, list[int]] = {}
    for request, blocks in step.tables.items():
        for block in blocks:
            owners.setdefault(block, []).append(request)
    n = len(step.ref)
    columns = min(columns, n)  # a small pool fills its row: no empty canvas
    grid_rows = -(-n // columns)
    rows = grid_rows + 1 + len(step.tables)
    if ax is None:
        fig = NotebookFigure(figsize=(8, 1.0 + 0.5 * rows))
        ax = fig.add_axes((0.01, 0.01, 0.98, 0.99 - 0.45 / fig.get_figheight()))
    for block in range(n):
        x, y = block % columns, -(block // columns)
        held = owners.get(block, [])
        color = owner_color(held[0]) if held else "white"
        ax.add_patch(Rectangle((x, y), 0.92, 0.8, facecolor=color, edgecolor="#777777",
                               linewidth=0.6, hatch=SHARED_HATCH if len(held) > 1 else None,
                               gid=f"block:{block}"))
        ax.text(x + 0.46, y + 0.62, f"#{block}", ha="center", va="center", fontsize=7,
                color="white" if held else "#999999")
        if held:  # who holds it: one request, or several sharing it
            ax.text(x + 0.46, y + 0.24, f"×{len(held)}" if len(held) > 1 else f"r{held[0]}",
                    ha="center", va="center", fontsize=7, color="white", fontweight="bold")
    y = -grid_rows + 0.1
    for request, blocks in sorted(step.tables.items()):
        y -= 1
        ax.text(-0.3, y + 0.4, f"request {request} · {step.lengths[request]} positions",
                ha="right", va="center", fontsize=8)
        for i, block in enumerate(blocks):
            ax.add_patch(Rectangle((i, y), 0.92, 0.8, facecolor=owner_color(request),
                                   edgecolor="#777777", linewidth=0.6,
                                   hatch=SHARED_HATCH if step.ref[block] > 1 else None))
            ax.text(i + 0.46, y + 0.4, f"#{block}", ha="center", va="center", fontsize=7,
                    color="white")
    ax.text(-0.3, 0.4, "pool", ha="right", va="center", fontsize=8)
    ax.set_xlim(-7, columns + 3.5)
    ax.set_ylim(y - 0.8, 1.2)
    ax.axis("off")
    ax.set_title(pool_caption(step), fontsize=8, loc="left", wrap=True)
    handles = [Patch(facecolor=owner_color(r), label=f"request {r}") for r in sorted(step.tables)]
    handles += [Patch(facecolor="#cccccc", hatch=SHARED_HATCH,
                      label="shared by running requests (×k)"),
                Patch(facecolor="white", edgecolor="#777777", label="free")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(0.0, 0.0), fontsize=7,
              frameon=False, ncol=len(handles))
    return ax.figure


class PoolStepper(Stepper):
    """Step through a server run's pool: the picture, the caption, and the numbers it shows."""

    def __init__(self, steps: list[PoolStep], title: str = ""):
        if not steps:
            raise ValueError("no pool steps: serve with trace=True to record them")
        self.steps = steps
        super().__init__(len(steps), f"<b>{title}</b>")

    def draw(self, index: int):
        return draw_pool(self.steps[index])

    def info(self, index: int) -> str:
        return pool_info(self.steps[index])

    def describe(self, index: int) -> str:
        return pool_caption(self.steps[index])


# --- what each engine step computed: prompt chunks and decode rows ----------------------------
PASS_KINDS = {"prefill": "prompt", "recompute": "prompt", "chunk": "prompt", "decode": "generated"}


def step_composition(outputs) -> dict[int, list[tuple[int, str, int]]]:
    """Per engine step, the rows its passes computed, as (request, "prompt" or "generated",
    tokens): a prompt (or a chunk of one, or a preempted request's recompute), or a decode
    row feeding the newest token; from a traced serve() (trace=True)."""
    if any(o.trace is None for o in outputs):
        raise ValueError("no trace: serve with trace=True to record each step's rows")
    steps: dict[int, list[tuple[int, str, int]]] = {}
    for i, o in enumerate(outputs):
        for e in o.trace:
            if e.kind in PASS_KINDS and e.kv_computed:
                steps.setdefault(e.step, []).append((i, PASS_KINDS[e.kind], e.kv_computed))
    return dict(sorted(steps.items()))


def draw_step_composition(outputs, budget: int | None = None, title: str = "", ax=None
                          ) -> Figure:
    """One bar per engine step, as tall as the tokens it computed: each request's rows stacked,
    a prompt's (or a chunk's) in the prompt colour, a decode row in the colour of the model's
    own tokens, outlined in the request's colour; the step's token budget as a dashed line."""
    from .draw import COLORS
    steps = step_composition(outputs)
    if ax is None:
        fig = NotebookFigure(figsize=(9, 3.2))
        ax = fig.add_axes((0.07, 0.2, 0.9, 0.68))
    for step, rows in steps.items():
        bottom = 0
        for request, kind, n in rows:
            ax.add_patch(Rectangle((step - 0.4, bottom), 0.8, n, facecolor=COLORS[kind],
                                   edgecolor=owner_color(request), linewidth=1.2,
                                   gid=f"step:{step}:r{request}:{kind}"))
            bottom += n
    top = max(sum(n for _, _, n in rows) for rows in steps.values())
    if budget is not None:
        ax.axhline(budget, color="#444444", linestyle="--", linewidth=1)
        ax.text(max(steps) + 0.6, budget, f"budget {budget}", va="bottom", ha="right",
                fontsize=8)
        top = max(top, budget)
    ax.set_xlim(min(steps) - 0.8, max(steps) + 0.8)
    ax.set_ylim(0, top * 1.08)
    ax.set_xlabel("engine step")
    ax.set_ylabel("tokens computed")
    ax.set_title(title, fontsize=9, loc="left")
    handles = [Patch(facecolor=COLORS["prompt"], label="prompt rows (a whole prompt or a chunk)"),
               Patch(facecolor=COLORS["generated"], edgecolor="#777777",
                     label="decode rows (one token each)")]
    ax.legend(handles=handles, loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize=7,
              frameon=False, ncol=2)
    return ax.figure
