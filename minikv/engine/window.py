"""A cache that forgets: attention sinks and a sliding window (StreamingLLM, Xiao et al.
2024). After every pass it keeps the first `sinks` positions and the last `window`, and
evicts the rest, so it never holds more than sinks + window positions however long the
text. (The first positions are kept because trained models park attention there: drop
them and the softmax loses its anchor.)

Positions: GPT-2 learns one embedding per absolute position and adds it to the input, so
every cached key and value already carries its position; a new token must take its true
position, the number of tokens seen so far, not its slot in the cache (`get_seq_length()`
counts tokens seen). The text is therefore still limited to block_size positions. A
rotary model (rope.py) has three choices, `rope=`:

- "true": as GPT-2, keys keep the turn of their true position and a new token takes its
  true position; run past the trained block_size (a config with a longer one), the model
  meets distances it was never trained on.
- "reindex" (StreamingLLM's): positions are numbered by slot in the cache, so no distance
  exceeds sinks + window however long the text. The cache keeps keys unturned and turns
  every held key by its slot in every pass.
- "rerotate" (what Hugging Face's SinkCache did): the same numbering, keys kept turned;
  when the window slides by d slots, the keys in it are turned back by d (rope.turn).
  Equal to "reindex" up to rounding, with each key turned once per eviction, not per read.

Within one pass, new tokens see each other and everything held: feed a long prompt one
token per pass for the window to apply to every token (`feed`).
"""
from __future__ import annotations

import copy
from contextlib import contextmanager

import torch

from .cache import Cache, check_kv, check_matches, zeros
from .rope import turn
from .validate import int_at_least, number_in, one_of

NUMBERINGS = ("true", "reindex", "rerotate")  # a rotary model's positions, once some are evicted


class SinkWindowCache(Cache):
    """Keys and values of the held positions, per layer (1, n_head, held, head_dim), and
    the absolute position of each held slot (`positions`). `rope` and `rope_theta`: how a
    rotary model numbers positions (above); a learned-position model has "true" only."""

    def __init__(self, n_layer: int, n_head: int, head_dim: int, sinks: int, window: int, *,
                 block_size: int, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, rope: str = "true",
                 rope_theta: float | None = None, value_dim: int | None = None):
        for name, size in dict(n_layer=n_layer, n_head=n_head, head_dim=head_dim,
                               window=window, block_size=block_size).items():
            int_at_least(name, size)
        int_at_least("sinks", sinks, 0)
        if one_of("rope", rope, NUMBERINGS) != "true":  # renumbered: the cache turns keys
            number_in("rope_theta", rope_theta, 1, hint=f" for rope={rope!r}: a rotary model's "
                      f"(SinkWindowCache.for_model); a learned-position model has rope='true'")
        self.rope, self.rope_theta = rope, rope_theta
        self.value_dim = head_dim if value_dim is None else int_at_least("value_dim", value_dim, 0)
        empty = zeros(1, (1, n_head, 0, head_dim), device, dtype)[0]
        self.keys = [empty] * n_layer
        self.values = [empty[..., :self.value_dim]] * n_layer
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
    def for_model(cls, model, sinks: int = 4, window: int = 64, rope: str = "true"
                  ) -> SinkWindowCache:
        cfg = model.config
        heads, key_dim, value_dim = cfg.kv_shape
        return cls(cfg.kv_layers, heads, key_dim, sinks, window, value_dim=value_dim,
                   block_size=cfg.block_size, device=model.device, dtype=model.dtype,
                   rope=rope, rope_theta=cfg.rope_theta if cfg.positions == "rope" else None)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Where the next token's position starts: tokens seen so far ("true"), or slots
        held (a rotary model's "reindex" and "rerotate")."""
        int_at_least("layer_idx", layer_idx, 0, below=self.n_layer)
        return self._seen if self.rope == "true" else len(self.positions)

    def check_fits(self, cfg, batch_size: int, n_new: int, device, dtype) -> None:
        if self.rope != "true" and ((cfg.positions, cfg.rope_theta) != ("rope", self.rope_theta)
                                    or cfg.kv_lora_rank is not None or cfg.rope_scaling):
            raise ValueError(f"this cache turns keys by rope_theta={self.rope_theta}: use it with "
                             f"a rotary model of that theta (SinkWindowCache.for_model), not "
                             f"MLA (its cached latent does not turn) nor a scaled RoPE "
                             f"(rope_scaling): rope='true'")
        if self.get_seq_length() + n_new > self.max_len:
            raise ValueError("no position embedding past block_size: start a new cache"
                             if cfg.positions == "learned" else "no position past the trained "
                             "block_size: start a new cache, or number by slot (rope='reindex')")
        check_matches(self, cfg, batch_size, device, dtype)
        self.checked = True

    def update(self, key: torch.Tensor, value: torch.Tensor,
               layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Append this pass's K/V and return everything held; once the last layer is
        written, evict all but the first `sinks` and the last `window` positions, in
        every layer."""
        if not self.checked:  # a call of one's own; a model's pass was checked up front
            check_kv(self, key, value, layer_idx)
        held, T = len(self.positions), key.shape[2]
        slots = torch.arange(held, held + T, device=key.device)
        if self.rope == "reindex":  # the model turned it for its slot: kept as made instead
            key = turn(key, -slots, self.rope_theta)
        self.keys[layer_idx] = torch.cat([self.keys[layer_idx], key.detach()], dim=2)
        self.values[layer_idx] = torch.cat([self.values[layer_idx], value.detach()], dim=2)
        k, v = self.keys[layer_idx], self.values[layer_idx]
        if self.rope == "reindex":  # every held key turned by its slot, in every pass
            k = turn(k, torch.arange(held + T, device=key.device), self.rope_theta)
        if layer_idx == self.n_layer - 1:
            self.positions += range(self._seen, self._seen + T)
            self._seen += T
            if len(self.positions) > self.sinks + self.window:
                self._evict(key.device)
        return k, v

    def _evict(self, device: torch.device) -> None:
        """Keep the first `sinks` and the last `window` slots, in every layer."""
        moved = len(self.positions) - self.sinks - self.window  # slots the window slides down
        keep = torch.tensor(list(range(self.sinks)) + list(range(self.sinks + moved,
                                                                 len(self.positions))),
                            device=device)
        self.keys = [t.index_select(2, keep) for t in self.keys]
        self.values = [t.index_select(2, keep) for t in self.values]
        self.positions = [self.positions[i] for i in keep.tolist()]
        if self.rope == "rerotate":  # the window's keys turned back as far as they moved
            back = torch.tensor([0] * self.sinks + [-moved] * self.window, device=device)
            self.keys = [turn(t, back, self.rope_theta) for t in self.keys]

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
