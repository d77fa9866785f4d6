"""Checkers for chapter 06 (many requests: a paged KV cache, prefix caching, admission).

- gather_keys: one layer's keys read through a block table, bit for bit as PagedCache reads them.
- reserve: room for n_new more positions in a BlockTable, a shared partly filled block copied
  first, against PagedCache.reserve on a copy of the pool (table, counts, free list, hashes, K/V).
- matching_blocks (a table): a prompt's cached prefix blocks, as BlockPool.cached_prefix finds them.
- can_admit (a table): the scheduler's admission rule, at its edges (exactly enough, one short).
- predict_peak_blocks (predict, then measure): blocks in use when 4 requests share a prompt.
- crop (debug): a paged rollback, against PagedCache.crop, then inside a verify-and-rollback decode.
- choose_block_size (design, a table): the largest block size within a waste budget.
- chunk_schedule (a table): chunked prefill's steps by hand, against a ChunkedPrefill run's trace.

Everything runs on the CPU in about a second and leaves the caller's random state alone.
"""
from __future__ import annotations

import copy
import functools
import math
import random
from collections import deque
from functools import partial

import torch

from ...engine import GPTConfig, Request, SamplingParams, generate, serve
from ...engine.paged import BlockPool, BlockTable, PagedCache, block_hash
from ...engine.scheduler import FirstComeFirstServed, Scheduler, Sequence
from ...engine.verify import accept_matching, verify_and_commit
from . import (
    Exercise,
    Refused,
    call_hinted,
    diagnose,
    expect,
    fail,
    forbid,
    guarded,
    int_list,
    one_of,
    one_thread,
    passed,
    prediction,
    tiny_model,
)


def _config(n_layer: int, n_head: int, head_dim: int) -> GPTConfig:
    return GPTConfig.preset("tiny", n_layer=n_layer, n_head=n_head, n_embd=n_head * head_dim)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


class _Labelled(list):
    """A case's argument that carries what the case is about (`label`), for the message."""

    def __init__(self, label: str, items=()):
        super().__init__(items)
        self.label = label


# --- exercise 1: a sequence's keys, read through its block table --------------------------------

# (what the case is about, num_blocks, nh, block_size, hs, table, length); the first tells most
# mistakes apart
GATHER_CASES = [
    ("a table out of order, its last block partly filled", 8, 2, 4, 3, [5, 2, 7], 10),
    ("a length that ends exactly on a block boundary", 8, 2, 4, 3, [3, 0], 8),
    ("a block reserved past the end (reserve runs before the pass that writes)", 8, 2, 4, 3,
     [6, 1, 4], 8),
    ("one position", 8, 2, 4, 3, [2], 1),
    ("a fresh pool's first request: blocks 0, 1, 2, 3", 8, 2, 4, 3, [0, 1, 2, 3], 13),
    ("blocks of 16, four heads", 12, 4, 16, 8, [9, 3, 11, 0], 50),
    ("blocks of 1 position", 8, 2, 1, 3, [4, 2, 6], 3),
    ("blocks of 5, three heads, a block reserved past the end", 9, 3, 5, 2, [7, 2, 4, 0, 5, 8],
     21),
]


def engine_read(pool_keys: torch.Tensor, table: list[int], length: int) -> torch.Tensor:
    """(nh, length, hs): what a pass through PagedCache writing the last position reads back."""
    num_blocks, nh, bs, hs = pool_keys.shape
    pool = BlockPool(_config(1, nh, hs), num_blocks, bs, dtype=pool_keys.dtype)
    pool.keys[0].copy_(pool_keys)
    pool.values[0].copy_(pool_keys)
    new = pool_keys[table[(length - 1) // bs], :, (length - 1) % bs][None, :, None].clone()
    with torch.no_grad():
        keys, _ = PagedCache(pool, [BlockTable(0, list(table), length - 1)]).update(new, new, 0)
    return keys[0]


def _read(where):
    """A gather that reads position p at where(table, p // block_size, p % block_size)."""
    return lambda pool_keys, table, length: torch.stack([pool_keys[where(
        table, p // pool_keys.size(2), p % pool_keys.size(2))] for p in range(length)], dim=1)


GATHER_MISTAKES = {  # hint -> wrong implementation
    "this is what you get with the blocks in the order of their ids (sorted, or as they sit in "
    "the pool): a block table lists a sequence's blocks in POSITION order, and its ids can come "
    "in any order (blocks are taken from wherever the free list had them); position p is in "
    "block table[p // block_size]": _read(lambda table, i, s: (sorted(table)[i], slice(None), s)),
    "this is what you get when you read block p // block_size of the POOL, as if the sequence "
    "held the pool's first blocks: p // block_size is an index into the TABLE, and table[p // "
    "block_size] is the block": _read(lambda table, i, s: (i, slice(None), s)),
    "this is what you get when you reshape pool_keys[table] (blocks, nh, block_size, hs) "
    "straight to (nh, -1, hs): reshape keeps the memory order, so it mixes heads and blocks. "
    "Bring the head axis first (.transpose(0, 1) gives (nh, blocks, block_size, hs)), then merge "
    "blocks and slots, then cut to length": lambda pool_keys, table, length: pool_keys[
        table].reshape(pool_keys.size(1), -1, pool_keys.size(3))[:, :length],
    "this is what you get with block and slot swapped: the block is table[p // block_size], the "
    "slot inside it p % block_size": _read(lambda table, i, s: (table[s], slice(None), i)),
}


def _gather_shape_hint(shape: tuple, nh: int, bs: int, hs: int, table: list[int],
                       length: int) -> str:
    if shape == (length, nh, hs):
        return ("positions first: attention reads a sequence's keys heads first, (nh, length, "
                "hs), as chapter 02's cache (B, nh, T, hs) without B; stack the positions on "
                "dim 1 (or .transpose(0, 1))")
    if shape == (1, nh, length, hs):
        return "one sequence, no batch axis: return (nh, length, hs)"
    if len(shape) == 3 and shape[0] == nh and shape[2] == hs:
        n = shape[1]
        if n == len(table) * bs and n > length:
            return (f"cut to length: the table's {len(table)} blocks have {n} slots, but the "
                    f"sequence holds {length} positions; the slots past its end are empty or "
                    f"stale (a last block partly filled, or one reserved for later)")
        if n == length // bs * bs:
            return ("you dropped the partly filled last block (length // block_size rounds "
                    "down): its positions belong to the sequence too; it holds "
                    "ceil(length / block_size) blocks")
        if n == (length // bs + 1) * bs:
            return ("length // block_size + 1 blocks is one too many when length ends on a block "
                    "boundary: read ceil(length / block_size) blocks, or cut to length")
        return f"one position per row of dim 1: {length} positions, not {n}"
    return ("return (nh, length, hs): for position p, pool_keys[table[p // block_size], :, p % "
            "block_size] holds the (nh, hs) keys of every head")


OUT_OF_RANGE = ("an index out of range: position p is in block table[p // block_size] (the "
                "table's entries are the block ids; p // block_size indexes the table), at slot "
                "p % block_size (0 to block_size - 1), for p = 0 .. length - 1")


def _where_from(pool_keys: torch.Tensor, row: torch.Tensor) -> str:
    """Which (block, slot) of the pool holds the (nh, hs) `row`, in words."""
    return next((f"pool_keys[{b}, :, {s}]" for b in range(pool_keys.size(0))
                 for s in range(pool_keys.size(2)) if torch.equal(pool_keys[b, :, s], row)),
                "keys found in no single slot of the pool (heads or slots mixed up?)")


@guarded
def check_gather_keys(gather_keys) -> None:
    """gather_keys(pool_keys, table, length) -> (nh, length, hs), as PagedCache reads them."""
    name = "gather_keys"
    for i, (label, num_blocks, nh, bs, hs, table, length) in enumerate(GATHER_CASES):
        pool_keys = torch.randn(num_blocks, nh, bs, hs,
                                generator=torch.Generator().manual_seed(600 + i))
        case = (f"{label}: pool_keys of shape {tuple(pool_keys.shape)} (blocks of {bs}), "
                f"table={table}, length={length}")
        want = engine_read(pool_keys, table, length)
        given, given_table = pool_keys.clone(), list(table)
        with forbid(name, PagedCache.update, PagedCache._slots):
            got = call_hinted(name, case, lambda e: OUT_OF_RANGE if isinstance(e, IndexError)
                              else "your function raised on this input", gather_keys, given,
                              given_table, length)
        expect(torch.equal(given, pool_keys) and given_table == table, name, case,
               "pool_keys and table left as they were", "they changed", "reading through a "
               "table writes nothing: no in-place operation on the pool or the table")
        if not isinstance(got, torch.Tensor):
            fail(name, case, f"a tensor of shape {tuple(want.shape)}", type(got).__name__,
                 "return a torch tensor (nh, length, hs): torch.stack or torch.cat the keys, or "
                 "index pool_keys" + (" (did you forget to return it?)" if got is None else ""))
        expect(got.shape == want.shape, name, case, f"shape {tuple(want.shape)} (nh, length, hs)",
               f"shape {tuple(got.shape)}",
               _gather_shape_hint(tuple(got.shape), nh, bs, hs, table, length))
        expect(got.dtype == want.dtype, name, case, f"dtype {want.dtype}", f"dtype {got.dtype}",
               "return the pool's keys as they are, in the pool's dtype")
        if not torch.equal(got, want):
            p = int((got != want).any(dim=2).any(dim=0).nonzero()[0])
            fail(name, case, f"position {p}: pool_keys[{table[p // bs]}, :, {p % bs}]",
                 f"position {p}: {_where_from(pool_keys, got[:, p])}",
                 diagnose(GATHER_MISTAKES, [((pool_keys, table, length), got)], same=torch.equal)
                 or "position p's keys are pool_keys[table[p // block_size], :, p % "
                    "block_size]: every head's, in position order")
    passed(name, len(GATHER_CASES))


# --- exercise 2: blocks for the positions to come, copy-on-write --------------------------------

# (what the case is about, block_size, num_blocks, the other tables (blocks, length), this
# table (blocks, length), n_new, the free list's order (None: by id), blocks holding a hash)
RESERVE_CASES = [
    ("the chapter's copy-on-write: B holds A's two blocks and writes position 6", 4, 6,
     [([0, 1], 6)], ([0, 1], 6), 1, None, []),
    ("a new request (an empty table) for a 9-token prompt; the first free block still holds a "
     "finished prompt's K/V, findable by its hash", 4, 10, [([3, 4, 5], 11)], ([], 0), 9,
     [7, 0, 9, 2, 1, 6, 8], [7, 2]),
    ("two full shared blocks: position 8 starts a new block", 4, 8, [([5, 2], 8)], ([5, 2], 8),
     1, None, []),
    ("room left in an unshared last block", 4, 8, [([1], 3)], ([2, 6], 5), 2, None, []),
    ("an unshared, partly filled last block and 10 positions more", 4, 10, [([0, 1], 7)],
     ([9], 3), 10, None, []),
    ("three tables hold the partly filled block: a copy and two new blocks", 4, 10,
     [([0, 1], 6), ([0, 1, 4], 9)], ([0, 1], 6), 7, [2, 8, 3, 5, 6, 7, 9], [8]),
    ("blocks of 16: a 37-position sequence shares a partly filled block with a longer one", 16,
     6, [([2, 5, 1], 40)], ([2, 5, 1], 37), 1, [4, 0, 3], []),
    ("a full block of its own, and exactly one block more", 4, 6, [], ([4], 4), 4, None, []),
    ("blocks of 1 position: none is ever partly filled", 1, 8, [([3, 1, 0], 3)], ([3, 1], 2), 2,
     None, [2]),
]


def reserve_pool(case: tuple, seed: int) -> tuple[BlockPool, list[BlockTable], BlockTable]:
    """The case's pool (random K/V in 2 layers of 2 heads), the other tables, and this one."""
    _, bs, num_blocks, others, (blocks, length), _, order, hashed = case
    pool = BlockPool(_config(2, 2, 3), num_blocks, bs)
    g = torch.Generator().manual_seed(seed)
    for t in pool.keys + pool.values:
        t.copy_(torch.randn(t.shape, generator=g))
    tables = [BlockTable(i, list(b), n) for i, (b, n) in enumerate(others)]
    mine = BlockTable(len(tables), list(blocks), length)
    pool.ref = [sum(b in t.blocks for t in tables + [mine]) for b in range(num_blocks)]
    pool.free = deque(b for b in (range(num_blocks) if order is None else order)
                      if pool.ref[b] == 0)
    assert sorted(pool.free) == [b for b in range(num_blocks) if pool.ref[b] == 0], case[0]
    for b in hashed:
        h = block_hash("a finished prompt", [b])
        pool.by_hash[h], pool.hash_of[b] = b, h
    return pool, tables, mine


def _kv_differences(before: BlockPool, old: BlockTable, after: BlockPool,
                    new: BlockTable) -> list[tuple[int, bool]]:
    """(layer, values?) of the tensors read differently through `new` than through `old`."""
    def read(pool, table, layer, values):
        src, bs = (pool.values if values else pool.keys)[layer], pool.page_size
        return [src[table.blocks[p // bs], :, p % bs] for p in range(table.length)]
    return [(layer, values) for layer in range(len(before.keys)) for values in (False, True)
            if not all(torch.equal(a, b) for a, b in zip(read(before, old, layer, values),
                                                         read(after, new, layer, values)))]


NO_COPY = ("position {length} falls in block {block}, partly filled and shared (reference count "
           "{ref}): writing there would change the K/V of the other table(s) that read it. Copy "
           "it first (copy-on-write): a new block with the same K/V, in this table's place")
COPIED_FULL = ("block {block} is full: no position of it will be written, so it stays shared "
               "(copying it wastes a block). Only the block that position {length} falls in, "
               "table.blocks[{length} // block_size], can be written, and only when it is partly "
               "filled")
COPIED_UNSHARED = ("block {block} is held by this table alone (reference count 1): write into "
                   "it in place; copy a block only when another table holds it too (ref > 1)")
FLOOR = ("too few blocks: this is what you get with (length + n_new) // block_size, which rounds "
         "down; a partly filled block is still a block: ceil((length + n_new) / block_size)")
PER_NEW = ("this is what you get when you add ceil(n_new / block_size) blocks whatever the table "
           "has: the last block's empty slots come first; new blocks only for the positions past "
           "len(table.blocks) * block_size")
NOT_RELEASED = ("the copied block's reference count must drop by one: this table no longer "
                "holds it (pool.release(block, table.owner))")
NOT_FROM_FRONT = ("take free blocks with pool.allocate(owner): it takes the block at the front of "
                  "pool.free, the one free the longest, whose cached K/V are the least likely to "
                  "be wanted again")
STILL_HASHED = ("block {block} was reallocated but is still findable by its old hash in "
                "pool.by_hash: the next prompt that starts with those tokens would share it and "
                "read this sequence's K/V. pool.allocate(owner) forgets the hash")
KV_COPY = {frozenset([True]): "you copied the keys but not the values: copy both, pool.keys and "
                              "pool.values",
           frozenset([False]): "you copied the values but not the keys: copy both, pool.keys and "
                               "pool.values"}


EMPTY_TABLE = ("a new request's table is empty (length 0): it has no last block to look at. Only "
               "a block the table already holds, partly filled (table.length % block_size != 0), "
               "can need a copy")
POOL_FULL = ("the pool ran out of free blocks: take only the blocks positions 0 .. length + n_new "
             "- 1 need")


def _check_reserve_case(name: str, case_id: int, case: tuple, reserve) -> None:
    label, bs, _, others, (blocks0, length), n_new, _, _ = case
    where = (f"{label}: block_size={bs}, table.blocks={blocks0}, table.length={length}, "
             f"n_new={n_new}")
    pool, tables, mine = reserve_pool(case, 660 + case_id)
    before, want_pool, want = copy.deepcopy(pool), copy.deepcopy(pool), copy.deepcopy(mine)
    ref0, free0 = list(pool.ref), list(pool.free)
    PagedCache(want_pool, [want]).reserve(n_new)  # the engine, on a copy
    with forbid(name, PagedCache.reserve, BlockPool.reserve, BlockPool.blocks_needed,
                BlockPool.copy_on_write):
        call_hinted(name, where, lambda e: EMPTY_TABLE if isinstance(e, IndexError) and not
                    blocks0 else POOL_FULL if isinstance(e, MemoryError) else
                    "your function raised on this input", reserve, pool, mine, n_new)
    got, n_want = mine.blocks, len(want.blocks)
    expect(mine.length == length, name, where, f"table.length = {length}",
           f"table.length = {mine.length}", "reserve makes room and writes nothing: the length "
           "moves when the pass writes the K/V (PagedCache.update)")
    expect(len(set(got)) == len(got), name, where, f"{n_want} distinct blocks", got,
           "a block appears twice in the table")
    # the blocks the table had: kept, except a shared partly filled block, copied
    for j, b0 in enumerate(blocks0):
        if j >= len(got):
            fail(name, where, f"table.blocks starting like {want.blocks[:len(blocks0)]}", got,
                 "reserve only adds blocks (or puts a copy in a shared block's place): the "
                 "table lost one")
        if want.blocks[j] != b0 and got[j] == b0:
            fail(name, where, f"block {b0} replaced by a copy", got,
                 NO_COPY.format(length=length, block=b0, ref=ref0[b0]))
        if want.blocks[j] == b0 and got[j] != b0:
            fail(name, where, f"table.blocks[{j}] = {b0}", f"table.blocks[{j}] = {got[j]}",
                 COPIED_UNSHARED.format(block=b0) if length % bs and j == length // bs else
                 COPIED_FULL.format(block=b0, length=length) if j < _ceil(length, bs) else
                 "a block the table already holds for later positions stays where it is")
    if len(got) != n_want:
        fail(name, where, f"{n_want} blocks (ceil(({length} + {n_new}) / {bs}) = {n_want})",
             f"{len(got)} blocks: {got}", (
                 FLOOR if len(got) == max(len(blocks0), (length + n_new) // bs) else
                 f"too few blocks: the table must hold positions 0 .. {length + n_new - 1}")
             if len(got) < n_want else PER_NEW if len(got) == len(blocks0) + _ceil(n_new, bs)
             else f"more blocks than positions 0 .. {length + n_new - 1} need: a block taken "
                  f"before it is needed is a block another request cannot use")
    taken = [b for b in got if b not in blocks0]
    for b in taken:
        expect(ref0[b] == 0, name, where, "new blocks taken from pool.free",
               f"block {b} (reference count {ref0[b]})", f"block {b} is held by another table: "
               f"new blocks come from the free list (pool.allocate(owner))")
    expect(sorted(taken) == sorted(free0[:len(taken)]), name, where,
           f"the first {len(taken)} free blocks {free0[:len(taken)]}", f"blocks {taken}",
           NOT_FROM_FRONT)
    # the pool's books: counts, free list, hashes
    counts = [sum(b in t.blocks for t in tables + [mine]) for b in range(len(ref0))]
    for b in (b for b in range(len(counts)) if pool.ref[b] != counts[b]):
        fail(name, where, f"pool.ref[{b}] = {counts[b]}", f"pool.ref[{b}] = {pool.ref[b]}",
             NOT_RELEASED if b in blocks0 and b not in got else
             "a block just taken is held by this table alone: reference count 1" if b in taken
             else "pool.ref[b] counts the tables that hold block b")
    free = [b for b in free0 if b not in taken]
    expect(list(pool.free) == free, name, where, f"pool.free = {free}",
           f"pool.free = {list(pool.free)}", "pool.free lists the blocks nobody holds, the "
           "longest free first: a block you take leaves it (pool.allocate does this), the others "
           "keep their order")
    for b in taken:
        expect(b not in pool.hash_of and before.hash_of.get(b) not in pool.by_hash, name, where,
               f"block {b} no longer in pool.by_hash", "still there", STILL_HASHED.format(block=b))
    expect(pool.by_hash == {h: b for h, b in before.by_hash.items() if b not in taken}, name,
           where, "the other hashes left alone", "pool.by_hash changed",
           "only a reallocated block loses its hash")
    # the K/V every table reads: the others' untouched, this one's the same through its copy
    for t in tables:
        expect(not _kv_differences(before, t, pool, t), name, where,
               f"table {t.owner}'s K/V unchanged", "changed", "you wrote into a block another "
               "table reads: reserve only copies FROM a shared block, into a block this table "
               "alone will hold")
    diff = _kv_differences(before, BlockTable(mine.owner, list(blocks0), length), pool, mine)
    if diff:
        layers = sorted({layer for layer, _ in diff})
        fail(name, where, f"positions 0 .. {length - 1} read the same K/V through the new table",
             f"different K/V in layer(s) {layers}", KV_COPY.get(frozenset(v for _, v in diff))
             or ("you copied layer 0 only: pool.keys and pool.values hold one tensor per layer; "
                 "copy the block in every layer" if 0 not in layers else
                 "the copy must hold the shared block's K/V: for every layer l, "
                 "pool.keys[l][new] = pool.keys[l][old], and the same for pool.values"))


@guarded
def check_reserve(reserve) -> None:
    """reserve(pool, table, n_new): room for n_new more positions, as PagedCache.reserve."""
    for i, case in enumerate(RESERVE_CASES):
        _check_reserve_case("reserve", i, case, reserve)
    passed("reserve", len(RESERVE_CASES))


# --- exercise 3 (a table): a prompt's cached prefix blocks ----------------------------------------

def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def published(bs: int, prompts: list[tuple[list[int], list[int]]]) -> dict[str, int]:
    """by_hash as the server leaves it after these (prompt, blocks) were admitted, in order: each
    prompt's full blocks, known by their chained hashes (a hash already known keeps its block)."""
    by_hash: dict[str, int] = {}
    for prompt, blocks in prompts:
        h = ""
        for i in range(len(prompt) // bs):
            h = block_hash(h, prompt[i * bs:(i + 1) * bs])
            by_hash.setdefault(h, blocks[i])
    return by_hash


def _matching_cases() -> list[tuple[_Labelled, int, dict[str, int]]]:
    """(prompt labelled with what the case is about, block_size, by_hash)."""
    P, T, U, V, W, X = (_tokens(s, n) for s, n in ((1, 12), (2, 4), (3, 4), (4, 4), (5, 4),
                                                     (6, 8)))
    cached = published(4, [(P, [5, 2, 8])])
    hole = dict(cached)
    del hole[block_hash(block_hash("", P[:4]), P[4:8])]  # block 2 was reallocated
    shared, q1, q2 = _tokens(7, 200), _tokens(8, 20), _tokens(9, 30)
    cases = [
        ("its second block's tokens start another cached prompt (same tokens, another "
         "beginning)", T + U + [7], 4, published(4, [(T + V, [1, 3]), (U + W, [6, 9])])),
        ("a cached block and one token more", P[:4] + [1], 4, cached),
        ("its first two full blocks were computed for another prompt; its third is partly "
         "filled", P[:8] + [7, 8, 9], 4, cached),
        ("the same tokens as a cached prompt, ending exactly on a block boundary", P, 4, cached),
        ("the cached prompt and one token more", P + [1], 4, cached),
        ("a hole: the cached prompt's second block was reallocated (its hash is gone), its third "
         "is still there", P + [1], 4, hole),
        ("a different first block, then the cached prompt's second and third", [1, 2, 3, 4]
         + P[4:] + [9], 4, cached),
        ("nothing cached", P + [1], 4, {}),
        ("a prompt shorter than a block", P[:3], 4, cached),
        ("a prompt of exactly one block", P[:4], 4, cached),
        ("two cached prompts that share their first block", P[:4] + X + [1], 4,
         published(4, [(P, [5, 2, 8]), (P[:4] + X, [5, 4, 0])])),
        ("the chapter's shared 200-token prefix, blocks of 16", shared + q2, 16,
         published(16, [(shared + q1, list(range(20, 34)))])),
        ("blocks of 1 token", [5, 6, 7], 1, published(1, [([5, 6, 7, 8], [0, 1, 2, 3])])),
    ]
    return [(_Labelled(label, prompt), bs, by_hash) for label, prompt, bs, by_hash in cases]


def engine_shared_prefix(prompt: list[int], bs: int, by_hash: dict[str, int]) -> list[int]:
    """The server's own answer: BlockPool.cached_prefix on a pool holding these hashes."""
    pool = BlockPool(_config(1, 1, 1), 1 + max(by_hash.values(), default=0), bs)
    pool.by_hash = dict(by_hash)
    return pool.cached_prefix(list(prompt))


def _match(prompt, bs, by_hash, n_blocks=None, chained=True, stop=True, cumulative=False):
    """A prefix match (the right one), or with one of the usual mistakes."""
    blocks, h = [], ""
    for i in range(max((len(prompt) - 1) // bs if n_blocks is None else n_blocks, 0)):
        h = block_hash("" if cumulative or not chained else h,
                       prompt[:(i + 1) * bs] if cumulative else prompt[i * bs:(i + 1) * bs])
        if h in by_hash:
            blocks.append(by_hash[h])
        elif stop:
            break
    return blocks


def _show_prompt(prompt: list[int]) -> str:
    return (f"{prompt}" if len(prompt) <= 16 else
            f"[{', '.join(map(str, prompt[:6]))}, ... {len(prompt) - 8} more ..., "
            f"{prompt[-2]}, {prompt[-1]}]") + f" ({len(prompt)} tokens)"


def _block_ids(got, *case) -> list[int]:
    """The contract: a list of block ids (ints)."""
    if int_list(got) is not None:
        return int_list(got)
    if isinstance(got, (list, tuple)) and got and all(isinstance(x, str) for x in got):
        raise Refused("these are hashes: return the blocks by_hash maps them to, by_hash[h]")
    raise Refused("return a list of block ids (ints), the blocks the new table starts with")


MATCH_HINT = ("walk the prompt's full blocks from the first: h = block_hash(h, tokens of block "
              "i), starting from h = '' (the empty string); while by_hash has h, the block is "
              "by_hash[h]; stop at the first miss, and leave at least one prompt token")


def _matching_otherwise(answers) -> str:
    got, want = next((got, engine_shared_prefix(*case)) for case, got in answers
                     if got != engine_shared_prefix(*case))
    return ("no block found: " if not got and want else "") + MATCH_HINT


MATCHING = Exercise(
    "matching_blocks", cases=_matching_cases(),
    describe=lambda prompt, bs, by_hash: (f"{prompt.label}: prompt={_show_prompt(prompt)}, "
                                          f"block_size={bs}"),
    reference=engine_shared_prefix, solution=_match, returns=_block_ids,
    forbid=(BlockPool.cached_prefix,),
    unchanged="matching only looks blocks up: the pool's hashes change when blocks are published "
              "or reallocated, not here",
    mistakes={
        "this is what you get when you go on after a miss: the table would have a hole, a block "
        "whose K/V nobody computed for this prompt. The prefix ends at the first block not found":
            partial(_match, stop=False),
        "this is what you get when you match every full block of a prompt that ends on a block "
        "boundary: nothing would be left to compute, and the first new token is read from the "
        "logits of the prompt's last token. Leave at least one token: look at the first "
        "(len(prompt) - 1) // block_size blocks":
            lambda prompt, bs, by_hash: _match(prompt, bs, by_hash, len(prompt) // bs),
        "this is what you get when you always leave the last full block: only one token must be "
        "left, so a prompt that does not end on a block boundary can share all its full blocks: "
        "(len(prompt) - 1) // block_size of them":
            lambda prompt, bs, by_hash: _match(prompt, bs, by_hash, len(prompt) // bs - 1),
        "this is what you get when you hash the whole prefix from the start with '' as the "
        "previous hash: the engine's hash is block_hash(hash of the previous block, this block's "
        "tokens), one block at a time": partial(_match, cumulative=True),
        "this is what you get when you hash each block's tokens alone (block_hash('', tokens)): "
        "the same tokens after another beginning have other keys and values, since every token "
        "attends to all before it. Chain: pass the previous block's hash":
            partial(_match, chained=False),
    },
    otherwise=_matching_otherwise)
check_matching_blocks = MATCHING.check


# --- exercise 4 (a table): the admission rule ----------------------------------------------------

class _Pool(BlockPool):
    """A case's pool, its `label`, the request's prompt and tokens; equal when the books are."""

    def __eq__(self, other) -> bool:
        return (self.ref, list(self.free), self.by_hash) == (other.ref, list(other.free),
                                                             other.by_hash)


def _admission_cases() -> list[tuple]:
    """(what the case is about, block_size, running requests' blocks, cached (prompt, blocks)
    with the blocks no running request holds left free, the request's prompt, the tokens it had
    produced before a preemption, free blocks beyond what the rule needs: 0 exactly enough, -1
    one short, ...)."""
    C, D, E = _tokens(11, 14), _tokens(12, 10), _tokens(13, 12)
    edges = [
        ("a prompt whose first 3 blocks a running request holds", 4, [[0, 1, 2, 3]],
         [(C, [0, 1, 2, 3])], C[:12] + _tokens(21, 5), [], (0, -1)),
        ("a finished request's prompt blocks: free, but still holding its K/V", 4,
         [[0, 1], [2, 3]], [(C, [4, 5, 6, 7])], C[:12] + _tokens(22, 3), [], (-1, 0)),
        ("shared blocks: the first held by a running request, the next two free but cached", 4,
         [[0, 1, 2]], [(C, [0, 3, 4, 5])], C[:12] + _tokens(23, 2), [], (-1, 0)),
        ("two shared blocks that two running requests both hold (reference count 2)", 4,
         [[0, 1, 2], [0, 1, 3]], [(E, [0, 1, 2])], E[:8] + _tokens(24, 6), [], (-1, 0)),
        ("a prompt shorter than a block, nobody running", 4, [], [], _tokens(25, 3), [], (0, -1)),
        ("9 tokens: 3 blocks, the last holding one token", 4, [[0, 1]], [], _tokens(26, 9), [],
         (-1, 0, -2)),
        ("a preempted request: its prompt's blocks free but cached, and the 7 tokens it had "
         "produced", 4, [[0, 1, 2]], [(D, [3, 4, 5])], D, _tokens(27, 7), (0, -1)),
        ("three running requests, a prompt ending on a block boundary", 4, [[0], [1], [2]], [],
         _tokens(28, 8), [], (-1, 0, -3)),
        ("a full pool", 4, [[0, 1, 2, 3]], [], _tokens(29, 5), [], (-4,)),
        ("plenty of free blocks", 16, [[0, 1], [2]], [], _tokens(30, 40), [], (5,)),
    ]
    return [case[:-1] + (slack,) for case in edges for slack in case[-1]]


def admission_state(case: tuple) -> tuple[_Pool, int, list[int], int]:
    """can_admit's arguments for the case: the pool (just the books: reference counts, free list,
    hashes), n_tokens (prompt + produced), the blocks its prompt shares, and n_running."""
    label, bs, running, cached, prompt, produced, slack = case
    used = {b for blocks in running for b in blocks} | {b for _, bl in cached for b in bl}
    top = 1 + max(used, default=-1)
    ref = [sum(b in blocks for blocks in running) for b in range(top)]
    by_hash = published(bs, cached)
    shared = engine_shared_prefix(prompt, bs, by_hash)
    held = [b for b in shared if ref[b] > 0]
    need = _ceil(len(prompt) + len(produced), bs) - len(held) + 1 + len(running)  # for the edge
    extra = max(0, need + slack - ref.count(0))
    pool = _Pool(_config(1, 1, 1), top + extra, bs)
    pool.ref = ref + [0] * extra
    pool.free = deque(b for b in range(top + extra) if pool.ref[b] == 0)
    pool.by_hash, pool.hash_of = dict(by_hash), {b: h for h, b in by_hash.items()}
    pool.label, pool.prompt, pool.tokens = label, list(prompt), list(prompt) + list(produced)
    return pool, len(pool.tokens), shared, len(running)


def engine_admits(pool: _Pool, n_tokens: int, shared: list[int], n_running: int) -> bool:
    """The server's answer: its scheduler's admission rule on the case's pool."""
    s = Sequence(99, Request(list(pool.prompt), 1), list(pool.prompt), False)
    s.tokens = list(pool.tokens)
    scheduler = Scheduler(copy.deepcopy(pool), None)
    scheduler.running = [object()] * n_running
    _, blocks, tokens = scheduler.admission(s)
    return scheduler.policy.fits(scheduler, s, blocks, tokens)


def _held(pool, shared) -> int:
    return sum(pool.ref[b] > 0 for b in shared)


def _rule(held=_held, blocks=_ceil, headroom=lambda r: 1 + r, strict=False):
    """The admission rule (the right one), or with one of the usual mistakes."""
    def can_admit(pool, n_tokens, shared, n_running):
        need = blocks(n_tokens, pool.page_size) - held(pool, shared) + headroom(n_running)
        return pool.n_free > need if strict else pool.n_free >= need
    return can_admit


def _a_bool(got, *case) -> bool:
    """The contract: a bool (Python's or numpy's)."""
    if isinstance(got, bool) or (type(got).__module__ == "numpy"
                                 and type(got).__name__ in ("bool_", "bool")):
        return bool(got)
    kind_of = f"{type(got).__module__}.{type(got).__name__}".replace("builtins.", "")
    raise Refused(f"return True or False (a bool), not {kind_of}")


def _admission_otherwise(answers) -> str:
    pool, n_tokens, shared, r = next(case for case, got in answers if got != engine_admits(*case))
    blocks, held = _ceil(n_tokens, pool.page_size), _held(pool, shared)
    return (f"here the request's {blocks} block(s) less {held} shared block(s) held by running "
            f"requests take {blocks - held} free block(s), and headroom is one block for it and "
            f"one for each of the {r} running: {blocks - held + 1 + r} needed, {pool.n_free} free")


ADMISSION = Exercise(
    "can_admit", cases=[admission_state(case) for case in _admission_cases()],
    describe=lambda pool, n_tokens, shared, n_running: (
        f"{pool.label}: pool.page_size={pool.page_size}, pool.n_free={pool.n_free}, "
        f"n_tokens={n_tokens}, shared={shared} (reference counts "
        f"{[pool.ref[b] for b in shared]}), n_running={n_running}"),
    reference=engine_admits, solution=_rule(), returns=_a_bool,
    forbid=(Scheduler.admission, FirstComeFirstServed.fits, BlockPool.cached_prefix),
    unchanged="can_admit only decides: taking the blocks is what the server does next, once the "
              "request is admitted",
    mistakes={
        "this is what you get when you subtract the shared blocks' reference counts: a block held "
        "by two requests is still one block; count the shared blocks with ref > 0, once each":
            _rule(held=lambda pool, shared: sum(pool.ref[b] for b in shared)),
        "this is what you get when the shared blocks cost free blocks: a shared block a running "
        "request holds (ref > 0) is reused as it is, and takes nothing from the free list":
            _rule(held=lambda pool, shared: 0),
        "this is what you get when every shared block is free of charge: a shared block nobody "
        "holds (ref 0: a finished request's, still cached) is on the free list, and sharing it "
        "takes it off; only the shared blocks with ref > 0 cost nothing":
            _rule(held=lambda pool, shared: len(shared)),
        "this is what you get with n_tokens // block_size, which rounds down: a partly filled "
        "last block is a block too, ceil(n_tokens / block_size)":
            _rule(blocks=lambda n, bs: n // bs),
        "this is what you get without headroom for the running requests: each may need a new "
        "block at the next decode step (its next position starts a block), and a pool without one "
        "preempts a request the step after admitting this one; keep one free block per running "
        "request": _rule(headroom=lambda r: 1),
        "this is what you get without a block of headroom for the newcomer itself: after its "
        "prefill its first new token goes at position n_tokens, which starts a new block when "
        "n_tokens ends on a block boundary; it is one more running request":
            _rule(headroom=lambda r: r),
        "this is what you get with > instead of >=: exactly enough free blocks is enough":
            _rule(strict=True),
        "this is what you get when the prompt's blocks alone must fit: every running request, and "
        "the newcomer after its prefill, may need a new block at the next decode step; keep one "
        "free block for each": _rule(headroom=lambda r: 0),
    },
    otherwise=_admission_otherwise)
check_can_admit = ADMISSION.check


# --- exercise 5 (predict, then measure): blocks in use when samples share a prompt ----------------

PEAK_SAMPLES, PEAK_NEW, PEAK_BLOCK = 4, 7, 4
PEAK_KEYS = [(10, True), (12, True), (12, False)]  # (prompt tokens, prefix caching)


def measure_peak(prompt_len: int, prefix_caching: bool) -> int:
    """The peak for PEAK_SAMPLES requests with the same prompt, served on a tiny random model."""
    requests = [Request(list(range(100, 100 + prompt_len)), PEAK_NEW) for _ in range(PEAK_SAMPLES)]
    with torch.inference_mode():
        outs = serve(_tiny_model(), requests, page_size=PEAK_BLOCK, prefix_caching=prefix_caching,
                     trace=True)
    return max(sum(ref > 0 for ref in step.ref) for step in outs.pool_steps)


@functools.cache
def _tiny_model():
    return tiny_model(0)


def _peak_mistakes(prompt_len: int, prefix_caching: bool) -> list[tuple[int, str]]:
    n, bs = PEAK_SAMPLES, PEAK_BLOCK
    own = _ceil(prompt_len + PEAK_NEW - 1, bs)
    shared = (prompt_len - 1) // bs if prefix_caching else 0
    return [
        (n * _ceil(prompt_len + PEAK_NEW, bs) - (n - 1) * shared,
         "you gave the last new token K/V: it is produced by the last pass and never fed, so a "
         "request holds prompt + new - 1 positions"),
        (n * own, "you shared nothing: with prefix caching the samples after the first reuse the "
                  "prompt's full blocks (one copy, reference count 4)" if prefix_caching else
                  "right count per request, wrong total"),
        (n * own - (n - 1) * _ceil(prompt_len, bs),
         "you shared the prompt's partly filled last block too: only FULL blocks are shared (a "
         "partly filled one is written by every sample, so each needs its own)"),
        (n * own - (n - 1) * (prompt_len // bs),
         "you shared every full block of the prompt: a prompt that ends on a block boundary "
         "shares one fewer, since at least one prompt token is left to compute (its logits give "
         "the first new token)"),
        (n * (prompt_len + PEAK_NEW - 1) // bs,
         "you rounded down: a partly filled block is a whole block"),
    ] + ([] if prefix_caching else [(
        n * own - (n - 1) * ((prompt_len - 1) // bs), "without prefix caching nothing is shared: "
        "every request computes and holds its own prompt blocks")])


@one_thread
@guarded
def check_predict_peak_blocks(predict_peak_blocks) -> None:
    """predict_peak_blocks() -> {(prompt tokens, prefix caching): the most blocks in use}."""
    name = "predict_peak_blocks"
    case = (f"{PEAK_SAMPLES} requests with the same prompt, {PEAK_NEW} new tokens each, arriving "
            f"together, blocks of {PEAK_BLOCK}, a large pool")
    got = prediction(name, case, predict_peak_blocks, serve, PagedCache.reserve,
                     BlockPool.allocate)
    if not isinstance(got, dict) or sorted(got) != sorted(PEAK_KEYS):
        fail(name, case, f"a dict with the keys {PEAK_KEYS}",
             sorted(got) if isinstance(got, dict) else got,
             "one prediction per (prompt tokens, prefix caching) pair, as ints"
             + (" (did you forget to return it?)" if got is None else ""))
    for key in PEAK_KEYS:
        expect(type(got[key]) is int, name, f"{case}: {key}", "an int", got[key],
               "blocks come whole: an int")
    measured = {key: measure_peak(*key) for key in PEAK_KEYS}
    for (prompt_len, caching), you in ((key, got[key]) for key in PEAK_KEYS):
        want = measured[prompt_len, caching]
        reason = "; or ".join(dict.fromkeys(h for w, h in _peak_mistakes(prompt_len, caching)
                                            if w == you and w != want)) or (
            "per request: the positions it holds at the end (prompt + new tokens - 1), in "
            "blocks of 4; then which of those blocks the requests hold together")
        expect(you == want, name, f"{case}: a {prompt_len}-token prompt, prefix caching "
               f"{'on' if caching else 'off'}", want, you,
               f"you predicted {you} blocks; the engine used {want} at most: {reason}")
    print("  measured: " + "; ".join(
        f"{p}-token prompt, prefix caching {'on' if c else 'off'}: {measured[p, c]} blocks"
        for p, c in PEAK_KEYS))
    passed(name, len(PEAK_KEYS))


# --- exercise 6 (debug): giving blocks back on a rollback ----------------------------------------

class BuggyPagedCache(PagedCache):
    """The notebook's broken rollback, verbatim: it gives back the block that still holds the
    sequence's last positions whenever the new length is not a multiple of block_size."""

    def crop(self, max_length):
        t, bs = self.tables[0], self.pool.page_size
        t.length = max_length
        while len(t.blocks) * bs > max_length:        # a block past the end goes back
            self.pool.release(t.blocks.pop(), t.owner)


# (what the case is about, block_size, this table (blocks, length), others' blocks, new length)
CROP_CASES = [
    ("a rollback to the middle of a block", 4, ([3, 0, 5], 11), [], 6),
    ("a rollback to a block boundary", 4, ([3, 0, 5], 11), [], 8),
    ("a rollback that keeps every block", 4, ([2, 6], 8), [], 7),
    ("a rollback to one position", 4, ([1, 4, 2], 12), [], 1),
    ("a rollback past a block another sequence shares (reference count 2)", 4,
     ([0, 1, 2, 3], 14), [[0, 1, 2, 5]], 5),
    ("a rollback in blocks of 16, through a reserved block past the end", 16,
     ([4, 1, 7], 33), [], 20),
    ("a rollback from full blocks to the middle of one", 4, ([3, 0, 5], 12), [], 6),
    ("blocks of 1 position", 1, ([5, 2, 7, 1], 4), [], 2),
]


def crop_pool(case):
    """The case's pool (just the books), the tables of the others, and this table."""
    _, bs, (blocks, length), others, _ = case
    num_blocks = max(set(blocks) | {b for o in others for b in o}) + 3
    pool = BlockPool(_config(1, 1, 1), num_blocks, bs)
    tables = [BlockTable(i + 1, list(o), len(o) * bs) for i, o in enumerate(others)]
    mine = BlockTable(0, list(blocks), length)
    pool.ref = [sum(b in t.blocks for t in tables + [mine]) for b in range(num_blocks)]
    pool.free = deque(b for b in range(num_blocks) if pool.ref[b] == 0)
    return pool, tables, mine


CROP_SYMPTOM = ("symptom: a rollback to a length that is not a multiple of block_size gives back "
                "the block that still holds the sequence's last positions; the next pass writes "
                "into a fresh block and reads garbage where those positions were (and the block "
                "given back may already be another request's). A block goes back only when it "
                "lies wholly past the new length: while its FIRST position is at or past it")


def _cropped(cache_class, case) -> tuple:
    """(table.blocks, length, pool.ref, pool.free) after cache_class's crop on the case."""
    pool, _, mine = crop_pool(case)
    cache_class(pool, [mine]).crop(case[-1])
    return mine.blocks, mine.length, pool.ref, list(pool.free)


@guarded
def check_crop(cache_class) -> None:
    """cache_class(pool, [table]).crop(n), against PagedCache.crop, then in a rollback decode."""
    name = "crop"
    if not (isinstance(cache_class, type) and issubclass(cache_class, PagedCache)):
        fail(name, "the class", "a subclass of PagedCache (of BuggyPagedCache)", cache_class,
             "pass the class itself, with its crop method fixed")
    same_as_buggy = 0
    for case in CROP_CASES:
        label, bs, (blocks0, length), others, n = case
        where = f"{label}: block_size={bs}, table.blocks={blocks0}, length {length} → {n}"
        with forbid(name, PagedCache.crop, BlockPool.crop):
            state = call_hinted(name, where, lambda e: "your crop raised on this input",
                                _cropped, cache_class, case)
        want, buggy = _cropped(PagedCache, case), _cropped(BuggyPagedCache, case)
        same_as_buggy += state == buggy
        if state[:2] != want[:2]:
            fail(name, where, f"table.blocks={want[0]}, length {want[1]}",
                 f"table.blocks={state[0]}, length {state[1]}",
                 "this is BuggyPagedCache's crop unchanged: " + CROP_SYMPTOM
                 if state[:2] == buggy[:2] else CROP_SYMPTOM if len(state[0]) < len(want[0])
                 else "a block that lies wholly past the new length holds nothing of the "
                      "sequence any more: give it back (pool.release), or it is lost to every "
                      "other request" if len(state[0]) > len(want[0])
                 else "the table's length is the new length" if state[1] != want[1]
                 else "give back the blocks past the end with pool.release(block, owner), last "
                      "first")
        if state[2:] != want[2:]:
            shared = [b for b in blocks0 if b not in state[0] and want[2][b] > 0]
            fail(name, where, f"pool.ref={want[2]}, pool.free={want[3]}",
                 f"pool.ref={state[2]}, pool.free={state[3]}",
                 "block {b} is shared (another sequence holds it too): giving it back drops "
                 "ONE reference; it is free only when nobody holds it. pool.release does "
                 "both".format(b=shared[0]) if shared and state[2][shared[0]] == 0 else
                 "give blocks back with pool.release(block, owner): it lowers the reference "
                 "count and puts the block on the free list when nobody holds it")
    if same_as_buggy == len(CROP_CASES):
        fail(name, "every case", "a fixed crop", "BuggyPagedCache's results",
             "this is the buggy crop unchanged: " + CROP_SYMPTOM)
    _check_crop_in_decoding(name, cache_class)
    passed(name, len(CROP_CASES) + 1)


def _check_crop_in_decoding(name, cache_class) -> None:
    """Greedy verify-and-rollback decoding on cache_class must give target-only greedy tokens."""
    model, prompt, n_new = _tiny_model(), [3, 17, 200, 41, 9, 77, 5], 24
    seq, case = list(prompt), "greedy decoding on a paged cache with your crop, every round " \
                              "rolled back"

    def verifier(rows, cache):
        cache.reserve(len(rows))
        return model(torch.tensor([rows]), cache=cache)[0]

    @torch.inference_mode()
    def decode():
        cache = cache_class(BlockPool(model.config, 40, 4), [BlockTable(0)])
        cache.reserve(len(prompt))
        seq.append(int(model(torch.tensor([prompt]), cache=cache)[0, -1].argmax()))
        # proposals unrelated to the text: refused, so the cache rolls back at every remainder
        for step in range(n_new):
            if len(seq) - len(prompt) < n_new:
                verify_and_commit(seq, [(seq[-1] * 7 + i + step) % model.config.vocab_size
                                        for i in range(1 + step % 3)], cache, verifier,
                                  partial(accept_matching, sampling=SamplingParams(),
                                          first_position=len(seq)))
    call_hinted(name, case, lambda e: "the table lost a block it still needed and the next pass "
                "found no slot for a position: " + CROP_SYMPTOM, decode)
    new, alone = seq[len(prompt):len(prompt) + n_new], generate(model, prompt, n_new).tokens
    if new != alone:
        at = next(i for i, (a, b) in enumerate(zip(new, alone)) if a != b)
        fail(name, case, f"target-only greedy: {alone}", new,
             f"the text goes wrong at new token {at}: " + CROP_SYMPTOM)


# --- exercise 7 (design, a table): a block size for a memory budget ------------------------------

BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)


def blocks_taken(lengths: list[int], block_size: int) -> int:
    """Blocks PagedCache.reserve takes for sequences of these lengths, one table each."""
    pool = BlockPool(_config(1, 1, 1), max(sum(_ceil(n, block_size) for n in lengths), 1),
                     block_size)
    for i, n in enumerate(lengths):
        PagedCache(pool, [BlockTable(i)]).reserve(n)
    return pool.num_blocks - pool.n_free


def _largest(ok) -> int:
    return max([bs for bs in BLOCK_SIZES if ok(bs)], default=1)


def reference_block_size(lengths: list[int], max_waste: float) -> int:
    return _largest(lambda bs: blocks_taken(lengths, bs) * bs <= (1 + max_waste) * sum(lengths))


def _snapshots() -> list[_Labelled]:
    """The positions each running sequence holds, labelled with what the snapshot is."""
    g = random.Random(6)
    chat = [g.randint(5, 40) for _ in range(64)]
    mixed = [g.randint(6, 80) + int(math.exp(g.uniform(math.log(4), math.log(127))))
             for _ in range(48)]
    documents = [g.randint(900, 2000) for _ in range(4)]
    return [_Labelled("48 sequences of a mixed workload (prompts of 6-80 tokens, outputs of "
                      "4-127)", mixed), _Labelled("64 short chat turns of 5-40 tokens", chat),
            _Labelled("4 long documents of 900-2000 tokens", documents),
            _Labelled("sequences whose lengths are all multiples of 64", [64, 192, 320, 128])]


DESIGN_BUDGETS = (0.0, 0.05, 0.1, 0.25)


def _reserved(lengths, bs) -> str:
    held, taken = sum(lengths), blocks_taken(lengths, bs) * bs
    return f"{taken:,} positions reserved for {held:,} held, {100 * (taken / held - 1):.1f}% waste"


BLOCK_SIZE = Exercise(
    "choose_block_size", cases=[(lengths, w) for lengths in _snapshots() for w in DESIGN_BUDGETS],
    describe=lambda lengths, max_waste: f"{lengths.label}, max_waste={max_waste}",
    reference=reference_block_size,
    explain=lambda lengths, w: _reserved(lengths, reference_block_size(lengths, w)),
    returns=one_of(*BLOCK_SIZES, hint=f"return one of {BLOCK_SIZES}, as an int"),
    mistakes={
        "the waste is measured against the positions HELD: reserved ≤ (1 + max_waste) × held":
            lambda lengths, w: _largest(lambda bs: blocks_taken(lengths, bs) * bs * (1 - w)
                                        <= sum(lengths)),
        "exactly on the budget is within it: ≤, not <":
            lambda lengths, w: _largest(lambda bs: blocks_taken(lengths, bs) * bs
                                        < (1 + w) * sum(lengths)),
        "block size 1 never wastes a position (it is always within the budget), but a block per "
        "position is the slowest for the attention kernel, which reads a block at a time: the "
        "goal is the LARGEST block size within the budget": lambda lengths, w: 1,
        "you rounded the blocks down: a sequence's partly filled last block is a whole block":
            lambda lengths, w: _largest(lambda bs: sum(n // bs for n in lengths) * bs
                                        <= (1 + w) * sum(lengths)),
        "16 is vLLM's default, not this workload's answer: measure the waste at each size":
            lambda lengths, w: 16,
    },
    otherwise="for each block size: the blocks every sequence needs, times the block size, "
              "against the positions held")
check_choose_block_size = BLOCK_SIZE.check



# --- exercise 8: chunked prefill's schedule, by hand ---------------------------------------------

SCHEDULE_NEW = 64  # new tokens per request: every finished prompt decodes to the end of the case


def _schedule_cases() -> list[tuple[_Labelled, int]]:
    """(prompt lengths, labelled with what the case is about, budget); every budget leaves a
    prompt at least one token a step (budget > requests), so every schedule ends."""
    cases = [("three prompts, the first shorter than the budget", [5, 40, 12], 16),
             ("one long prompt alone", [30], 8),
             ("three prompts that each fill the budget exactly", [8, 8, 8], 9),
             ("a long prompt first, then short ones that wait for it", [64, 1, 1], 32),
             ("four prompts, a budget barely above the requests", [1, 2, 3, 4], 5),
             ("two prompts that fit in one step", [10, 10], 20),
             ("many decode rows eating into a small budget", [3, 50, 7, 20], 10),
             ("a budget of 6 for three prompts", [17, 33, 5], 6)]
    return [(_Labelled(label, lens), budget) for label, lens, budget in cases]


def engine_schedule(prompt_lens: list[int], budget: int) -> list[list[int]]:
    """The server's answer: serve the prompts (all arriving at step 0) under chunked prefill
    (FirstComeFirstServed(budget, chunked_prefill=True)) and read from the trace the prompt
    tokens each request computed in each step."""
    from ...engine.scheduler import FirstComeFirstServed
    requests = [Request([1 + (7 * i + k) % 500 for k in range(n)], SCHEDULE_NEW)
                for i, n in enumerate(prompt_lens)]
    policy = FirstComeFirstServed(budget, chunked_prefill=True)
    outs = serve(_tiny_model(), requests, policy=policy, trace=True)
    steps: dict[int, list[int]] = {}
    for i, o in enumerate(outs):
        for e in o.trace:
            if e.kind in ("chunk", "prefill"):
                steps.setdefault(e.step, [0] * len(prompt_lens))[i] = e.kv_computed
    return [steps.get(s, [0] * len(prompt_lens)) for s in range(max(steps) + 1)]


def _schedule_rule(decodes_first=True, same_step=False, oldest_first=True, even=False):
    """The schedule by the rule (the right one), or with one of the usual mistakes."""
    def chunk_schedule(prompt_lens, budget):
        rest, decoding, steps = list(prompt_lens), [False] * len(prompt_lens), []
        while any(rest) and len(steps) < 1000:
            left = budget - sum(decoding) if decodes_first else budget
            order = range(len(rest)) if oldest_first else reversed(range(len(rest)))
            waiting = [i for i in order if rest[i]]
            chunks = [0] * len(rest)
            for k, i in enumerate(waiting):
                share = -(-left // (len(waiting) - k)) if even else left
                chunks[i] = max(0, min(rest[i], share))
                left -= chunks[i]
                if same_step and chunks[i] == rest[i]:  # its decode row counted at once
                    left -= 1
            for i, n in enumerate(chunks):
                rest[i] -= n
                decoding[i] = decoding[i] or (n > 0 and rest[i] == 0)
            steps.append(chunks)
        return steps
    return chunk_schedule


def _a_schedule(got, prompt_lens, budget) -> list[list[int]]:
    """The contract: a list of steps, each a list of one chunk size (an int) per prompt."""
    if not isinstance(got, (list, tuple)) or not got:
        raise Refused("return a list of steps, each a list of chunk sizes (one int per prompt)")
    steps = [int_list(step) for step in got]
    if any(step is None or len(step) != len(prompt_lens) for step in steps):
        raise Refused(f"each step must be a list of {len(prompt_lens)} ints, one chunk size per "
                      f"prompt (0 when it gets none)")
    return steps


def _schedule_otherwise(answers) -> str:
    prompt_lens, budget = next(case for case, got in answers
                               if got != engine_schedule(*case))
    return (f"step by step: a token for each request whose prompt is done (from the step after "
            f"its last chunk), then what is left of the {budget} to the prompts, oldest first, "
            f"each at most what it has left")


SCHEDULE_CHUNKS = Exercise(
    "chunk_schedule", cases=_schedule_cases(),
    describe=lambda lens, budget: f"{lens.label}: prompt_lens={list(lens)}, budget={budget}",
    reference=engine_schedule, solution=_schedule_rule(), returns=_a_schedule,
    forbid=(serve,),
    unchanged="chunk_schedule only plans: keep prompt_lens as it was given (copy it to count down)",
    mistakes={
        "this is what you get when the prompts get the whole budget: from the step after its "
        "last chunk a request decodes, and its decode row takes one token of every step's budget "
        "first (a running request's next token must not wait); the prompts get what is left":
            _schedule_rule(decodes_first=False),
        "this is what you get when a request decodes in the step of its last chunk: that pass "
        "already gives its first token, so its first decode row is the next step's":
            _schedule_rule(same_step=True),
        "this is what you get when the newest prompt goes first: chunks go to the prompts oldest "
        "first, so the first to arrive is the first to get its first token":
            _schedule_rule(oldest_first=False),
        "this is what you get when the budget is shared evenly among the prompts: the oldest "
        "prompt takes all it can, and the next gets what is left":
            _schedule_rule(even=True),
    },
    otherwise=_schedule_otherwise)
check_chunk_schedule = SCHEDULE_CHUNKS.check

EXERCISES = (MATCHING, ADMISSION, BLOCK_SIZE, SCHEDULE_CHUNKS)
