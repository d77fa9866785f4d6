"""The course's deliberate mistakes, built outside the engine. A chapter reproduces a classic
bug by wrapping the model, so the decode loop a student reads never holds a wrong branch:

    buggy = PositionsFromZero(target)          # chapter 02: positions restart at 0 every pass
    minikv.generate(buggy, prompt, 5, trace=True)
    buggy.given                                 # the positions each pass really used

    minikv.generate_batch(PaddingCounted(target), prompts, 12)   # chapter 06: padding counted

Each wrapper is the same model (its weights, config and blocks, so KVCounter still counts)
with one mistake in the positions it passes down, and records the positions it used.
"""
from __future__ import annotations

import torch

from ..engine.model import causal_attention


class WrongPositions(torch.nn.Module):
    """`model`, but every pass numbers its tokens as `wrong(idx, positions)` says, instead of
    the positions its caller gave (None: the model's own, from the cache's length)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model, self.config = model, model.config
        self.transformer = model.transformer  # the same blocks: KVCounter hooks them
        self.given: list[list] = []  # the positions each pass used, as lists

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def wrong(self, idx: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor | None:
        raise NotImplementedError

    def forward(self, idx: torch.Tensor, cache=None, positions: torch.Tensor | None = None,
                last_only: bool = False, attention=causal_attention) -> torch.Tensor:
        positions = self.wrong(idx, positions)
        past = 0 if cache is None else cache.get_seq_length()
        used = past + torch.arange(idx.shape[1]) if positions is None else positions
        self.given.append(used.tolist())
        return self.model(idx, cache=cache, positions=positions, last_only=last_only,
                          attention=attention)


class PositionsFromZero(WrongPositions):
    """The position-offset bug (seed 003): each pass numbers its tokens 0, 1, ... as if
    nothing were cached, `torch.arange(T)` where `past + torch.arange(T)` belongs."""

    def wrong(self, idx, positions):
        return torch.arange(idx.shape[1], device=idx.device)


class PaddingCounted(WrongPositions):
    """A left-padded batch's bug: the positions the batch gives (each row counted from its
    first real token) are dropped, so every row is numbered from its first pad, its padding
    counted as positions."""

    def wrong(self, idx, positions):
        return None
