"""Which heads each rank of a tensor-parallel group holds (chapter 13), drawn from what the
ranks returned (their `Shard`s and configs), never typed in: a panel per model and world, a
row per rank, a box per query head and per K/V head of the whole model."""
from __future__ import annotations

from matplotlib.patches import Patch, Rectangle

from .draw import NotebookFigure

# Ink, not a token state's colour (minikv.viz.draw.COLORS) nor a chart series': a head a rank
# holds is dark; a K/V head that more than one rank holds (replicated) is mid-grey and hatched.
HELD, REPLICATED, EMPTY = "#404040", "#8c8c8c", "white"


def draw_heads(panels: dict[str, list[tuple]], title: str = "") -> NotebookFigure:
    """`panels`: label -> [(shard, config, whole_config, cache bytes per token)] by rank, as
    the ranks returned them. Each panel: the whole model's query heads, then its K/V heads (or
    its one latent, for MLA), a row per rank, filled where the rank holds the head."""
    rows = sum(len(ranks) + 2 for ranks in panels.values())
    width = max(w.n_head + 2 + (1 if w.kv_lora_rank else w.kv_heads)
                for ranks in panels.values() for _, _, w, _ in ranks)
    fig = NotebookFigure(figsize=(3.6 + 0.42 * width, 0.9 + 0.3 * rows))
    ax = fig.add_subplot()
    ax.set(xlim=(-5.6, width + 7.5), ylim=(rows + 0.2, -1.4))
    ax.axis("off")
    top = 0.0
    for label, ranks in panels.items():
        whole = ranks[0][2]
        latent = whole.kv_lora_rank is not None
        n_kv = 1 if latent else whole.kv_heads
        held = {h: sum(h in s.kv_heads or latent for s, _, _, _ in ranks) for h in range(n_kv)}
        ax.text(-5.6, top + 0.4, label, fontsize=9, fontweight="bold", va="center")
        ax.text(0, top + 0.4, "query heads", fontsize=7, va="center")
        ax.text(whole.n_head + 2, top + 0.4, "latent" if latent else "K/V heads", fontsize=7,
                va="center")
        for r, (s, cfg, _, nbytes) in enumerate(ranks):
            y = top + 1 + r
            ax.text(-0.4, y + 0.4, f"rank {s.rank}", fontsize=7, ha="right", va="center")
            for h in range(whole.n_head):
                ax.add_patch(Rectangle((h, y), 0.9, 0.8, edgecolor="#999999", linewidth=0.5,
                                       facecolor=HELD if h in s.q_heads else EMPTY,
                                       gid=f"q:{label}:{s.rank}:{h}"))
            for h in range(n_kv):
                mine = latent or h in s.kv_heads
                face = (REPLICATED if held[h] > 1 else HELD) if mine else EMPTY
                ax.add_patch(Rectangle((whole.n_head + 2 + h, y), 0.9, 0.8, edgecolor="#999999",
                                       linewidth=0.5, facecolor=face,
                                       hatch="\\\\\\" if mine and held[h] > 1 else None,
                                       gid=f"kv:{label}:{s.rank}:{h}"))
            ax.text(whole.n_head + 2.6 + n_kv, y + 0.4, f"cache {nbytes:,} B/token", fontsize=7,
                    va="center")
        top += len(ranks) + 2
    ax.legend(handles=[Patch(facecolor=HELD, label="held by this rank"),
                       Patch(facecolor=REPLICATED, hatch="\\\\\\",
                             label="K/V held by more than one rank (replicated)"),
                       Patch(facecolor=EMPTY, edgecolor="#999999", label="held by another rank")],
              loc="lower left", bbox_to_anchor=(0, 1), ncol=3, fontsize=8, frameon=False)
    if title:
        ax.set_title(title, fontsize=10, loc="left", pad=20)
    return fig
