"""The KV cache: every layer's keys and values, preallocated, and the formula for its size. The
method names are Hugging Face's (`cache_utils`: update, get_seq_length, crop), met again later."""
from __future__ import annotations

from contextlib import contextmanager

import torch

from . import validate
from .config import GPTConfig


class Cache:
    """What the model asks of any cache kind: `get_seq_length()` (where positions start),
    `check_fits(...)` (raise before writing) and `update(k, v, layer_idx)` (store, return all)."""


class KVCache(Cache):
    """Keys and values for `n_layer` layers, each a (B, n_head, max_len, head_dim) buffer (n_head:
    the model's K/V heads, fewer than its query heads under grouped-query attention), of
    which the first `get_seq_length()` slots are live. `crop` (rollback) only moves the length
    back: later slots keep stale values until overwritten. The length moves on once the last
    layer is written, so a pass that fails halfway (an error, Ctrl-C) leaves the cache as it was.
    """

    def __init__(self, n_layer: int, batch_size: int, n_head: int, head_dim: int, max_len: int,
                 *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        for name, value in dict(n_layer=n_layer, batch_size=batch_size, n_head=n_head,
                                head_dim=head_dim, max_len=max_len).items():
            validate.int_at_least(f"KVCache {name}", value)
        shape = (batch_size, n_head, max_len, head_dim)
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layer)]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layer)]
        self._length = 0

    @classmethod
    def for_model(cls, model: torch.nn.Module, batch_size: int = 1,
                  max_len: int | None = None) -> KVCache:
        """An empty cache shaped for `model`, on its device and in its dtype."""
        cfg: GPTConfig = model.config
        max_len = cfg.block_size if max_len is None else max_len
        validate.max_len_for(cfg, max_len)
        return cls(cfg.n_layer, batch_size, cfg.kv_heads, cfg.head_dim, max_len,
                   device=model.device, dtype=model.dtype)

    # --- shape and placement ------------------------------------------------------------------
    n_layer = property(lambda self: len(self.keys))
    batch_size = property(lambda self: self.keys[0].shape[0])
    n_head = property(lambda self: self.keys[0].shape[1])
    max_len = property(lambda self: self.keys[0].shape[2])
    head_dim = property(lambda self: self.keys[0].shape[3])
    device = property(lambda self: self.keys[0].device)
    dtype = property(lambda self: self.keys[0].dtype)

    @property
    def layer_lengths(self) -> list[int]:
        return [self._length] * self.n_layer

    # --- the Hugging Face-style API -----------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Number of cached positions (every layer holds the same number)."""
        return self._length

    def check_fits(self, cfg: GPTConfig, batch_size: int, n_new: int, device, dtype) -> None:
        validate.cache_fits(self, cfg, batch_size, n_new, device, dtype)

    def update(self, key: torch.Tensor, value: torch.Tensor,
               layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Append (B, n_head, T, head_dim) keys and values to layer `layer_idx`; return all the
        live ones, (B, n_head, past + T, head_dim)."""
        validate.cache_update(self, key, value, layer_idx)
        start, end = self._length, self._length + key.shape[2]
        with torch.no_grad():  # a cache stores numbers, not autograd history (train without one)
            self.keys[layer_idx][:, :, start:end] = key
            self.values[layer_idx][:, :, start:end] = value
        if layer_idx == self.n_layer - 1:  # the whole pass is written: it becomes live
            self._length = end
        return self.keys[layer_idx][:, :, :end], self.values[layer_idx][:, :, :end]

    def crop(self, max_length: int) -> None:
        """Roll back to the first `max_length` positions (nothing is erased, only forgotten)."""
        validate.crop(self, max_length)
        self._length = max_length

    def fork(self) -> KVCache:
        """An independent copy of the live prefix, for branching (e.g. asking a question
        mid-sequence). It copies every layer's keys and values."""
        length = self._length
        twin = KVCache(self.n_layer, self.batch_size, self.n_head, self.head_dim, self.max_len,
                       device=self.device, dtype=self.dtype)
        for src, dst in zip(self.keys + self.values, twin.keys + twin.values):
            dst[:, :, :length] = src[:, :, :length]
        twin._length = length
        return twin

    @contextmanager
    def restored_on_error(self):
        """Crop back to the current length if the block raises or is interrupted."""
        start = self._length
        try:
            yield
        except BaseException:
            self._length = min(start, self._length)
            raise

    def reset(self) -> None:
        self._length = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the live keys and values: what `kv_cache_bytes` predicts."""
        per_position = 2 * self.batch_size * self.n_head * self.head_dim * self.dtype.itemsize
        return per_position * self._length * self.n_layer

    @property
    def allocated_nbytes(self) -> int:
        """Bytes reserved up front for `max_len` positions."""
        return sum(t.nbytes for t in self.keys + self.values)

    def __repr__(self) -> str:
        return (f"KVCache({self.n_layer} layers of {tuple(self.keys[0].shape)}, "
                f"seq_len={self._length}/{self.max_len}, {self.dtype}, {self.device})")


def kv_cache_bytes(cfg: GPTConfig, seq_len: int, batch_size: int = 1,
                   dtype: torch.dtype = torch.float16, n_kv_head: int | None = None) -> int:
    """Seed 003's formula: layers x 2 (K and V) x batch x heads x seq_len x head_dim x bytes,
    heads being the K/V heads (cfg.kv_heads, or `n_kv_head` to ask "what if": grouped-query
    attention shares one K/V head among several query heads)."""
    heads = cfg.kv_heads if n_kv_head is None else n_kv_head
    return cfg.n_layer * 2 * batch_size * heads * seq_len * cfg.head_dim * dtype.itemsize
