"""ipywidgets steppers over engine traces: Prev / Next / Play / slider, a caption, and the drawn
step.

All state lives in widget attributes (slider.value, caption.value, image.value), so tests can
drive a stepper without a browser; saved notebooks also carry a PNG of the current step for
viewers with no kernel.
"""
from __future__ import annotations

import base64
import re

import ipywidgets as widgets
import torch

from ..engine.records import TraceEvent
from .draw import draw_step, draw_steps, png, states_shown
from .replay import caption, replay


def device_line(device: torch.device) -> str:
    """Where the engine runs, and on CUDA how much memory it holds now."""
    if device.type == "cuda":
        return (f"device: {torch.cuda.get_device_name(device)} ({device}), "
                f"{torch.cuda.memory_allocated(device) / 2**20:.1f} MiB allocated")
    return f"device: {device}"


class Stepper(widgets.VBox):
    """Prev / Next (and Play) and a slider over a list of steps, a caption, the drawn step's numbers
    as text, and its picture. A subclass says what step i draws (`draw(i)`, a Figure), the numbers
    that picture shows (`info(i)`) and what happened (`describe(i)`)."""

    def __init__(self, n_steps: int, header: str, play: bool = False):
        self._pngs: dict[int, bytes] = {}
        # The slider counts steps from 1, as the caption does ("step 3/12"); `index` is 0-based.
        self.slider = widgets.IntSlider(value=1, min=1, max=n_steps, description="step",
                                        continuous_update=False)
        self.prev_button = widgets.Button(description="◀ Prev", layout=widgets.Layout(width="90px"))
        self.next_button = widgets.Button(description="Next ▶", layout=widgets.Layout(width="90px"))
        self.prev_button.on_click(lambda _: self.go(self.index - 1))
        self.next_button.on_click(lambda _: self.go(self.index + 1))
        controls = [self.prev_button, self.next_button]
        if play:
            self.play = widgets.Play(value=1, min=1, max=n_steps, interval=900, description="Play")
            widgets.jslink((self.play, "value"), (self.slider, "value"))
            controls.append(self.play)
        self.caption = widgets.HTML()
        # the drawn numbers as text: what a reader (or a browser test) can check
        self.cache_info = widgets.HTML()
        self.image = widgets.Image(format="png")
        for widget, name in ((self.prev_button, "prev"), (self.next_button, "next"),
                             (self.caption, "caption"), (self.cache_info, "cache"),
                             (self.image, "image")):
            widget.add_class(f"minikv-{name}")  # stable hooks for styling and for the browser test
        super().__init__([widgets.HTML(header), widgets.HBox([*controls, self.slider]),
                          self.caption, self.cache_info, self.image])
        self.slider.observe(lambda change: self._render(), names="value")
        self._render()

    @property
    def n_steps(self) -> int:
        return self.slider.max

    @property
    def index(self) -> int:
        """The step shown, counted from 0 (the slider shows it counted from 1)."""
        return self.slider.value - 1

    def go(self, index: int) -> None:
        """Show step `index` (from 0), clamped to the steps there are."""
        self.slider.value = min(max(index, 0), self.n_steps - 1) + 1

    def picture(self, index: int) -> bytes:
        if index not in self._pngs:
            self._pngs[index] = png(self.draw(index))
        return self._pngs[index]

    def _render(self) -> None:
        i = self.index
        self.cache_info.value = self.info(i)
        self.image.value = self.picture(i)
        self.prev_button.disabled, self.next_button.disabled = i == 0, i == self.n_steps - 1
        # The caption goes last: once it names this step, the rest of the step has been sent.
        self.caption.value = f"<code>step {i + 1}/{self.n_steps}</code> {self.describe(i)}"

    def _repr_mimebundle_(self, **kwargs):
        bundle = super()._repr_mimebundle_(**kwargs)
        # for viewers without a kernel
        bundle["image/png"] = base64.b64encode(self.picture(self.index)).decode()
        bundle["text/plain"] = f"{type(self).__name__}: {self.n_steps} steps"
        return bundle


class TraceStepper(Stepper):
    """Step through a trace: each step shows what the event did to the tokens and the KV cache."""

    def __init__(self, trace: list[TraceEvent], decode=None, title: str = "",
                 bytes_per_slot: int | None = None, device: torch.device | None = None,
                 notes: list[str] | None = None):
        """`notes`, one per event, go before each step's caption: where the event ran when the
        trace alone cannot say (chapter 03's "fork after person 1: ")."""
        if not trace:
            raise ValueError("empty trace: generate with trace=True to record one")
        if notes is not None and len(notes) != len(trace):
            raise ValueError(f"notes: one per event of the trace ({len(trace)}), got {len(notes)}")
        self.notes = list(notes) if notes is not None else [""] * len(trace)
        self.snapshots = replay(trace)
        self.decode, self.bytes_per_slot = decode, bytes_per_slot
        info = device_line(device) if device is not None else ""
        super().__init__(len(self.snapshots),
                         f"<b>{title}</b> <span style='color:#666'>{info}</span>", play=True)

    @property
    def snapshot(self):
        return self.snapshots[self.index]

    def draw(self, index: int):
        return draw_step(self.snapshots[index], self.decode, self.bytes_per_slot,
                         title=self.describe(index),
                         legend=states_shown(self.snapshots))  # one legend for every step

    def info(self, index: int) -> str:
        snap = self.snapshots[index]
        return f"KV cache: {snap.cache_len} positions" + (
            f" · draft cache: {snap.draft_cache_len} positions" if snap.has_draft else "")

    def describe(self, index: int) -> str:
        return self.notes[index] + caption(self.snapshots[index], self.decode)


class CompareStepper(widgets.VBox):
    """Naive and cached decoding side by side on one slider, with the K/V work each has done so
    far."""

    def __init__(self, naive: list[TraceEvent], cached: list[TraceEvent], decode=None,
                 device: torch.device | None = None):
        if len(naive) != len(cached):
            raise ValueError(f"traces differ in length ({len(naive)} vs {len(cached)}): "
                             "generate the same tokens")
        self.naive = TraceStepper(naive, decode, "naive: recompute everything", device=device)
        self.cached = TraceStepper(cached, decode, "cached: prefill, then one token per step",
                                   device=device)
        self.slider = self.naive.slider
        widgets.jslink((self.naive.slider, "value"), (self.cached.slider, "value"))
        self.slider.observe(lambda change: self.cached.go(change["new"] - 1), names="value")
        self.work = widgets.HTML()
        self.slider.observe(lambda change: self._count(), names="value")
        for child in self.cached.children[1:2]:
            child.layout.display = "none"  # one set of controls drives both
        super().__init__([self.naive, self.cached, self.work])
        self._count()

    def _count(self) -> None:
        step = self.naive.index
        naive = sum(sn.event.kv_computed for sn in self.naive.snapshots[: step + 1])
        cached = sum(sn.event.kv_computed for sn in self.cached.snapshots[: step + 1])
        self.work.value = (f"K/V vectors computed per layer so far: naive <b>{naive}</b>, "
                           f"cached <b>{cached}</b>")

    def picture(self) -> bytes:
        """Both decoders at the current step, one above the other: the static view."""
        i = self.naive.index
        fig = draw_steps([self.naive.snapshots[i], self.cached.snapshots[i]],
                         self.naive.decode, suptitle=f"step {i + 1}/{len(self.naive.snapshots)}: "
                         f"naive (top) and cached (bottom); "
                         f"{re.sub('<[^>]+>', '', self.work.value)}")
        return png(fig)

    def _repr_mimebundle_(self, **kwargs):
        bundle = super()._repr_mimebundle_(**kwargs)
        bundle["image/png"] = base64.b64encode(self.picture()).decode()  # for static viewers
        bundle["text/plain"] = f"CompareStepper: {len(self.naive.snapshots)} steps"
        return bundle
