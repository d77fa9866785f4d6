"""A paged KV cache (vLLM's PagedAttention): every layer's keys and values live in one
pool of fixed-size blocks; a sequence's block table holds its positions in order,
position p in block table[p // page_size], slot p % page_size. Blocks are taken as a
sequence grows and given back when it ends; reference counts let sequences share blocks
(a common prefix), and a shared block about to be written is copied first. The pool
keeps the books; a pass writes through a view: a PagedCache gathers its tables' blocks
for an ordinary kernel, a PagedBatch (a decode batch) hands attention the pool itself,
read through each row's table.
"""
from __future__ import annotations

import hashlib
from collections import deque
from dataclasses import dataclass, field

import torch

from .cache import Cache, upload, zeros
from .config import GPTConfig
from .validate import int_at_least


def block_hash(previous: str, tokens: list[int]) -> str:
    """A full block is known by its tokens and the previous block's hash: two sequences
    with the same first k blocks of tokens get the same k hashes."""
    text = f"{previous}|{','.join(map(str, tokens))}".encode()
    return hashlib.sha256(text).hexdigest()[:16]


@dataclass
class BlockTable:
    """One sequence's blocks, in position order, and how many positions they hold."""
    owner: int
    blocks: list[int] = field(default_factory=list)
    length: int = 0


class BlockPool:
    """num_blocks blocks of page_size positions, per layer keys and values (num_blocks,
    K/V heads, page_size, hs), and their books: reference counts, the free list, the
    hashes of full prompt blocks (a freed block keeps its K/V and hash until
    reallocated) and a log of (what, block, owner). Tables change only through it."""

    def __init__(self, cfg, num_blocks: int, page_size: int, *, device="cpu",
                 dtype=torch.float32):
        if not isinstance(cfg, GPTConfig):
            raise TypeError(f"BlockPool takes a GPTConfig (model.config), not {cfg!r:.30}")
        int_at_least("num_blocks", num_blocks, hint=" (blocks in the pool)")
        int_at_least("page_size", page_size, hint=" (positions per block)")
        (heads, key_dim, value_dim), layers = cfg.kv_shape, cfg.kv_layers  # MLA: no values
        self.keys = zeros(layers, (num_blocks, heads, page_size, key_dim), device, dtype)
        self.values = zeros(layers, (num_blocks, heads, page_size, value_dim), device, dtype)
        self.page_size, self.num_blocks = page_size, num_blocks
        self.ref = [0] * num_blocks
        self.free: deque[int] = deque(range(num_blocks))
        self.by_hash: dict[str, int] = {}  # and its inverse, hash_of
        self.hash_of: dict[int, str] = {}
        self.log: list[tuple[str, int, int]] = []

    @property
    def n_free(self) -> int:
        return len(self.free)

    # --- one block --------------------------------------------------------------------
    def allocate(self, owner: int) -> int:
        if not self.free:
            raise MemoryError("the block pool is full")  # the scheduler preempts first
        block = self.free.popleft()  # the longest free: its K/V the least likely wanted
        if block in self.hash_of:  # it held a prompt's block: no longer findable
            del self.by_hash[self.hash_of.pop(block)]
        self.ref[block] = 1
        self.log.append(("allocate", block, owner))
        return block

    def share(self, block: int, owner: int) -> None:
        if self.ref[block] == 0:  # free but still holding a prompt's K/V: taken back
            self.free.remove(block)
        self.ref[block] += 1
        self.log.append(("share", block, owner))

    def release(self, block: int, owner: int) -> None:
        assert self.ref[block] > 0, f"block {block} released twice"
        self.ref[block] -= 1
        if self.ref[block] == 0:  # free; a prompt's block findable until reallocated
            self.free.append(block)
        self.log.append(("free" if self.ref[block] == 0 else "unshare", block, owner))

    def copy_on_write(self, block: int, owner: int) -> int:
        """A private copy of a shared block, for `owner` to write into."""
        new = self.allocate(owner)
        for t in self.keys + self.values:
            t[new] = t[block]
        self.release(block, owner)
        self.log.append(("copy", new, owner))
        return new

    # --- a block table ----------------------------------------------------------------
    def blocks_needed(self, table: BlockTable, n_new: int) -> int:
        """Free blocks `table` takes to hold n_new more positions."""
        return max(0, -(-(table.length + n_new) // self.page_size) - len(table.blocks))

    def reserve(self, table: BlockTable, n_new: int) -> None:
        """Blocks for n_new more positions in `table`, a shared, partly filled last block
        copied first (copy-on-write), so the tables that share it keep their K/V."""
        last = table.length // self.page_size
        shared = table.length % self.page_size and self.ref[table.blocks[last]] > 1
        needed = self.blocks_needed(table, n_new) + bool(shared)
        if needed > len(self.free):  # before any block moves: all of them or none
            raise MemoryError(f"the block pool is full: {needed} blocks needed, "
                              f"{len(self.free)} free")
        if shared:
            table.blocks[last] = self.copy_on_write(table.blocks[last], table.owner)
        while len(table.blocks) * self.page_size < table.length + n_new:
            table.blocks.append(self.allocate(table.owner))

    def crop(self, table: BlockTable, length: int) -> None:
        """Roll `table` back to `length` positions; blocks wholly past them go back."""
        table.length = length
        while (len(table.blocks) - 1) * self.page_size >= length:
            self.release(table.blocks.pop(), table.owner)

    def free_table(self, table: BlockTable, preempted: bool = False) -> None:
        """Give back every block of `table`, last first (a prompt's first blocks then
        stay findable the longest); a preemption is logged first."""
        if preempted:
            self.log.append(("preempt", -1, table.owner))
        for block in reversed(table.blocks):
            self.release(block, table.owner)
        table.blocks, table.length = [], 0

    # --- prefix caching ---------------------------------------------------------------
    def hashes(self, prompt: list[int], n_blocks: int):
        """The hashes of the prompt's first n_blocks full blocks, in order."""
        h, ps = "", self.page_size
        for i in range(n_blocks):
            h = block_hash(h, prompt[i * ps:(i + 1) * ps])
            yield h

    def cached_prefix(self, prompt: list[int]) -> list[int]:
        """The blocks that already hold the prompt's first full blocks, up to the first
        one not found; one prompt token is always left, whose logits give the first
        token."""
        blocks = []
        for h in self.hashes(prompt, (len(prompt) - 1) // self.page_size):
            if h not in self.by_hash:
                break
            blocks.append(self.by_hash[h])
        return blocks

    def publish(self, prompt: list[int], table: BlockTable, upto: int | None = None) -> None:
        """Make the prompt's full blocks within `table`'s first `upto` positions (those
        computed) findable by their hashes; a hash already known keeps its block."""
        end = len(prompt) if upto is None else min(len(prompt), upto)
        for i, h in enumerate(self.hashes(prompt, end // self.page_size)):
            if h not in self.by_hash:
                self.by_hash[h], self.hash_of[table.blocks[i]] = table.blocks[i], h


class PagedCache(Cache):
    """One sequence's cache in a BlockPool, through its block table; or several, for a
    packed pass of ONE row whose first counts[0] tokens continue tables[0], the next
    counts[1] tables[1], ... (no padding). `update` writes each new position's K/V into
    its slot and gives back every table's positions in order, (1, nh, sum of lengths,
    hs), for a dense attention (packed: with attention.packed_causal_mask and explicit
    positions)."""

    def __init__(self, pool: BlockPool, tables: list[BlockTable], counts: list[int] | None = None):
        if counts is None and len(tables) != 1:
            raise ValueError("a pass over several tables says how many tokens each takes: "
                             "PagedCache(pool, tables, counts=[...])")
        self.pool, self.tables, self.counts = pool, tables, counts

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if len(self.tables) > 1:  # each table goes on from its own length
            raise ValueError("a packed pass over several tables needs model(..., positions=)")
        return self.tables[0].length

    def reserve(self, n_new: int) -> None:
        """Blocks for n_new more positions in every table (BlockPool.reserve)."""
        int_at_least("n_new", n_new, 0, " (positions to make room for)")
        for t in self.tables:
            self.pool.reserve(t, n_new)

    def crop(self, max_length: int) -> None:
        """Roll the sequence back to max_length positions (the verify core calls this)."""
        int_at_least("crop length", max_length, 0, " (the positions kept)",
                     self.tables[0].length + 1)
        self.pool.crop(self.tables[0], max_length)

    def compact(self, slots: list[int], start: int) -> None:
        """Keep the positions in `slots` (a token tree's accepted path) as start, start +
        1, ..., and forget the rest: KVCache.compact, through the table."""
        t = self.tables[0]
        src = self._slots([(t, slots)])
        dst = self._slots([(t, range(start, start + len(slots)))])
        with torch.no_grad():
            for layer in self.pool.keys + self.pool.values:  # a gather copies: overlaps safe
                layer[dst[0], :, dst[1]] = layer[src[0], :, src[1]]
        self.pool.crop(t, start + len(slots))

    def update(self, key: torch.Tensor, value: torch.Tensor,
               layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx == 0:  # where it writes and what it reads: alike in every layer
            spans = list(zip(self.tables, self.counts or [key.shape[2]]))
            self._write = self._slots([(t, range(t.length, t.length + n)) for t, n in spans])
            self._read = self._slots([(t, range(t.length + n)) for t, n in spans])
        keys, values = self._store(key, value, layer_idx)
        block, slot = self._read  # (L,) each: every position the pass reads, in order
        return tuple(src[block, :, slot].transpose(0, 1)[None] for src in (keys, values))

    def _store(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int) -> tuple:
        """Write (B, nh, T, hs) K/V into their slots; the pass's positions live once the
        last layer is written. The layer's pool, 2 x (num_blocks, nh, ps, hs)."""
        B, nh, T, _ = key.shape
        keys, values = self.pool.keys[layer_idx], self.pool.values[layer_idx]
        block, slot = self._write
        with torch.no_grad():  # (block, slot) of every new position gets its (nh, hs)
            keys[block, :, slot] = key.transpose(1, 2).reshape(B * T, nh, -1)
            values[block, :, slot] = value.transpose(1, 2).reshape(B * T, nh, -1)
        if layer_idx == len(self.pool.keys) - 1:
            for t, n in zip(self.tables, self.counts or [T]):
                t.length += n
        return keys, values

    def _slots(self, spans) -> tuple[torch.Tensor, torch.Tensor]:
        """(blocks, slots) of the positions in spans, [(table, positions)], in order."""
        ps = self.pool.page_size
        pairs = [(t.blocks[p // ps], p % ps) for t, positions in spans for p in positions]
        index = upload(pairs, self.pool.keys[0].device)  # mid-pass: queued, not waited for
        return tuple(index.view(-1, 2).T)

    # --- checks: raise before anything is written -------------------------------------
    def check_fits(self, cfg, batch_size: int, n_new: int, device, dtype) -> None:
        k, v = self.pool.keys[0], self.pool.values[0]
        have = (len(self.pool.keys), k.shape[1], k.shape[3], v.shape[3], k.dtype, k.device)
        want = (cfg.kv_layers, *cfg.kv_shape, dtype, device)
        if have != want:
            raise ValueError(f"the pool is {have}, the model {want}: use BlockPool(model.config)")
        rows = (len(self.tables), 1) if isinstance(self, PagedBatch) else (1, sum(
            self.counts or [n_new]))
        if (batch_size, n_new) != rows:
            raise ValueError(f"the pass is {batch_size} x {n_new} tokens, the tables take "
                             f"{rows[0]} x {rows[1]} (PagedCache: a row; PagedBatch: one each)")
        counts = self.counts or [n_new]
        if any(len(t.blocks) * self.pool.page_size < t.length + n
               for t, n in zip(self.tables, counts)):
            raise ValueError("a sequence has no room for the pass: call cache.reserve(n) first")


class PagedBatch(PagedCache):
    """A decode batch in a BlockPool: a row per block table, a new position each (B, 1).
    `update` writes each row's K/V and gives back the layer's whole pool, which
    attention.paged_attention reads through `block_tables()`, each row its own blocks."""

    def __init__(self, pool: BlockPool, tables: list[BlockTable]):
        super().__init__(pool, tables, [1] * len(tables))

    def update(self, key: torch.Tensor, value: torch.Tensor,
               layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx == 0:
            self._write = self._slots([(t, [t.length]) for t in self.tables])
        return self._store(key, value, layer_idx)

    def block_tables(self) -> torch.Tensor:
        """(B, nb) block ids of every row, -1 past a row's last block."""
        width = max(len(t.blocks) for t in self.tables)
        rows = [t.blocks + [-1] * (width - len(t.blocks)) for t in self.tables]
        return torch.tensor(rows, device=self.pool.keys[0].device)
