"""A cache that forgets: attention sinks and a sliding window (StreamingLLM, Xiao et al.
2024). After every pass it keeps the first `sinks` positions and the last `window`, and
evicts the rest, so it never holds more than sinks + window positions however long the
text. (The first positions are kept because trained models park attention there: drop
them and the softmax loses its anchor.)

Positions: GPT-2 learns one embedding per absolute position and adds it to the input, so
every cached key and value already carries its position; a new token must take its true
position, the number of tokens seen so far, not its slot in the cache (`get_seq_length()`
counts tokens seen). The text is therefore still limited to block_size positions. A
rotary model instead rotates keys by position inside attention; StreamingLLM caches keys
before rotating them and numbers the positions by cache slot, which lets such a model run
past its trained length.

Within one pass, new tokens see each other and everything held: feed a long prompt one
token per pass for the window to apply to every token (`feed`).
"""
from __future__ import annotations

import copy
from contextlib import contextmanager

import torch

from .cache import Cache, check_kv, check_matches, zeros
from .validate import int_at_least


class SinkWindowCache(Cache):
    """Keys and values of the held positions, per layer (1, n_head, held, head_dim), and
    the absolute position of each held slot (`positions`)."""

    def __init__(self, n_layer: int, n_head: int, head_dim: int, sinks: int, window: int, *,
                 block_size: int, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32):
        for name, size in dict(n_layer=n_layer, n_head=n_head, head_dim=head_dim,
                               window=window, block_size=block_size).items():
            int_at_least(name, size)
        int_at_least("sinks", sinks, 0)
        empty = zeros(1, (1, n_head, 0, head_dim), device, dtype)[0]
        self.keys = [empty] * n_layer
        self.values = [empty] * n_layer
        self.sinks = sinks
        self.window = window
        self.max_len = block_size  # GPT-2 has no position embedding past its block_size
        self.n_layer = n_layer
        self.n_head = n_head
        self.head_dim = head_dim
        self.batch_size = 1
        self.device = empty.device
        self.dtype = dtype
        self.positions: list[int] = []
        self._seen = 0

    @classmethod
    def for_model(cls, model, sinks: int = 4, window: int = 64) -> SinkWindowCache:
        cfg = model.config
        return cls(cfg.n_layer, cfg.kv_heads, cfg.head_dim, sinks, window,
                   block_size=cfg.block_size, device=model.device, dtype=model.dtype)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens seen so far: where the next token's position starts (not slots held).
        """
        int_at_least("layer_idx", layer_idx, 0, below=self.n_layer)
        return self._seen

    def check_fits(self, cfg, batch_size: int, n_new: int, device, dtype) -> None:
        if self._seen + n_new > self.max_len:
            raise ValueError("no position embedding past block_size: start a new cache")
        check_matches(self, cfg, batch_size, device, dtype)

    def update(self, key: torch.Tensor, value: torch.Tensor,
               layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Append this pass's K/V and return everything held; once the last layer is
        written, evict all but the first `sinks` and the last `window` positions, in
        every layer."""
        check_kv(self, key, value, layer_idx)
        self.keys[layer_idx] = torch.cat([self.keys[layer_idx], key.detach()], dim=2)
        self.values[layer_idx] = torch.cat([self.values[layer_idx], value.detach()], dim=2)
        k, v = self.keys[layer_idx], self.values[layer_idx]
        if layer_idx == self.n_layer - 1:
            T = key.shape[2]
            self.positions += range(self._seen, self._seen + T)
            self._seen += T
            if len(self.positions) > self.sinks + self.window:
                keep = list(range(self.sinks)) + list(range(len(self.positions) - self.window,
                                                            len(self.positions)))
                index = torch.tensor(keep, device=key.device)
                self.keys = [t.index_select(2, index) for t in self.keys]
                self.values = [t.index_select(2, index) for t in self.values]
                self.positions = [self.positions[i] for i in keep]
        return k, v

    def fork(self) -> SinkWindowCache:
        """An independent copy (cheap: passes replace tensors, never write into them)."""
        twin = copy.copy(self)
        twin.keys = list(self.keys)
        twin.values = list(self.values)
        twin.positions = list(self.positions)
        return twin

    @contextmanager
    def restored_on_error(self):
        """It cannot crop: a failed block puts back the state it started from."""
        saved = None
        try:
            with self.in_use():  # as Cache.restored_on_error: saved while no one else moves it
                saved = self.fork()
                yield
        except BaseException:
            if saved is not None:
                self.__dict__.update(saved.__dict__)
            raise

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.keys + self.values)


def feed(model, ids: list[int], cache: Cache) -> torch.Tensor:
    """Feed `ids` one token per pass (so a window cache evicts between every two tokens);
    the last pass's logits, (vocab,)."""
    with torch.inference_mode():
        for token in ids:
            logits = model(torch.tensor([[token]], device=model.device), cache=cache,
                           last_only=True)
    return logits[0, -1]
