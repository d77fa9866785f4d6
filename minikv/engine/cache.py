"""The KV cache: every layer's keys and values, preallocated, and the formula for its
size. The method names are Hugging Face's (`cache_utils`: update, get_seq_length, crop),
met again later."""
from __future__ import annotations

import copy
import threading
from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .config import GPTConfig
from .validate import int_at_least


class Cache(ABC):
    """What the model and the decoders ask of any cache kind (the contract tiny-llm's
    `TinyKvCache` states the same way). A new kind subclasses this and writes the two
    abstract methods; the rest have safe defaults it may override.

    - `get_seq_length()`: positions seen so far, where the next pass's positions start.
    - `update(k, v, layer_idx)`: store this pass's (B, nkv, T, hs) keys and values for
      one layer and return what attention reads. The model calls it once per layer, in
      order; a cache should make the pass's positions live only after the last layer, so
      a pass that fails halfway leaves it as it was.
    - `check_fits(cfg, batch_size, n_new, device, dtype)`: raise before anything is
      written if the pass cannot go in; the model calls it once per pass, so `update` need
      not check what a pass gives it (`checked`, until the pass ends). Default: anything
      fits.
    - `crop(n)`: roll back to the first n positions (speculative decoding and
      verification need it). Default: refuse (a ValueError).
    - `compact(slots, start)`: keep the positions in `slots` as start, start + 1, ... (a
      token tree's accepted path). Default: refuse.
    - `restored_on_error()`: a context that crops back to where it started if the block
      raises (or is interrupted), so a retry never feeds a token twice; it holds
      `in_use()` meanwhile.
    - `in_use()`: held by the thread using the cache, another thread refused (not a
      default to override: every pass and `restored_on_error` take it).
    - `max_len`: the most positions it holds (None: no limit of its own).
    """
    max_len: int | None = None
    checked = False  # check_fits passed for the pass under way: its updates are known good

    @abstractmethod
    def get_seq_length(self, layer_idx: int = 0) -> int: ...

    @abstractmethod
    def update(self, key: torch.Tensor, value: torch.Tensor,
               layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def check_fits(self, cfg: GPTConfig, batch_size: int, n_new: int, device, dtype) -> None:
        pass

    def crop(self, max_length: int) -> None:
        raise ValueError(f"a {type(self).__name__} cannot roll back: verify with a KVCache")

    def compact(self, slots: list[int], start: int) -> None:
        raise ValueError(f"a {type(self).__name__} cannot keep a tree's path: verify with a "
                         f"KVCache")

    @contextmanager
    def in_use(self):
        """Held by the thread whose pass or decoder is using the cache (its own passes
        re-enter). A second thread would interleave its positions with the first's, so it
        is refused at once, not made to wait; threads that take turns may share it."""
        lock = self.__dict__.setdefault("_in_use", threading.RLock())  # setdefault: atomic
        if not lock.acquire(blocking=False):
            raise RuntimeError("this cache is in use by another thread: give each thread its "
                               "own cache (cache.fork())")
        try:
            yield
        finally:
            self.checked = False  # the pass is over: a call of one's own is checked again
            lock.release()

    def __getstate__(self) -> dict:
        """What a copy takes (fork, copy, pickle): everything but the in-use lock."""
        return {k: v for k, v in self.__dict__.items() if k != "_in_use"}

    @contextmanager
    def restored_on_error(self):
        start = None
        try:
            with self.in_use():  # taken first: no other thread moves `start` meanwhile
                start = self.get_seq_length()
                yield
        except BaseException:  # the release too: a Ctrl-C there must not keep the block's work
            if start is not None and self.get_seq_length() > start:
                self.crop(start)
            raise


class KVCache(Cache):
    """Keys and values for `n_layer` layers, each a (B, n_head, max_len, head_dim) buffer
    (n_head: the model's K/V heads, fewer than its query heads under grouped-query
    attention), of which the first `get_seq_length()` slots are live. `crop` (rollback)
    only moves the length back: later slots keep stale values until overwritten. The
    length moves on once the last layer is written, so a pass that fails halfway
    (an error, Ctrl-C) leaves the cache as it was.
    """

    def __init__(self, n_layer: int, batch_size: int, n_head: int, head_dim: int, max_len: int,
                 *, value_dim: int | None = None, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32):
        sizes = dict(n_layer=n_layer, batch_size=batch_size, n_head=n_head, head_dim=head_dim,
                     max_len=max_len)
        for name, value in sizes.items():
            int_at_least(f"KVCache {name}", value)
        self.head_dim = head_dim
        # the values' width: head_dim, or 0 for MLA's latent (V is read from the key slot)
        self.value_dim = head_dim if value_dim is None else int_at_least("value_dim", value_dim, 0)
        self.dtype = dtype
        self._length = 0
        self._allocate(n_layer, batch_size, n_head, max_len, device)

    def _allocate(self, n_layer: int, batch_size: int, n_head: int, max_len: int,
                  device) -> None:
        shape = (batch_size, n_head, max_len)
        self.keys = zeros(n_layer, (*shape, self.head_dim), device, self.dtype)
        self.values = zeros(n_layer, (*shape, self.value_dim), device, self.dtype)

    # --- sizes, read off the buffers: what the slots can really hold -------------------
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
    def device(self) -> torch.device:
        return self.keys[0].device

    @classmethod
    def for_model(cls, model: torch.nn.Module, batch_size: int = 1, max_len: int | None = None,
                  **kwargs) -> KVCache:
        """An empty cache shaped for `model` (GPTConfig.kv_shape), on its device and in its
        dtype."""
        cfg: GPTConfig = model.config
        max_len = cfg.block_size if max_len is None else max_len
        int_at_least("max_len", max_len, 1, " (no position embeddings past block_size)",
                     cfg.block_size + 1)
        heads, key_dim, value_dim = cfg.kv_shape
        return cls(cfg.kv_layers, batch_size, heads, key_dim, max_len, value_dim=value_dim,
                   device=model.device, dtype=model.dtype, **kwargs)

    @property
    def layer_lengths(self) -> list[int]:
        return [self._length] * self.n_layer

    # --- the Hugging Face-style API ----------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Number of cached positions (every layer holds the same number)."""
        int_at_least("layer_idx", layer_idx, 0, below=self.n_layer)
        return self._length

    def update(self, key: torch.Tensor, value: torch.Tensor,
               layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Append (B, n_head, T, head_dim) keys and values to layer `layer_idx`; return
        all the live ones, (B, n_head, past + T, head_dim)."""
        if not self.checked:  # a call of one's own; a model's pass was checked once, up front
            check_kv(self, key, value, layer_idx)
            self._check_room(key.shape[2])
        start = self._length
        end = start + key.shape[2]
        with torch.no_grad():  # a cache stores numbers, not autograd history (train without one)
            self.keys[layer_idx][:, :, start:end] = key
            self.values[layer_idx][:, :, start:end] = value
        if layer_idx == self.n_layer - 1:  # the whole pass is written: it becomes live
            self._length = end
        return self.keys[layer_idx][:, :, :end], self.values[layer_idx][:, :, :end]

    def crop(self, max_length: int) -> None:
        """Roll back to the first `max_length` positions (nothing is erased, only
        forgotten)."""
        int_at_least("crop length", max_length, 0, " (the positions kept)", self._length + 1)
        self._length = max_length

    def compact(self, slots: list[int], start: int) -> None:
        """Keep the positions held in `slots` (increasing, from `start` on) as positions
        start, start + 1, ... and forget everything after them. A token tree's verify pass
        wrote every branch side by side; the accepted path is moved into place behind the
        committed positions and the other branches dropped."""
        int_at_least("compact start", start, 0, " (the first position moved into)",
                     self._length + 1)
        if not (all(type(s) is int for s in slots) and list(slots) == sorted(set(slots))
                and all(start <= s < self._length for s in slots)):
            raise ValueError(f"slots must be increasing ints in [{start}, {self._length}), "
                             f"got {slots!r:.60}")
        if slots != list(range(start, start + len(slots))):  # a chain's path is in place
            index = torch.tensor(slots, device=self.device)
            with torch.no_grad():
                for t in self._buffers():  # the gather copies first, so overlaps are safe
                    t[:, :, start:start + len(slots)] = t[:, :, index]
        self._length = start + len(slots)

    def fork(self) -> KVCache:
        """An independent copy of the live prefix, for branching (e.g. asking a question
        mid-sequence). It copies every layer's keys and values."""
        twin = copy.copy(self)  # the same settings; new buffers below
        twin._allocate(self.n_layer, self.batch_size, self.n_head, self.max_len, self.device)
        for src, dst in zip(self._buffers(), twin._buffers()):
            dst[:, :, :self._length] = src[:, :, :self._length]
        return twin

    def _buffers(self) -> list[torch.Tensor]:
        return self.keys + self.values

    def reset(self) -> None:
        self._length = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the live keys and values: what `kv_cache_bytes` predicts."""
        return sum(t[:, :, :self._length].nbytes for t in self._buffers())

    @property
    def allocated_nbytes(self) -> int:
        """Bytes reserved up front for `max_len` positions."""
        return sum(t.nbytes for t in self._buffers())

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.n_layer} layers of {tuple(self.keys[0].shape)}, "
                f"seq_len={self._length}/{self.max_len}, {self.dtype}, {self.device})")

    # --- checks: raise before anything is written --------------------------------------
    def check_fits(self, cfg: GPTConfig, batch_size: int, n_new: int, device, dtype) -> None:
        check_matches(self, cfg, batch_size, device, dtype)
        self._check_room(n_new)
        self.checked = True

    def _check_room(self, n_new: int) -> None:
        if self._length + n_new > self.max_len:
            raise ValueError(f"KV cache overflow ({self._length} + {n_new}): use a larger max_len")


# --- checks shared by the cache kinds that hold (B, n_head, positions, head_dim) per layer ---
def upload(data, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Python data as a tensor on `device`, its copy queued behind the kernels already
    launched rather than waited for, as torch.tensor(data, device=...) waits (from pinned
    host memory on a GPU, as nano-vllm's runner uploads; bench/syncs.py counts waits)."""
    host = torch.tensor(data, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


def zeros(count: int, shape: tuple, device, dtype: torch.dtype) -> list[torch.Tensor]:
    """`count` zeroed buffers of `shape`. An unknown or absent device, or a size this machine
    cannot hold, is a clear error before any buffer is kept (torch's would not say what to do)."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype (e.g. torch.float32), not {dtype!r:.30}")
    try:
        return [torch.zeros(shape, device=device, dtype=dtype) for _ in range(count)]
    except (RuntimeError, AssertionError, NotImplementedError) as e:
        what = f"{count} x {tuple(shape)} {dtype} buffers on device {device!r}"
        if "allocate" in str(e) or "overflow" in str(e):  # more than this machine holds
            raise MemoryError(f"no memory for {what}: lower batch_size, max_len or "
                              f"num_blocks") from e
        raise ValueError(f"cannot make {what} ({str(e).splitlines()[0]:.60}): pick a device "
                         f"with minikv.resolve_device()") from e


def check_cache(cache) -> None:
    if not isinstance(cache, (Cache, type(None))):
        raise TypeError(f"cache must be a minikv.KVCache (or a Cache) or None, not {type(cache)}")


def check_matches(cache: Cache, cfg: GPTConfig, batch_size: int, device, dtype) -> None:
    """Raise unless `cache` is shaped for a model of `cfg` on (device, dtype) and this
    batch."""
    have = (cache.n_layer, cache.n_head, cache.head_dim, cache.value_dim, cache.batch_size,
            cache.device, cache.dtype)
    want = (cfg.kv_layers, *cfg.kv_shape, batch_size, device, dtype)
    if have != want:
        raise ValueError(f"cache has (n_layer, n_head, head_dim, value_dim, batch, device, "
                         f"dtype) {have}, not {want}: use KVCache.for_model(model, batch_size="
                         f"{batch_size})")


def check_kv(cache: Cache, key: torch.Tensor, value: torch.Tensor, layer_idx: int) -> None:
    """Raise unless `key` and `value` are one pass's (B, n_head, T, head_dim) K/V (values
    (..., value_dim))."""
    int_at_least("layer_idx", layer_idx, 0, below=cache.n_layer)
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (key, value)):
        raise TypeError("key and value must be (B, n_head, T, head_dim) tensors")
    want = [((cache.batch_size, cache.n_head, key.shape[2], width), cache.dtype, cache.device)
            for width in (cache.head_dim, cache.value_dim)]
    if [(tuple(t.shape), t.dtype, t.device) for t in (key, value)] != want:
        raise ValueError(f"key and value must be {want}: (B, n_head, T, width), dtype, device")


def kv_cache_bytes(cfg: GPTConfig, seq_len: int, batch_size: int = 1,
                   dtype: torch.dtype = torch.float16, n_kv_head: int | None = None) -> int:
    """The KV cache's size: cache layers x batch x heads x seq_len x (key width + value
    width) x bytes. For GPT-2: n_layer x 2 (K and V) x batch x heads x seq_len x head_dim
    x bytes, heads being the K/V heads (cfg.kv_heads, or `n_kv_head` to ask "what if":
    grouped-query attention shares one K/V head among several query heads). Cross-layer
    attention divides the layers (cfg.kv_layers); MLA caches one latent of kv_lora_rank +
    qk_rope_head_dim per position and layer (cfg.kv_shape)."""
    if not isinstance(cfg, GPTConfig) or not isinstance(dtype, torch.dtype):
        raise TypeError("kv_cache_bytes takes a GPTConfig (model.config) and a torch.dtype")
    int_at_least("seq_len", seq_len, 0, " (positions cached)")
    int_at_least("batch_size", batch_size)
    heads, key_dim, value_dim = cfg.kv_shape
    if n_kv_head is not None:
        if cfg.kv_lora_rank is not None:
            raise ValueError("an MLA model caches one latent, not K/V heads: leave n_kv_head out")
        heads = int_at_least("n_kv_head", n_kv_head)
    return (cfg.kv_layers * batch_size * heads * seq_len * (key_dim + value_dim)
            * dtype.itemsize)


@dataclass(frozen=True)
class MemoryPlan:
    """How a device's memory is spent: a fraction of what is free (vLLM's
    gpu_memory_utilization), less the weights and a reserve for one pass's activations,
    is the KV pool; and how many requests of `request_len` positions it holds at once."""
    budget: int          # utilization x free bytes
    weights: int         # the parameters' bytes
    reserve: int         # kept for a pass's activations (an estimate, not measured)
    block: int           # bytes of one pool block: every cache layer's K/V for page_size
    num_blocks: int      # blocks in the pool
    request_blocks: int  # blocks one request of request_len positions fills
    requests: int        # such requests the pool holds to their last position

    @property
    def pool(self) -> int:
        return self.num_blocks * self.block


def memory_plan(model, free_bytes: int, utilization: float = 0.9, page_size: int = 16,
                request_len: int | None = None, reserve: int | None = None,
                graphs: int = 0) -> MemoryPlan:
    """The KV pool `free_bytes` of device memory holds after the model's weights and
    `reserve` bytes (default: a whole-context pass's logits and MLP activations), of
    `utilization` of it; requests of `request_len` positions (default: block_size).
    `graphs`: the largest batch whose decode is a CUDA graph (static.GraphDecode): its pass
    gathers a layer's K/V of every row's whole table, kept beside the reserve."""
    cfg, size = model.config, model.dtype.itemsize
    int_at_least("free_bytes", free_bytes, 0)
    if not (isinstance(utilization, float) and 0 < utilization <= 1):
        raise ValueError(f"utilization must be a fraction in (0, 1], not {utilization!r}")
    int_at_least("page_size", page_size, hint=" (positions per block)")
    request_len = cfg.block_size if request_len is None else request_len
    int_at_least("request_len", request_len, hint=" (positions a request holds)")
    if reserve is None:  # logits, and the MLP's hidden units, of block_size positions
        hidden = cfg.n_inner or 4 * cfg.n_embd
        reserve = cfg.block_size * (cfg.vocab_size + 3 * hidden) * size
    int_at_least("graphs", graphs, 0, " (the largest batch replayed as a CUDA graph, or 0)")
    table = -(-cfg.block_size // page_size) * page_size  # the slots of a whole table
    reserve += graphs * kv_cache_bytes(cfg, table, dtype=model.dtype) // cfg.kv_layers
    budget = int(free_bytes * utilization)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    block = kv_cache_bytes(cfg, page_size, dtype=model.dtype)
    num_blocks = (budget - weights - reserve) // block
    if num_blocks < 1:
        raise ValueError(f"{budget:,} bytes ({utilization} of {free_bytes:,} free) hold the "
                         f"weights ({weights:,}) and the reserve ({reserve:,}) but no block "
                         f"of {block:,} bytes: free memory, or raise utilization")
    need = -(-request_len // page_size)
    return MemoryPlan(budget, weights, reserve, block, num_blocks, need, num_blocks // need)
