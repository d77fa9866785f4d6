"""The KV cache: every layer's keys and values, preallocated, plus the formula for its size.

Method names follow Hugging Face's `cache_utils` (`update`, `get_seq_length`, `crop`) so that
students recognise them in production code.
"""
from __future__ import annotations

import torch

from .config import GPTConfig


class KVCache:
    """Keys and values for `n_layer` layers, each a (B, n_head, max_len, head_dim) buffer.

    Only the first `get_seq_length()` slots are live. `crop` (rollback) just moves the length back:
    the slots past it keep their stale values until the next `update` overwrites them.
    """

    def __init__(self, n_layer: int, batch_size: int, n_head: int, head_dim: int, max_len: int,
                 *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        for name, value in dict(n_layer=n_layer, batch_size=batch_size, n_head=n_head,
                                head_dim=head_dim, max_len=max_len).items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"KVCache {name} must be a positive int, got {value!r}")
        shape = (batch_size, n_head, max_len, head_dim)
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layer)]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layer)]
        self._lengths = [0] * n_layer  # one per layer: during a forward pass layer i fills before i+1

    @classmethod
    def for_model(cls, model: torch.nn.Module, batch_size: int = 1, max_len: int | None = None) -> "KVCache":
        """An empty cache shaped for `model`, on its device and in its dtype."""
        cfg: GPTConfig = model.config
        max_len = cfg.block_size if max_len is None else max_len
        if isinstance(max_len, int) and max_len > cfg.block_size:
            raise ValueError(f"max_len={max_len} exceeds the model's block_size={cfg.block_size}: "
                             f"positions past it have no embedding; use max_len <= {cfg.block_size}")
        p = next(model.parameters())
        return cls(cfg.n_layer, batch_size, cfg.n_head, cfg.head_dim, max_len, device=p.device, dtype=p.dtype)

    # --- shape and placement -------------------------------------------------------------------
    @property
    def n_layer(self) -> int:
        return len(self.keys)

    @property
    def batch_size(self) -> int:
        return self.keys[0].shape[0]

    @property
    def n_head(self) -> int:
        return self.keys[0].shape[1]

    @property
    def max_len(self) -> int:
        return self.keys[0].shape[2]

    @property
    def head_dim(self) -> int:
        return self.keys[0].shape[3]

    @property
    def device(self) -> torch.device:
        return self.keys[0].device

    @property
    def dtype(self) -> torch.dtype:
        return self.keys[0].dtype

    # --- the Hugging Face-style API ------------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Number of cached positions (in `layer_idx`; all layers agree between forward passes)."""
        return self._lengths[layer_idx]

    @property
    def layer_lengths(self) -> list[int]:
        return list(self._lengths)

    def check_fits(self, cfg: GPTConfig, batch_size: int, n_new: int, device: torch.device, dtype: torch.dtype) -> None:
        """Raise, before anything is written, unless a model of `cfg` can append (batch_size, n_new) tokens."""
        want = (cfg.n_layer, cfg.n_head, cfg.head_dim)
        if (self.n_layer, self.n_head, self.head_dim) != want:
            raise ValueError(f"cache has (n_layer, n_head, head_dim) = {(self.n_layer, self.n_head, self.head_dim)} "
                             f"but the model needs {want}; build it with KVCache.for_model(model)")
        if self.batch_size != batch_size:
            raise ValueError(f"cache holds batch {self.batch_size} but idx has batch {batch_size}; "
                             f"use KVCache.for_model(model, batch_size={batch_size})")
        if self.device != device or self.dtype != dtype:
            raise ValueError(f"cache is {self.dtype} on {self.device} but the model is {dtype} on {device}; "
                             f"build it with KVCache.for_model(model)")
        self._uniform_length("run a forward pass")
        self.check_room(n_new)

    def check_room(self, n_new: int) -> None:
        """Raise before anything is written if `n_new` more positions would not fit."""
        length = self.get_seq_length()
        if length + n_new > self.max_len:
            raise ValueError(f"KV cache overflow: {length} cached + {n_new} new positions > max_len={self.max_len}; "
                             f"create the cache with a larger max_len, or crop it first")

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Append (B, n_head, T, head_dim) keys and values to layer `layer_idx`; return all live ones."""
        if not 0 <= layer_idx < self.n_layer:
            raise ValueError(f"layer_idx={layer_idx} out of range for a cache of {self.n_layer} layers")
        expected = (self.batch_size, self.n_head, self.head_dim)
        for name, t in (("key", key), ("value", value)):
            if t.dim() != 4 or (t.shape[0], t.shape[1], t.shape[3]) != expected or t.shape[2] != key.shape[2]:
                raise ValueError(f"{name} has shape {tuple(t.shape)}; expected (B, n_head, T, head_dim) with "
                                 f"(B, n_head, head_dim) = {expected} and the same T for key and value")
            if t.device != self.device or t.dtype != self.dtype:
                raise ValueError(f"{name} is {t.dtype} on {t.device} but the cache is {self.dtype} on {self.device}; "
                                 f"build the cache with KVCache.for_model(model)")
        start = self._lengths[layer_idx]
        end = start + key.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache overflow in layer {layer_idx}: {start} + {key.shape[2]} > max_len={self.max_len}; "
                             f"use a larger max_len or crop first")
        with torch.no_grad():  # a cache stores numbers, not autograd history (train without one)
            self.keys[layer_idx][:, :, start:end] = key
            self.values[layer_idx][:, :, start:end] = value
        self._lengths[layer_idx] = end
        return self.keys[layer_idx][:, :, :end], self.values[layer_idx][:, :, :end]

    def crop(self, max_length: int) -> None:
        """Roll back to the first `max_length` positions (nothing is erased, only forgotten)."""
        length = self._uniform_length("crop")
        if not isinstance(max_length, int) or isinstance(max_length, bool):
            raise TypeError(f"crop takes an int length, got {type(max_length).__name__}")
        if not 0 <= max_length <= length:
            raise ValueError(f"cannot crop to {max_length}: the cache holds {length} positions; "
                             f"pass a length between 0 and {length}")
        self._lengths = [max_length] * self.n_layer

    def fork(self) -> "KVCache":
        """An independent copy of the live prefix, for branching (e.g. asking a question mid-sequence)."""
        length = self._uniform_length("fork")
        twin = KVCache(self.n_layer, self.batch_size, self.n_head, self.head_dim, self.max_len,
                       device=self.device, dtype=self.dtype)
        for src, dst in zip(self.keys + self.values, twin.keys + twin.values):
            dst[:, :, :length] = src[:, :, :length]
        twin._lengths = [length] * self.n_layer
        return twin

    def reset(self) -> None:
        self._lengths = [0] * self.n_layer

    @property
    def nbytes(self) -> int:
        """Bytes of the live keys and values: what `kv_cache_bytes` predicts."""
        per_position = 2 * self.batch_size * self.n_head * self.head_dim * self.keys[0].element_size()
        return per_position * sum(self._lengths)

    @property
    def allocated_nbytes(self) -> int:
        """Bytes reserved up front for `max_len` positions."""
        return sum(t.nbytes for t in self.keys + self.values)

    def _uniform_length(self, what: str) -> int:
        if len(set(self._lengths)) != 1:
            raise RuntimeError(f"cannot {what} while layers disagree on length {self._lengths} (mid forward pass)")
        return self._lengths[0]

    def __repr__(self) -> str:
        return (f"KVCache(n_layer={self.n_layer}, batch_size={self.batch_size}, n_head={self.n_head}, "
                f"head_dim={self.head_dim}, seq_len={self.get_seq_length()}/{self.max_len}, "
                f"dtype={self.dtype}, device={self.device})")


def kv_cache_bytes(cfg: GPTConfig, seq_len: int, batch_size: int = 1, dtype: torch.dtype = torch.float16,
                   n_kv_head: int | None = None) -> int:
    """Seed 003's formula: layers x 2 (K and V) x batch x heads x seq_len x head_dim x bytes per number.

    `n_kv_head` is for grouped-query attention, where several query heads share one K/V head.
    """
    heads = cfg.n_head if n_kv_head is None else n_kv_head
    return cfg.n_layer * 2 * batch_size * heads * seq_len * cfg.head_dim * dtype.itemsize
