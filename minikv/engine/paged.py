"""A paged KV cache (vLLM's PagedAttention): every layer's keys and values live in one pool of
fixed-size blocks, and each sequence owns a block table, the list of blocks that hold its
positions in order. Blocks are taken when a sequence needs room and given back when it ends, so
no sequence reserves memory for tokens it may never produce; reference counts let sequences share
blocks (a common prefix), and a shared block that must be written is copied first.

A block holds block_size positions of every head, (nh, block_size, hs) per layer, as in vLLM's
PagedAttention kernel: position p of a sequence lives in block table[p // block_size], slot
p % block_size. A single sequence's attention gathers its blocks into one (1, nh, L, hs) tensor
and runs the ordinary kernel; a decode batch's attention (paged_attention) reads each row's
blocks through its table instead, one block at a time, never padding a row to the longest. (A
fused GPU kernel reads the blocks in place; here the blocks a batch reads are copied once.)
"""
from __future__ import annotations

import hashlib
from collections import deque
from dataclasses import dataclass, field

import torch

from . import validate
from .cache import Cache


def block_hash(previous: str, tokens: list[int]) -> str:
    """A full block is known by its tokens and everything before them (the previous block's
    hash): two sequences with the same first k blocks of tokens get the same k hashes."""
    return hashlib.sha256(f"{previous}|{','.join(map(str, tokens))}".encode()).hexdigest()[:16]


class BlockPool:
    """num_blocks blocks of block_size positions, per layer keys and values (num_blocks, K/V
    heads, block_size, hs); reference counts; the hashes of full prompt blocks that may be shared
    (prefix caching: a freed block keeps its K/V and hash until it is reallocated, so a later
    prompt can still reuse it); and a log of what happened, for traces."""

    def __init__(self, cfg, num_blocks: int, block_size: int, *, device="cpu",
                 dtype=torch.float32):
        validate.pool(num_blocks, block_size)
        shape = (num_blocks, cfg.kv_heads, block_size, cfg.head_dim)
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layer)]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layer)]
        self.block_size, self.num_blocks = block_size, num_blocks
        self.ref = [0] * num_blocks
        self.free: deque[int] = deque(range(num_blocks))
        self.by_hash: dict[str, int] = {}
        self.hash_of: dict[int, str] = {}
        self.log: list[tuple[int, str, int, int]] = []  # (step, what, block, owner)
        self.step = 0  # the engine step, set by the server, stamped on what the log records

    @property
    def n_free(self) -> int:
        return len(self.free)

    def allocate(self, owner: int) -> int:
        if not self.free:
            raise MemoryError("the block pool is full")  # the scheduler preempts before this
        block = self.free.popleft()  # the longest free: its cached K/V the least likely wanted
        if block in self.hash_of:  # it held a prompt's block: no longer findable
            del self.by_hash[self.hash_of.pop(block)]
        self.ref[block] = 1
        self.log.append((self.step, "allocate", block, owner))
        return block

    def share(self, block: int, owner: int) -> None:
        if self.ref[block] == 0:  # free but still holding a prompt's K/V: taken back
            self.free.remove(block)
        self.ref[block] += 1
        self.log.append((self.step, "share", block, owner))

    def release(self, block: int, owner: int) -> None:
        assert self.ref[block] > 0, f"block {block} released twice"
        self.ref[block] -= 1
        if self.ref[block] == 0:  # free; a prompt's block stays findable until reallocated
            self.free.append(block)
        self.log.append((self.step, "free" if self.ref[block] == 0 else "unshare", block, owner))

    def copy_on_write(self, block: int, owner: int) -> int:
        """A private copy of a shared block, for `owner` to write into."""
        new = self.allocate(owner)
        for t in self.keys + self.values:
            t[new] = t[block]
        self.release(block, owner)
        self.log.append((self.step, "copy", new, owner))
        return new


@dataclass
class BlockTable:
    """One sequence's blocks, in position order, and how many positions they hold."""
    owner: int
    blocks: list[int] = field(default_factory=list)
    length: int = 0
    hashes: list[str] = field(default_factory=list)  # of its full blocks, in order


class PagedCache(Cache):
    """The caches of a batch of sequences in one BlockPool, through their block tables. Call
    `reserve(n)` before a pass that adds n positions per row: it takes the blocks they need (and
    copies a shared block about to be written); `crop` gives back what a rollback forgets.

    What a pass reads back: one sequence gets its positions gathered, (1, nh, L, hs). A batch
    (several tables, or `batched=True`) gets the layer's whole pool, which paged_attention reads
    through `block_tables()`. `packed=[n_0, n_1, ...]` makes the pass one row of sum(n) tokens:
    the first n_0 continue tables[0], the next n_1 tables[1], and so on; it reads back every
    sequence's positions one after another. Prompts of different lengths then share a pass with
    no padding (attention must keep them apart: serving.packed_causal_mask)."""

    def __init__(self, pool: BlockPool, tables: list[BlockTable], packed: list[int] | None = None,
                 batched: bool = False):
        self.pool, self.tables, self.packed = pool, tables, packed
        self.batched = packed is None and (batched or len(tables) > 1)

    def get_seq_length(self, layer_idx: int = 0):
        """An int for one sequence; (B, 1) lengths for a batch, each row continuing its own."""
        if len(self.tables) == 1:
            return self.tables[0].length
        lengths = [[t.length] for t in self.tables]
        return torch.tensor(lengths, device=self.pool.keys[0].device)

    @property
    def layer_lengths(self) -> list[int]:
        return [self.tables[0].length] * len(self.pool.keys)

    def blocks_needed(self, n_new: int) -> int:
        bs = self.pool.block_size
        return sum(max(0, -(-(t.length + n_new) // bs) - len(t.blocks)) for t in self.tables)

    def reserve(self, n_new: int) -> None:
        """Blocks for n_new more positions in every row; a shared, partly filled last block is
        copied first (copy-on-write), so the sequences that share it keep their K/V."""
        bs = self.pool.block_size
        for t in self.tables:
            last = t.length // bs
            if t.length % bs and self.pool.ref[t.blocks[last]] > 1:
                t.blocks[last] = self.pool.copy_on_write(t.blocks[last], t.owner)
            while len(t.blocks) * bs < t.length + n_new:
                t.blocks.append(self.pool.allocate(t.owner))

    def check_fits(self, cfg, batch_size: int, n_new: int, device, dtype) -> None:
        validate.paged_fits(self, cfg, batch_size, n_new, device, dtype)

    def block_tables(self) -> torch.Tensor:
        """(B, nb) block ids of every row, -1 past a row's last block."""
        width = max(len(t.blocks) for t in self.tables)
        return torch.tensor([t.blocks + [-1] * (width - len(t.blocks)) for t in self.tables],
                            device=self.pool.keys[0].device)

    def update(self, key: torch.Tensor, value: torch.Tensor,
               layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the pass's new K/V into their slots and return what attention reads (see the
        class docstring): 2 x (1, nh, L, hs) gathered, or a batch's 2 x (num_blocks, nh, bs, hs)."""
        B, nh, T, hs = key.shape
        if layer_idx == 0:  # where this pass writes and what it reads: the same in every layer
            self._write, self._read = self._indices(T, key.device)
        keys, values = self.pool.keys[layer_idx], self.pool.values[layer_idx]
        block, slot = self._write
        with torch.no_grad():  # (block, slot) of every new position gets its (nh, hs)
            keys[block, :, slot] = key.transpose(1, 2).reshape(B * T, nh, hs)
            values[block, :, slot] = value.transpose(1, 2).reshape(B * T, nh, hs)
        if layer_idx == len(self.pool.keys) - 1:  # the pass is whole: its positions are live
            for t, n in zip(self.tables, self.packed or [T] * len(self.tables)):
                t.length += n
        if self.batched:
            return keys, values
        block, slot = self._read  # (L,) each: every position the pass reads, in order
        return tuple(src[block, :, slot].transpose(0, 1)[None] for src in (keys, values))

    def _indices(self, T: int, device) -> tuple:
        """(block, slot) of every new position, in the pass's order, and of every position it
        reads back (for one sequence or a packed pass)."""
        bs = self.pool.block_size
        counts = self.packed or [T] * len(self.tables)
        new = [(t.blocks[p // bs], p % bs) for t, n in zip(self.tables, counts)
               for p in range(t.length, t.length + n)]
        read = [] if self.batched else [(t.blocks[p // bs], p % bs) for t, n in
                                        zip(self.tables, counts) for p in range(t.length + n)]
        as_tensors = lambda pairs: tuple(torch.tensor(x, device=device)  # noqa: E731
                                         for x in (zip(*pairs) if pairs else ([], [])))
        return as_tensors(new), as_tensors(read)

    def crop(self, max_length: int) -> None:
        """Roll one sequence back to max_length positions, giving back the blocks it no longer
        needs (the verify-and-rollback core calls this, as on a KVCache)."""
        validate.crop(self, max_length)
        t, bs = self.tables[0], self.pool.block_size
        t.length = max_length
        while len(t.blocks) * bs >= max_length + bs:
            self.pool.release(t.blocks.pop(), t.owner)
        del t.hashes[max_length // bs:]
