"""A paged KV cache (vLLM's PagedAttention): every layer's keys and values live in one
pool of fixed-size blocks, and each sequence owns a block table, the list of blocks that
hold its positions in order. Blocks are taken when a sequence needs room and given back
when it ends, so no sequence reserves memory for tokens it may never produce; reference
counts let sequences share blocks (a common prefix), and a shared block that must be
written is copied first.

A block holds page_size positions of every head, (nh, page_size, hs) per layer, as in
vLLM's PagedAttention kernel: position p of a sequence lives in block table[p //
page_size], slot p % page_size. The pool keeps the books (which blocks are free, who
holds them, which prompt blocks can be shared); a PagedCache is the view one pass writes
through. A single sequence's attention gathers its blocks into one (1, nh, L, hs) tensor
and runs the ordinary kernel; a decode batch's attention (paged_attention) reads each
row's blocks through its table instead, one block at a time, never padding a row to the
longest. (A fused GPU kernel reads the blocks in place; here the blocks a batch reads are
copied once.)
"""
from __future__ import annotations

import hashlib
from collections import deque
from dataclasses import dataclass, field

import torch

from .cache import Cache, zeros
from .config import GPTConfig
from .validate import int_at_least


def block_hash(previous: str, tokens: list[int]) -> str:
    """A full block is known by its tokens and everything before them (the previous
    block's hash): two sequences with the same first k blocks of tokens get the same k
    hashes."""
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
    hashes of full prompt blocks that may be shared (prefix caching: a freed block keeps
    its K/V and hash until it is reallocated, so a later prompt can still reuse it), and
    a log of (what, block, owner) for traces. Block tables change only through its
    methods."""

    def __init__(self, cfg, num_blocks: int, page_size: int, *, device="cpu",
                 dtype=torch.float32):
        if not isinstance(cfg, GPTConfig):
            raise TypeError(f"BlockPool takes a GPTConfig (model.config), not {cfg!r:.30}")
        int_at_least("num_blocks", num_blocks, hint=" (blocks in the pool)")
        int_at_least("page_size", page_size, hint=" (positions per block)")
        shape = (num_blocks, cfg.kv_heads, page_size, cfg.head_dim)
        self.keys = zeros(cfg.n_layer, shape, device, dtype)
        self.values = zeros(cfg.n_layer, shape, device, dtype)
        self.page_size = page_size
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self.free: deque[int] = deque(range(num_blocks))
        self.by_hash: dict[str, int] = {}
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
        """Blocks for n_new more positions in `table`; a shared, partly filled last block
        is copied first (copy-on-write), so the tables that share it keep their K/V."""
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
        """Give back every block of `table`, last first (so a prompt's first blocks, free
        the longest, stay findable the longest); a preemption is logged first."""
        if preempted:
            self.log.append(("preempt", -1, table.owner))
        for block in reversed(table.blocks):
            self.release(block, table.owner)
        table.blocks = []
        table.length = 0

    # --- prefix caching ---------------------------------------------------------------
    def cached_prefix(self, prompt: list[int]) -> list[int]:
        """The blocks that already hold the prompt's first full blocks, up to the first
        one not found; at least one prompt token is left to compute (its logits give the
        first token)."""
        blocks = []
        h = ""
        for i in range((len(prompt) - 1) // self.page_size):
            h = block_hash(h, prompt[i * self.page_size:(i + 1) * self.page_size])
            if h not in self.by_hash:
                break
            blocks.append(self.by_hash[h])
        return blocks

    def publish(self, prompt: list[int], table: BlockTable, upto: int | None = None) -> None:
        """Make the prompt's full blocks (the first ones of `table`; with `upto`, only
        those within its first `upto` positions, the ones computed so far) findable by
        their hashes, for the prompts to come; a hash already known keeps its block."""
        h = ""
        end = len(prompt) if upto is None else min(len(prompt), upto)
        for i in range(end // self.page_size):
            h = block_hash(h, prompt[i * self.page_size:(i + 1) * self.page_size])
            if h not in self.by_hash:
                self.by_hash[h] = table.blocks[i]
                self.hash_of[table.blocks[i]] = h


class PagedCache(Cache):
    """The caches of a batch of sequences in one BlockPool, through their block tables.
    Call `reserve(n)` before a pass that adds n positions per row: it takes the blocks
    they need (and copies a shared block about to be written); `crop` gives back what a
    rollback forgets.

    What a pass reads back: one sequence gets its positions gathered, (1, nh, L, hs). A
    batch (several tables, or `batched=True`) gets the layer's whole pool, which
    paged_attention reads through `block_tables()`. `packed=[n_0, n_1, ...]` makes the
    pass one row of sum(n) tokens: the first n_0 continue tables[0], the next n_1
    tables[1], and so on; it reads back every sequence's positions one after another.
    Prompts of different lengths then share a pass with no padding (attention must keep
    them apart: attention.packed_causal_mask)."""

    def __init__(self, pool: BlockPool, tables: list[BlockTable],
                 packed: list[int] | None = None, batched: bool = False):
        self.pool = pool
        self.tables = tables
        self.packed = packed
        self.batched = packed is None and (batched or len(tables) > 1)

    def get_seq_length(self, layer_idx: int = 0):
        """An int for one sequence; (B, 1) lengths for a batch, each row its own."""
        int_at_least("layer_idx", layer_idx, 0, below=len(self.pool.keys))
        if len(self.tables) == 1:
            return self.tables[0].length
        return torch.tensor([[t.length] for t in self.tables],
                            device=self.pool.keys[0].device)

    def reserve(self, n_new: int) -> None:
        """Blocks for n_new more positions in every row (BlockPool.reserve per table)."""
        int_at_least("n_new", n_new, 0, " (positions to make room for)")
        for t in self.tables:
            self.pool.reserve(t, n_new)

    def crop(self, max_length: int) -> None:
        """Roll one sequence back to max_length positions, giving back the blocks it no
        longer needs (the verify-and-rollback core calls this, as on a KVCache)."""
        length = self.tables[0].length
        int_at_least("crop length", max_length, 0, " (the positions kept)", length + 1)
        self.pool.crop(self.tables[0], max_length)

    def block_tables(self) -> torch.Tensor:
        """(B, nb) block ids of every row, -1 past a row's last block."""
        width = max(len(t.blocks) for t in self.tables)
        rows = [t.blocks + [-1] * (width - len(t.blocks)) for t in self.tables]
        return torch.tensor(rows, device=self.pool.keys[0].device)

    def update(self, key: torch.Tensor, value: torch.Tensor,
               layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the pass's new K/V into their slots and return what attention reads (see
        the class docstring): 2 x (1, nh, L, hs) gathered, or a batch's 2 x (num_blocks,
        nh, ps, hs)."""
        B, nh, T, hs = key.shape
        if layer_idx == 0:  # where it writes and what it reads: alike in every layer
            self._write, self._read = self._indices(T, key.device)
        keys, values = self.pool.keys[layer_idx], self.pool.values[layer_idx]
        block, slot = self._write
        with torch.no_grad():  # (block, slot) of every new position gets its (nh, hs)
            keys[block, :, slot] = key.transpose(1, 2).reshape(B * T, nh, hs)
            values[block, :, slot] = value.transpose(1, 2).reshape(B * T, nh, hs)
        if layer_idx == len(self.pool.keys) - 1:  # the pass is whole: its positions live
            for t, n in zip(self.tables, self._counts(T)):
                t.length += n
        if self.batched:
            return keys, values
        block, slot = self._read  # (L,) each: every position the pass reads, in order
        return tuple(src[block, :, slot].transpose(0, 1)[None] for src in (keys, values))

    def _counts(self, T: int) -> list[int]:
        """New positions per table: the packed counts, or T in every row."""
        return self.packed or [T] * len(self.tables)

    def _indices(self, T: int, device) -> tuple:
        """(blocks, slots) of every new position, in the pass's order, and of every
        position it reads back (one sequence, or a packed pass; a batch reads the whole
        pool): the two rows of a (2, N) tensor."""
        ps = self.pool.page_size
        spans = [(t, t.length + n) for t, n in zip(self.tables, self._counts(T))]
        new = [(t.blocks[p // ps], p % ps) for t, end in spans
               for p in range(t.length, end)]
        read = [(t.blocks[p // ps], p % ps) for t, end in spans for p in range(end)
                if not self.batched]
        return tuple(torch.tensor(pairs, dtype=torch.long, device=device).view(-1, 2).T
                     for pairs in (new, read))

    # --- checks: raise before anything is written -------------------------------------
    def check_fits(self, cfg, batch_size: int, n_new: int, device, dtype) -> None:
        k = self.pool.keys[0]
        have = (len(self.pool.keys), k.shape[1], k.shape[3], k.dtype, k.device)
        want = (cfg.n_layer, cfg.kv_heads, cfg.head_dim, dtype, device)
        if have != want:
            raise ValueError(f"the pool is {have}, the model {want}: use BlockPool(model.config)")
        rows = (1, sum(self.packed)) if self.packed else (len(self.tables), n_new)
        if (batch_size, n_new) != rows:
            raise ValueError(f"the pass is {batch_size} x {n_new} tokens, the block tables take "
                             f"{rows[0]} x {rows[1]} (a row per table; packed: one row of all)")
        short = [t.owner for t, n in zip(self.tables, self._counts(n_new))
                 if len(t.blocks) * self.pool.page_size < t.length + n]
        if short:
            raise ValueError(f"sequences {short} have no room: call cache.reserve({n_new}) first")
