"""Chapter 13's pictures of disaggregated serving (engine/disagg.py), drawn from a live
`DisaggregatedEngine`: a request's prompt goes to the prefill worker, which computes it into
blocks of ITS pool (the ids the transfer's header carries, `blocks_there`); its K/V comes back
in one message; `RadixTree.restore` writes it into fresh blocks of the decode worker's pool
(other ids: a block id means nothing outside its pool); the request is admitted, computes only
its last position, and decodes beside the others.

`TransferRecorder` wraps the engine's `step` (the decode pool before and after each step, the
positions the model computed in it), its `_send` (the step a prompt left in) and its `_restore`
(the pool right after a transfer's K/V is written, before the request is admitted).
`transfer_stages(recorder, index)` turns what it saw of request `index` into the stepper's six
stages; `TransferStepper` steps through them, both pools side by side. The worker's pool is
drawn from the headers it sent: the blocks its radix tree keeps are those of the prompts it
computed (the engine's `close()` reports how many).
"""
from __future__ import annotations

from dataclasses import dataclass

from matplotlib.patches import FancyArrowPatch, Patch, Rectangle

from .draw import NotebookFigure
from .pool import SHARED_HATCH, owner_color
from .radix import TREE_COLOR
from .widgets import Stepper

KINDS = ("sent", "computed", "message", "restored", "admitted", "decoding")
COLUMNS = 16  # blocks a row, in both pools


@dataclass(frozen=True)
class PoolView:
    """A pool as it was: each block's references, the running requests' tables and cached
    positions, and the blocks its radix tree holds."""
    ref: tuple[int, ...]
    tables: dict[int, tuple[int, ...]]
    lengths: dict[int, int]
    tree: frozenset[int]


@dataclass(frozen=True)
class Stage:
    """One stage of request `index`'s transfer, in engine step `step`: the decode pool
    (`here`), the blocks the worker's tree held before it (`kept_there`) and the request's
    blocks there and here (empty before they exist)."""
    kind: str
    step: int
    index: int
    prompt_len: int
    positions: int               # positions that travelled (the prompt but its last)
    nbytes: int                  # the message's bytes, keys and values
    here: PoolView
    kept_there: frozenset[int]
    prefill_blocks: int
    blocks_there: tuple[int, ...] = ()
    blocks_here: tuple[int, ...] = ()
    reused: int = 0              # of the prompt, found in the tree at admission
    computed: int = 0            # positions the model computed in this step, every request's


def pool_view(engine) -> PoolView:
    """The decode worker's pool now (a DisaggregatedEngine's Engine)."""
    sched, tree = engine.scheduler, engine.scheduler.prefix
    return PoolView(tuple(engine.pool.ref), {s.index: tuple(s.table.blocks) for s in
                                            sched.running},
                    {s.index: s.table.length for s in sched.running},
                    frozenset(b for n in tree.nodes() if not n.tiered for b in n.blocks))


class TransferRecorder:
    """What a DisaggregatedEngine did, step by step: for each step the decode pool before
    and after it and the positions its model computed; for each transfer, its header, the
    decode pool once its K/V was restored, and the blocks that hold it here."""

    def __init__(self, engine):
        self.engine, inner = engine, engine.engine
        self.steps: list[dict] = []
        self.restored: dict[int, dict] = {}  # request -> its restore
        self.order: list[int] = []  # requests in the order their K/V came back
        self.sent: dict[int, tuple[int, PoolView]] = {}  # request -> (step, pool) it left in
        self._counted = [0]

        def count(module, args, kwargs):  # a pass's positions: (rows, tokens) of ids
            ids = args[0] if args else kwargs["idx"]
            self._counted[0] += ids.numel()
        self.hook = inner.model.register_forward_pre_hook(count, with_kwargs=True)
        step, send, restore = engine.step, engine._send, engine._restore

        def recorded_step():
            before, self._counted[0] = pool_view(inner), 0
            out = step()
            self.steps.append(dict(step=inner.scheduler.now - 1, before=before,
                                   after=pool_view(inner), computed=self._counted[0]))
            return out

        def recorded_restore(index, request, n, keys, values):
            restore(index, request, n, keys, values)
            tree = inner.scheduler.prefix
            path = tree.match(inner.check(request)[0][:n])
            self.order.append(index)
            self.restored[index] = dict(
                view=pool_view(inner), header=dict(engine.transfers[index]),
                prompt_len=len(inner.check(request)[0]),
                blocks=tuple(b for node, _ in path for b in node.blocks))
        def recorded_send(index, request):
            self.sent[index] = (inner.scheduler.now, pool_view(inner))
            send(index, request)
        engine.step, engine._send, engine._restore = recorded_step, recorded_send, \
            recorded_restore

    def close(self) -> None:
        """Stop counting the model's passes (the recorder's hook on it)."""
        self.hook.remove()

    def kept_there(self, index: int) -> frozenset[int]:
        """The worker's blocks its tree held when `index`'s prompt arrived: those of the
        prompts it computed before."""
        earlier = self.order[:self.order.index(index)]
        return frozenset(b for i in earlier for b in self.restored[i]["header"]["blocks_there"])


def transfer_stages(recorder: TransferRecorder, index: int) -> list[Stage]:
    """Request `index`'s transfer as six stages (KINDS): sent, computed there, one message,
    restored here, admitted, decoding; from what `recorder` saw."""
    got = recorder.restored.get(index)
    if got is None:
        raise ValueError(f"request {index}'s K/V was never restored here (not sent, aborted, "
                         "or recomputed): record the engine before it steps")
    joined = next(k for k, s in enumerate(recorder.steps) if index in s["after"].tables)
    at, head = recorder.steps[joined], got["header"]
    after = recorder.steps[joined + 1] if joined + 1 < len(recorder.steps) else at
    outputs = recorder.engine.outputs()
    base = dict(step=at["step"], index=index, prompt_len=got["prompt_len"],
                positions=head["positions"], nbytes=head["bytes"],
                kept_there=recorder.kept_there(index),
                prefill_blocks=recorder.engine.prefill_blocks)
    there = tuple(head["blocks_there"])
    here, reused = got["blocks"], outputs[index].stats.reused if index in outputs else 0
    left_at, left = recorder.sent[index]
    return [Stage("sent", here=left, **{**base, "step": left_at}),
            Stage("computed", here=at["before"], blocks_there=there, **base),
            Stage("message", here=at["before"], blocks_there=there, **base),
            Stage("restored", here=got["view"], blocks_there=there, blocks_here=here, **base),
            Stage("admitted", here=at["after"], blocks_there=there, blocks_here=here,
                  reused=reused, computed=at["computed"], **base),
            Stage("decoding", here=after["after"], blocks_there=there, blocks_here=here,
                  reused=reused, computed=after["computed"],
                  **{**base, "step": after["step"]})]


def _span(blocks) -> str:
    return ", ".join(f"#{b}" for b in blocks)


def transfer_caption(stage: Stage) -> str:
    """What the stage shows, in words (the browser test recomputes these)."""
    r, s = stage.index, stage
    others = len([i for i in s.here.tables if i != r])
    where = f"engine step {s.step} · {KINDS.index(s.kind) + 1}/{len(KINDS)} {s.kind}: "
    if s.kind == "sent":
        what = (f"request {r}'s prompt arrives ({s.prompt_len} tokens); all but its last, "
                f"{s.positions} tokens, go to the prefill worker; {others} request(s) decode "
                f"here meanwhile")
    elif s.kind == "computed":
        what = (f"the prefill worker computes positions 0–{s.positions - 1} into "
                f"{len(s.blocks_there)} blocks of its own pool: {_span(s.blocks_there)}; its "
                f"radix tree keeps them")
    elif s.kind == "message":
        what = (f"their keys and values travel in one message: {s.positions} positions × "
                f"{s.nbytes // s.positions:,} bytes = {s.nbytes:,} bytes, with a header "
                f"naming the worker's block ids")
    elif s.kind == "restored":
        pairs = ", ".join(f"#{a}→#{b}" for a, b in zip(s.blocks_there, s.blocks_here))
        what = (f"its K/V written into {len(s.blocks_here)} fresh blocks of this pool, new "
                f"ids (there→here): {pairs}; the radix tree here holds them")
    elif s.kind == "admitted":
        what = (f"request {r} admitted: {s.reused} of its {s.prompt_len} positions found in "
                f"the tree, {s.prompt_len - s.reused} computed here (its last: its logits "
                f"choose the first token); the step computed {s.computed} positions in all, "
                f"beside {others} decode row(s)")
    else:
        what = (f"request {r} decodes beside the others: {s.computed} positions computed in "
                f"the step, one a request")
    return where + what


def transfer_info(stage: Stage) -> str:
    """The numbers the picture shows, as text (the browser test reads its first words)."""
    here = stage.here
    held = sum(1 for c in here.ref if c)
    there = len(stage.kept_there | set(stage.blocks_there))
    return (f"KV cache: {sum(here.lengths.values())} positions in {len(here.tables)} running "
            f"table(s) here · decode pool: {held} of {len(here.ref)} blocks held · prefill "
            f"worker's pool: {there} of {stage.prefill_blocks} blocks held by its tree")


def _grid(ax, x0: float, y0: float, n: int, face, label, outline=lambda b: None) -> None:
    """n blocks, COLUMNS a row, from (x0, y0) down: face(b) -> (colour, hatch), label(b)."""
    for b in range(n):
        x, y = x0 + (b % COLUMNS), y0 - (b // COLUMNS)
        colour, hatch = face(b)
        edge = outline(b)
        ax.add_patch(Rectangle((x, y), 0.92, 0.8, facecolor=colour, hatch=hatch,
                               edgecolor=edge or "#777777", linewidth=2.2 if edge else 0.5,
                               gid=f"{'there' if x0 < 0 else 'here'}:{b}"))
        text, ink = label(b)
        ax.text(x + 0.46, y + 0.4, text, ha="center", va="center", fontsize=6, color=ink)


def draw_transfer(stage: Stage, title: str | None = None):
    """The prefill worker's pool (left) and the decode worker's (right), one message between
    them; the request's blocks in its colour, other requests' in theirs, blocks only a radix
    tree holds in the tree's colour, shared blocks hatched, free ones white; below, the
    request's blocks there and the fresh ones here, in position order (the remap)."""
    s, r, here = stage, stage.index, stage.here
    k = KINDS.index(s.kind)
    rows = max(-(-len(here.ref) // COLUMNS), -(-s.prefill_blocks // COLUMNS))
    fig = NotebookFigure(figsize=(12, 2.6 + 0.42 * rows))
    ax = fig.add_axes((0.01, 0.02, 0.98, 0.8))
    left, right = -COLUMNS - 3.0, 3.0
    mine = set(s.blocks_there)

    def there_face(b):
        if b in mine:
            return owner_color(r), SHARED_HATCH if b in s.kept_there else None
        return (TREE_COLOR, None) if b in s.kept_there else ("white", None)

    def there_label(b):
        held = b in mine or b in s.kept_there
        return f"#{b}", ("white" if b in mine else "#333333") if held else "#aaaaaa"

    holders: dict[int, list[int]] = {}
    for i, blocks in here.tables.items():
        for b in blocks:
            holders.setdefault(b, []).append(i)

    def here_face(b):
        if not here.ref[b]:
            return "white", None
        who = holders.get(b, [])
        colour = owner_color(who[0]) if who else (owner_color(r) if b in s.blocks_here
                                                  else TREE_COLOR)
        return colour, SHARED_HATCH if here.ref[b] > 1 else None

    def here_label(b):
        lit = here.ref[b] and (holders.get(b) or b in s.blocks_here)
        return f"#{b}", ("white" if lit else "#333333") if here.ref[b] else "#aaaaaa"

    _grid(ax, left, 0, s.prefill_blocks, there_face, there_label)
    _grid(ax, right, 0, len(here.ref), here_face, here_label,
          lambda b: "#222222" if k >= 3 and b in s.blocks_here else None)
    ax.text(left, 1.2, "prefill worker's pool (another process)", fontsize=8,
            fontweight="bold")
    ax.text(right, 1.2, "decode worker's pool (this process)", fontsize=8, fontweight="bold")
    live = k >= 2
    ax.add_patch(FancyArrowPatch((-2.6, 0.4), (2.6, 0.4), arrowstyle="-|>", mutation_scale=14,
                                 color="#222222" if live else "#cccccc", linewidth=1.6))
    ax.text(0, 0.85, f"one message\n{s.nbytes:,} bytes" if live else "K/V not sent yet",
            ha="center", va="bottom", fontsize=7, color="#222222" if live else "#999999")
    bottom = -rows + 0.1
    if s.blocks_there:
        y = bottom - 0.9
        ax.text(left - 0.3, y + 0.4, f"request {r} there", ha="right", va="center", fontsize=7)
        for i, b in enumerate(s.blocks_there):
            ax.add_patch(Rectangle((left + i, y), 0.92, 0.8, facecolor=owner_color(r),
                                   edgecolor="#777777", linewidth=0.5))
            ax.text(left + i + 0.46, y + 0.4, f"#{b}", ha="center", va="center", fontsize=6,
                    color="white")
        table = here.tables.get(r, s.blocks_here)
        if table:
            name = "its block table here" if r in here.tables else "fresh blocks here"
            ax.text(right - 0.3, y + 0.4, name, ha="right", va="center", fontsize=7)
            for i, b in enumerate(table):
                ax.add_patch(Rectangle((right + i, y), 0.92, 0.8, facecolor=owner_color(r),
                                       edgecolor="#222222", linewidth=1.2))
                ax.text(right + i + 0.46, y + 0.4, f"#{b}", ha="center", va="center",
                        fontsize=6, color="white")
        bottom = y
    ax.set_xlim(left - 4.5, right + COLUMNS + 0.5)
    ax.set_ylim(bottom - 0.3, 2.0)
    ax.axis("off")
    ax.set_title(title if title is not None else transfer_caption(s), fontsize=8, loc="left",
                 wrap=True)
    handles = [Patch(facecolor=owner_color(r), label=f"request {r} (the one travelling)")]
    handles += [Patch(facecolor=owner_color(i), label=f"request {i}")
                for i in sorted(here.tables) if i != r]
    handles += [Patch(facecolor=TREE_COLOR, edgecolor="#777777",
                      label="held by a radix tree only"),
                Patch(facecolor="#cccccc", hatch=SHARED_HATCH, label="held twice (shared)"),
                Patch(facecolor="white", edgecolor="#777777", label="free")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(0.0, 0.0), fontsize=6.5,
              frameon=False, ncol=min(len(handles), 5))
    return fig


class TransferStepper(Stepper):
    """Step through a request's transfer (transfer_stages): both pools at each stage."""

    def __init__(self, stages: list[Stage], title: str = ""):
        if not stages:
            raise ValueError("no stages: transfer_stages(recorder, index) makes them")
        self.stages = list(stages)
        super().__init__(len(self.stages), f"<b>{title}</b>")

    def draw(self, index: int):
        return draw_transfer(self.stages[index])

    def info(self, index: int) -> str:
        return transfer_info(self.stages[index])

    def describe(self, index: int) -> str:
        return transfer_caption(self.stages[index])
