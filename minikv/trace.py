"""What the engine records about its own work: trace events for the widgets, counters for stats."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class TraceEvent:
    """One forward pass (or cache operation) of a decoder, as the widgets and figures draw it."""
    step: int
    kind: str                    # "recompute" (naive), "prefill", "decode", ...
    input_ids: tuple[int, ...]   # token ids fed to the model in this pass
    positions: tuple[int, ...]   # position ids they were given
    cache_len_before: int        # cached positions before the pass (0 without a cache)
    cache_len_after: int
    kv_computed: int             # K/V vectors computed per layer in this pass, as counted by KVCounter
    token: int | None = None     # token chosen from this pass's last logits
    detail: dict = field(default_factory=dict)


@dataclass
class Stats:
    prompt_len: int = 0
    new_tokens: int = 0
    forward_passes: int = 0
    positions_processed: int = 0  # token positions pushed through the model, summed over passes
    kv_computed: int = 0          # K/V vectors computed per layer (every layer computes the same number)

    @property
    def kv_per_new_token(self) -> float:
        return self.kv_computed / max(self.new_tokens, 1)


class KVCounter:
    """Counts K/V vectors the model actually computes, per layer, with hooks on each Q/K/V projection.

    Every row out of a layer's `c_attn` is one position's new query, key and value, so the rows
    counted are exactly the K/V work done, with or without a cache.
    """

    def __init__(self, model: torch.nn.Module):
        self._blocks = list(model.transformer.h)
        self.per_layer = [0] * len(self._blocks)
        self._handles: list = []

    def _hook(self, layer_idx: int):
        def count(module, inputs, output):
            self.per_layer[layer_idx] += output.shape[0] * output.shape[1]  # B * T rows
        return count

    def __enter__(self) -> "KVCounter":
        self._handles = [b.attn.c_attn.register_forward_hook(self._hook(i)) for i, b in enumerate(self._blocks)]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()

    @property
    def count(self) -> int:
        """K/V vectors computed per layer so far (layer 0's count; all layers do the same work)."""
        return self.per_layer[0]
