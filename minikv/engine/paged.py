"""A paged KV cache (vLLM's PagedAttention): every layer's keys and values live in one pool of
fixed-size blocks, and each sequence owns a block table, the list of blocks that hold its
positions in order. Blocks are taken when a sequence needs room and given back when it ends, so
no sequence reserves memory for tokens it may never produce; reference counts let sequences share
blocks (a common prefix), and a shared block that must be written is copied first.

Attention here gathers each sequence's blocks into a contiguous (B, nh, L, hs) tensor and runs the
ordinary kernels. A fused kernel (PagedAttention) reads the blocks in place through the table
instead, which saves that copy; the numbers are the same.
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
    """num_blocks blocks of block_size positions, per layer keys and values
    (num_blocks, nh, block_size, hs); reference counts; the hashes of full blocks that may be
    shared (prefix caching); and a log of what happened, for traces."""

    def __init__(self, cfg, num_blocks: int, block_size: int, *, device="cpu",
                 dtype=torch.float32):
        validate.pool(num_blocks, block_size)
        shape = (num_blocks, cfg.n_head, block_size, cfg.head_dim)
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
        block = self.free.popleft()
        self.ref[block] = 1
        self.log.append((self.step, "allocate", block, owner))
        return block

    def share(self, block: int, owner: int) -> None:
        self.ref[block] += 1
        self.log.append((self.step, "share", block, owner))

    def release(self, block: int, owner: int) -> None:
        assert self.ref[block] > 0, f"block {block} released twice"
        self.ref[block] -= 1
        if self.ref[block] == 0:  # nobody holds it: free, and no longer findable by its hash
            self.by_hash.pop(self.hash_of.pop(block, None), None)
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
    copies a shared block about to be written); `crop` gives back what a rollback forgets."""

    def __init__(self, pool: BlockPool, tables: list[BlockTable]):
        self.pool, self.tables = pool, tables

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

    def update(self, key: torch.Tensor, value: torch.Tensor,
               layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Write each row's (nh, T, hs) new K/V into its blocks; return every row's K/V gathered
        through its block table, right-padded to the longest: 2 x (B, nh, L, hs)."""
        B, nh, T, hs = key.shape
        if layer_idx == 0:  # where this pass writes and what it reads: the same in every layer
            self._slots, self._gather, self._longest = self._indices(T, key.device)
        keys, values = self.pool.keys[layer_idx], self.pool.values[layer_idx]
        block, offset = self._slots                                        # (B * T,) each
        with torch.no_grad():
            keys[block, :, offset] = key.transpose(1, 2).reshape(B * T, nh, hs)
            values[block, :, offset] = value.transpose(1, 2).reshape(B * T, nh, hs)
        if layer_idx == len(self.pool.keys) - 1:  # the pass is whole: its positions are live
            for t in self.tables:
                t.length += T
        out = []
        for src in (keys, values):  # (B, nb, nh, bs, hs) -> (B, nh, nb * bs, hs), cut to longest
            blocks = src[self._gather].permute(0, 2, 1, 3, 4)
            out.append(blocks.reshape(B, nh, -1, hs)[:, :, :self._longest])
        return out[0], out[1]

    def _indices(self, T: int, device) -> tuple:
        """(block, offset) of every new position, row by row; the block tables as a (B, nb)
        tensor (short rows padded with their first block: attention masks those positions);
        and the longest row after this pass."""
        bs = self.pool.block_size
        positions = torch.tensor([[t.length + i for i in range(T)] for t in self.tables])
        table = [t.blocks for t in self.tables]
        width = max(len(blocks) for blocks in table)
        table = torch.tensor([blocks + blocks[:1] * (width - len(blocks)) for blocks in table])
        block = table.gather(1, positions // bs).reshape(-1)
        longest = max(t.length for t in self.tables) + T
        return ((block.to(device), (positions % bs).reshape(-1).to(device)), table.to(device),
                longest)

    def crop(self, max_length: int) -> None:
        """Roll one sequence back to max_length positions, giving back the blocks it no longer
        needs (the verify-and-rollback core calls this, as on a KVCache)."""
        validate.crop(self, max_length)
        t, bs = self.tables[0], self.pool.block_size
        t.length = max_length
        while len(t.blocks) * bs >= max_length + bs:
            self.pool.release(t.blocks.pop(), t.owner)
        del t.hashes[max_length // bs:]
