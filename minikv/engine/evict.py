"""Caches that evict by attention score: H2O's heavy hitters (Zhang et al. 2023) and
SnapKV's observation window (Li et al. 2024), beside window.py's sinks and window. The
window keeps positions by where they are; these keep them by how much attention they get.

- `H2OCache(heavy, recent)`: after every pass, each layer keeps its last `recent`
  positions and the `heavy` others that have received the most attention, summed over
  every query so far. Fed one token per pass, every query reads only what the policy
  kept (H2O's own setting); fed a prompt in one pass, its queries' attention picks what
  the decode steps read (H2O's "real drop").
- `SnapKVCache(top, window)`: once, after the first pass (the prompt), the prompt's last
  `window` queries, the observation window, vote: each earlier position gets the
  attention they gave it, smoothed over its neighbours (a 1-D pool of width `kernel`, so a
  clause is kept with its neighbours, not a lone token of it), and the `top` most voted
  stay with the window itself. Decode tokens are all kept, as in the paper: the cache
  then holds at most top + window + the tokens decoded since.

The seam: a policy needs the attention weights, which the model's attention function
computes and drops. So the cache brings its own: call the model as
`model(ids, cache=cache, attention=cache.attention)`. The model calls, for each layer in
turn, `cache.update(k, v, layer)` and then `attention(q, k, v)`, so the cache knows the
layer from the update just before; `attention` computes softmax(q kᵀ / √hs) explicitly,
hands the weights to the policy and returns weights @ v. (A hook in the model would be a
second seam in model.py for one chapter; an attention function is the one it has.)

One kept set per layer, the same for all of its heads (the scores summed over heads): the
papers' code keeps a set per head, but a position kept per layer is one token's K/V in
that layer, which a picture can draw over the question and a student can check. Each row
of a batch keeps its own positions (the same number: a batch is fed the same number of
tokens), so `positions[layer]` is (B, held): the true position of every held slot.

Positions, as window.py's "true": a new token takes its true position (tokens seen,
`get_seq_length()`); GPT-2's keys carry theirs from the position embedding, a rotary
model's are turned by theirs before they are cached, so both work unchanged.
"""
from __future__ import annotations

import copy
import math
from abc import abstractmethod

import torch
import torch.nn.functional as F

from .cache import Cache, check_kv, check_matches, zeros
from .validate import int_at_least, one_of
from .window import SinkWindowCache

THROUGH_ME = "call the model with attention=cache.attention: it records what the policy needs"


class ScoredCache(Cache):
    """What both policies share: per layer, the held keys and values (B, n_head, held,
    head_dim) and their true positions (B, held); a pass that becomes live once the last
    layer's attention has run, each layer then keeping what its policy's `_keep` says."""

    def __init__(self, n_layer: int, n_head: int, head_dim: int, budget: int, *,
                 batch_size: int = 1, block_size: int, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32):
        for name, size in dict(n_layer=n_layer, n_head=n_head, head_dim=head_dim,
                               batch_size=batch_size, block_size=block_size).items():
            int_at_least(name, size)
        int_at_least("budget", budget, 1, " (heavy + recent, or top + window: positions kept)")
        empty = zeros(1, (batch_size, n_head, 0, head_dim), device, dtype)[0]
        self.keys = [empty] * n_layer
        self.values = [empty] * n_layer
        self.positions = [torch.zeros(batch_size, 0, dtype=torch.long, device=empty.device)
                          ] * n_layer
        self.budget = budget
        self.max_len = block_size  # GPT-2 has no position embedding past its block_size
        self.n_layer, self.n_head, self.head_dim = n_layer, n_head, head_dim
        self.value_dim = head_dim
        self.batch_size, self.device, self.dtype = batch_size, empty.device, dtype
        self.score_dtype = torch.promote_types(dtype, torch.float32)  # sums of many weights
        self._seen = 0
        self._pass: list[list] = []  # this pass, per layer: [keys, values, what attention saw]
        self._attended = 0  # layers of this pass whose attention has run

    @staticmethod
    def _shapes(model, batch_size: int) -> tuple[tuple, dict]:
        cfg = model.config
        return ((cfg.n_layer, cfg.kv_heads, cfg.head_dim),
                dict(batch_size=batch_size, block_size=cfg.block_size, device=model.device,
                     dtype=model.dtype))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens seen: where the next token's true position starts."""
        int_at_least("layer_idx", layer_idx, 0, below=self.n_layer)
        return self._seen

    def check_fits(self, cfg, batch_size: int, n_new: int, device, dtype) -> None:
        if cfg.kv_lora_rank is not None or cfg.layers_per_kv > 1:  # attention sees other K/V
            raise ValueError("a scored cache reads each layer's own K/V heads: not an MLA or "
                             "cross-layer model's (use a KVCache or a SinkWindowCache)")
        if self._seen + n_new > self.max_len:
            raise ValueError("no position past block_size: start a new cache")
        check_matches(self, cfg, batch_size, device, dtype)
        self.checked = True

    def update(self, key: torch.Tensor, value: torch.Tensor,
               layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Everything held and this pass's K/V, (B, n_head, held + T, head_dim), kept
        aside until the last layer's attention (nothing is live before)."""
        if not self.checked:  # a call of one's own; a model's pass was checked up front
            check_kv(self, key, value, layer_idx)
        if layer_idx == 0:  # a new pass: whatever a failed one left aside is dropped
            self._pass, self._attended = [], 0
        elif not len(self._pass) == self._attended == layer_idx:
            raise ValueError(f"layer {layer_idx - 1}'s attention did not reach the cache: "
                             f"{THROUGH_ME}")
        k = torch.cat([self.keys[layer_idx], key.detach()], dim=2)
        v = torch.cat([self.values[layer_idx], value.detach()], dim=2)
        self._pass.append([k, v, None])
        return k, v

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The model's causal attention, its weights computed explicitly and shown to the
        policy (`_record`); q (B, nh, T, hs), k and v what `update` returned."""
        if self._attended != len(self._pass) - 1 or self._pass[-1][0] is not k:
            raise ValueError("cache.attention reads what this cache's update returned: call "
                             "the model with cache=cache, attention=cache.attention")
        T, L = q.size(-2), k.size(-2)
        k, v = (t.repeat_interleave(q.size(1) // t.size(1), dim=1) for t in (k, v))  # GQA
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))                    # (B, nh, T, L)
        sees = torch.ones(T, L, dtype=torch.bool, device=q.device).tril(diagonal=L - T)
        weights = scores.masked_fill(~sees, float("-inf")).softmax(dim=-1)
        self._pass[-1][2] = self._record(weights.detach())
        self._attended += 1
        if len(self._pass) == self.n_layer:  # the pass's last layer: it becomes live
            self._commit(T)
        return weights.to(v.dtype) @ v

    def _commit(self, T: int) -> None:
        """Hold every layer's new K/V, then keep, per row, the slots `_keep` names."""
        new = torch.arange(self._seen, self._seen + T, device=self.device)
        for layer, (k, v, seen) in enumerate(self._pass):
            self.keys[layer], self.values[layer] = k, v
            self.positions[layer] = torch.cat(
                [self.positions[layer], new.expand(self.batch_size, T)], dim=1)
            keep = self._keep(layer, seen)  # (B, kept) slots in increasing order, or None
            if keep is not None:
                slots = keep[:, None, :, None].expand(-1, k.size(1), -1, k.size(3))
                self.keys[layer], self.values[layer] = k.gather(2, slots), v.gather(2, slots)
                self.positions[layer] = self.positions[layer].gather(1, keep)
        self._seen += T
        self._pass = []

    @abstractmethod
    def _record(self, weights: torch.Tensor):
        """What the policy keeps of one layer's weights (B, nh, T, held + T)."""

    @abstractmethod
    def _keep(self, layer: int, seen) -> torch.Tensor | None:
        """The slots to keep in `layer`, (B, kept), given what `_record` kept of its
        weights; None keeps everything."""

    def kept(self, row: int = 0) -> list[list[int]]:
        """The true positions held for `row`, per layer (to draw what a policy keeps)."""
        int_at_least("row", row, 0, below=self.batch_size)
        return [p[row].tolist() for p in self.positions]

    def fork(self) -> ScoredCache:
        """An independent copy (cheap: passes replace tensors, never write into them)."""
        twin = copy.copy(self)
        for name, value in vars(self).items():
            if isinstance(value, list):
                setattr(twin, name, list(value))
        return twin

    restored_on_error = SinkWindowCache.restored_on_error  # it cannot crop: put back a fork

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.keys + self.values)


class H2OCache(ScoredCache):
    """Heavy hitters and recent positions (H2O): `scores[layer]` (B, held) is the attention
    each held position has received, summed over the layer's heads and every query that
    has seen it. The recent ones are kept as they are: a position only just written has
    been seen by few queries, so its sum says little yet."""

    def __init__(self, n_layer: int, n_head: int, head_dim: int, heavy: int, recent: int,
                 **shapes):
        int_at_least("heavy", heavy, 0)
        int_at_least("recent", recent, 0)
        super().__init__(n_layer, n_head, head_dim, heavy + recent, **shapes)
        self.heavy, self.recent = heavy, recent
        self.scores = [torch.zeros(self.batch_size, 0, device=self.device,
                                   dtype=self.score_dtype)] * n_layer

    @classmethod
    def for_model(cls, model, heavy: int = 16, recent: int = 16, batch_size: int = 1
                  ) -> H2OCache:
        shapes, where = cls._shapes(model, batch_size)
        return cls(*shapes, heavy, recent, **where)

    def _record(self, weights: torch.Tensor) -> torch.Tensor:
        # (B, held + T): what each position received, from every head and query of the pass
        return weights.sum(dim=(1, 2), dtype=self.score_dtype)

    def _keep(self, layer: int, received: torch.Tensor) -> torch.Tensor | None:
        B, held = received.shape
        grown = received.new_zeros(B, held - self.scores[layer].size(1))  # the new positions
        scores = torch.cat([self.scores[layer], grown], dim=1) + received
        if held <= self.budget:
            self.scores[layer] = scores
            return None
        older = held - self.recent  # the heavy hitters are chosen among the older slots
        heavy = scores[:, :older].topk(self.heavy, dim=1).indices.sort(dim=1).values
        recent = torch.arange(older, held, device=self.device).expand(B, self.recent)
        keep = torch.cat([heavy, recent], dim=1)
        self.scores[layer] = scores.gather(1, keep)
        return keep


POOLS = ("avg", "max")  # SnapKV's code offers both; it defaults to the average


class SnapKVCache(ScoredCache):
    """The observation window's vote (SnapKV), cast once, after the first pass: feed the
    prompt in one pass. A prompt of at most top + window positions is kept whole."""

    def __init__(self, n_layer: int, n_head: int, head_dim: int, top: int, window: int,
                 kernel: int = 5, pool: str = "avg", **shapes):
        int_at_least("top", top, 0)
        int_at_least("window", window, 1, " (the prompt's last queries, which vote)")
        if int_at_least("kernel", kernel) % 2 == 0:
            raise ValueError(f"kernel must be odd (a position pooled with as many neighbours "
                             f"on each side), got {kernel}")
        super().__init__(n_layer, n_head, head_dim, top + window, **shapes)
        self.top, self.window, self.kernel = top, window, kernel
        self.pool = one_of("pool", pool, POOLS)

    @classmethod
    def for_model(cls, model, top: int = 24, window: int = 8, kernel: int = 5,
                  pool: str = "avg", batch_size: int = 1) -> SnapKVCache:
        shapes, where = cls._shapes(model, batch_size)
        return cls(*shapes, top, window, kernel, pool, **where)

    def _record(self, weights: torch.Tensor) -> torch.Tensor | None:
        if self._seen:  # a decode pass: no vote
            return None
        return weights[:, :, -self.window:].sum(dim=(1, 2), dtype=self.score_dtype)  # (B, T)

    def _keep(self, layer: int, votes: torch.Tensor | None) -> torch.Tensor | None:
        if votes is None or votes.size(1) <= self.budget:
            return None
        B, before = votes.size(0), votes.size(1) - self.window  # the positions that are voted on
        pool = F.avg_pool1d if self.pool == "avg" else F.max_pool1d
        pooled = pool(votes[:, None, :before], self.kernel, stride=1, padding=self.kernel // 2)
        top = pooled[:, 0].topk(self.top, dim=1).indices.sort(dim=1).values  # (B, top)
        window = torch.arange(before, votes.size(1), device=self.device).expand(B, self.window)
        return torch.cat([top, window], dim=1)
