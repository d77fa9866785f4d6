"""Pictures of engine state in the seed diagrams' colours: token strip, KV cache, attention weights.

Everything drawn here comes from a trace Snapshot or from tensors the model computed; nothing is
typed in.
"""
from __future__ import annotations

import io
import math

import matplotlib

(matplotlib.use("Agg")
 if matplotlib.get_backend().lower() not in ("agg", "module://matplotlib_inline.backend_inline")
 else None)
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import Patch, Rectangle  # noqa: E402

from .replay import Snapshot, caption  # noqa: E402

BLUE, PALE, YELLOW, GREEN, RED, GREY = ("#5b9bd5", "#bdd7ee", "#ffd966", "#70ad47", "#e06666",
                                        "#d9d9d9")
TOKEN_COLORS = {"prompt": BLUE, "generated": PALE, "new": GREEN, "proposed": YELLOW,
                "accepted": GREEN, "rejected": RED}
CACHE_COLORS = {"prefill": BLUE, "cached": PALE, "unverified": YELLOW, "verified": GREEN,
                "stale": GREY, "empty": "white"}
LEGEND = [("prompt / prefill", BLUE), ("cached earlier", PALE), ("unverified", YELLOW),
          ("accepted / verified", GREEN), ("rejected", RED), ("stale after rollback", GREY)]


def _box(ax, x, y, color, text="", hatch=None, bold=False, fontsize=8):
    ax.add_patch(Rectangle((x, y), 0.92, 0.8, facecolor=color,
                           edgecolor="black" if bold else "#777777",
                           linewidth=2.0 if bold else 0.6, hatch=hatch))
    if text:
        ax.text(x + 0.46, y + 0.4, text, ha="center", va="center", fontsize=fontsize, clip_on=True)


def _label(token: int, decode) -> str:
    text = decode([token]) if decode else str(token)
    text = text.replace("\n", "⏎")
    return text if len(text) <= 7 else text[:6] + "…"


def draw_step(snap: Snapshot, decode=None, bytes_per_slot: int | None = None,
              max_positions: int = 28, title: str | None = None, ax=None,
              legend: bool = True) -> plt.Figure:
    """The token strip above the KV cache (and the draft's cache, when there is one) after one
    event."""
    n = max(len(snap.tokens), len(snap.cache), len(snap.draft_cache), 1)
    first = max(0, n - max_positions)
    rows = [("tokens", None)] + [("KV cache", snap.live(snap.cache, snap.cache_len))]
    if snap.draft_cache:
        rows.append(("draft cache", snap.live(snap.draft_cache, snap.draft_cache_len)))
    if snap.event.kind == "recompute":
        rows[1] = ("no cache", ["unverified" if p in snap.computed else "empty"
                                for p in range(len(snap.tokens) - 1)])
    # a Figure outside pyplot: safe to draw from a widget callback, which pyplot's state is not
    if ax is None:
        ax = Figure(figsize=(10, 1.3 + 0.8 * len(rows))).subplots()
    for r, (name, slots) in enumerate(rows):
        y = -r * 1.15
        ax.text(first - 0.3, y + 0.4, name, ha="right", va="center", fontsize=9)
        if slots is None:
            for p in range(first, len(snap.tokens)):
                status = snap.status[p]
                _box(ax, p, y, TOKEN_COLORS[status], _label(snap.tokens[p], decode),
                     hatch="xx" if status == "rejected" else None,
                     bold=status in ("new", "proposed") and p == len(snap.tokens) - 1)
                ax.text(p + 0.46, y + 0.92, str(p), ha="center", fontsize=6, color="#555555")
            continue
        for p in range(first, len(slots)):
            _box(ax, p, y, CACHE_COLORS[slots[p]], hatch="//" if slots[p] == "stale" else None,
                 bold=p in snap.computed and r == 1)
        length = sum(s not in ("stale", "empty") for s in slots) if name == "no cache" else (
            snap.cache_len if r == 1 else snap.draft_cache_len)
        note = f"length {length}" if name != "no cache" else f"K/V recomputed: {length}"
        if bytes_per_slot and name == "KV cache":
            note += f", {length * bytes_per_slot:,} B"
        ax.text(max(len(slots), first) + 0.2, y + 0.4, note, va="center", fontsize=8)
    ax.set_xlim(first - 3.2, first + max_positions + 4)
    ax.set_ylim(-1.15 * (len(rows) - 1) - 0.9, 1.4)
    ax.axis("off")
    ax.set_title(title or caption(snap, decode), fontsize=9, loc="left", wrap=True)
    if legend:
        ax.legend(handles=[Patch(facecolor=c, edgecolor="#777777", label=label)
                           for label, c in LEGEND],
                  loc="lower center", bbox_to_anchor=(0.5, 0.0), ncol=6, fontsize=7, frameon=False)
    ax.figure.tight_layout()
    return ax.figure


def draw_steps(snaps: list[Snapshot], decode=None, bytes_per_slot: int | None = None,
               max_positions: int = 28, suptitle: str = "") -> plt.Figure:
    """Several steps stacked top to bottom, one legend: a static version of a stepper."""
    heights = [2 + (1 if s.draft_cache else 0) for s in snaps]
    fig, axes = plt.subplots(len(snaps), 1, figsize=(10, 0.95 * sum(heights) + 0.6), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for i, (snap, ax) in enumerate(zip(snaps, axes[:, 0])):
        draw_step(snap, decode, bytes_per_slot, max_positions, ax=ax, legend=i == len(snaps) - 1)
    if suptitle:
        fig.suptitle(suptitle, fontsize=11, x=0.02, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / fig.get_figheight() if suptitle else 1))
    return fig


def attention_weights(model, ids: list[int], cache=None, layer: int = 0) -> torch.Tensor:
    """The softmax attention weights (n_head, T, L) of one forward pass, computed explicitly.

    With a cache holding k positions and T new tokens, rows are the T new queries and columns all
    k + T keys: the naive pass gives the full causal triangle, a cached decode step a single row.
    """
    seen = []

    def explicit_attention(q, k, v):
        T, L = q.size(-2), k.size(-2)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.size(-1))                  # (B, nh, T, L)
        allowed = torch.ones(T, L, dtype=torch.bool, device=q.device).tril(diagonal=L - T)
        weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        seen.append(weights)
        return weights @ v

    with torch.inference_mode():
        model(torch.tensor([ids], device=model.device), cache=cache, attention=explicit_attention)
    return seen[layer][0].float().cpu()


def draw_attention(weights: torch.Tensor, labels: list[str] | None = None, title: str = "",
                   ax=None) -> plt.Figure:
    """Heat map of (T, L) attention weights, one head averaged or chosen by the caller; masked
    cells blank."""
    T, L = weights.shape
    if ax is None:
        _, ax = plt.subplots(figsize=(0.5 + 0.35 * L, 0.7 + 0.35 * T))
    shown = weights.masked_fill(weights == 0, float("nan"))
    ax.imshow(shown.numpy(), cmap="Blues", vmin=0, vmax=float(weights.max()), aspect="equal")
    ax.set_xticks(range(L), labels if labels else range(L), rotation=90, fontsize=7)
    ax.set_yticks(range(T), (labels[L - T:] if labels else range(L - T, L)), fontsize=7)
    ax.set_xlabel("keys (cached + new)")
    ax.set_ylabel("queries (new)")
    ax.set_title(title, fontsize=9)
    ax.figure.tight_layout()
    return ax.figure


def png(fig: plt.Figure, dpi: int = 90) -> bytes:
    """The figure as PNG bytes (and closed, so notebooks don't also show it)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi, metadata={"Software": None})
    plt.close(fig)
    return buffer.getvalue()
