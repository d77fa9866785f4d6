"""Checkers for chapter 06 (many requests: a paged KV cache, prefix caching, admission).

- gather_keys: one layer's keys read through a block table, against what the engine's PagedCache
  reads back for the same table (bit for bit), on random pools: tables out of order, a last block
  partly filled, a length ending on a block boundary, a block reserved past the end, blocks of 1
  to 16 positions. PagedCache's own read is forbidden.
- reserve: room for n_new more positions in one BlockTable of a real BlockPool, copying a shared,
  partly filled block before it is written; against the engine's PagedCache.reserve on a copy of
  the same pool, by what the result means (any blocks from the front of the free list, in any
  order): the table, every reference count, the free list, the hashes of reallocated blocks, and
  every table's K/V read through it (every layer, keys and values). PagedCache.reserve and
  BlockPool's reserve, blocks_needed and copy_on_write are forbidden.
- matching_blocks: a prompt's cached prefix blocks, against the pool's own cached_prefix on the
  same hashes: chained hashes, full blocks only, at least one prompt token left, nothing after the
  first miss (a hole left by a reallocated block). cached_prefix is forbidden.
- can_admit: the server's admission rule, against the scheduler's (Scheduler.admission and
  FirstComeFirstServed.fits) on a copy of the same pool, at the rule's edges (exactly enough free
  blocks, one short), with shared blocks that running requests hold and shared blocks that are
  free but cached. Those two are forbidden.

- predict_peak_blocks (predict, then measure): the most blocks in use when 4 requests share a
  prompt, with and without prefix caching, against serve() on a tiny model.
- crop (debug): a paged rollback, against PagedCache.crop on a copy of the same pool (blocks,
  length, reference counts, free list), then as the cache of a greedy verify-and-rollback
  decode against target-only decoding; the buggy class must not come back unchanged.
- choose_block_size (design): the largest block size within a waste budget for a snapshot of
  running sequences, measured with the engine's reserve.

Each usual mistake is recognised by what it produces, and named in the hint. Everything runs on the
CPU in about a second and leaves the caller's random state alone.
"""
from __future__ import annotations

import copy
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
    CheckFailed,
    call_hinted,
    fail,
    forbid,
    guarded,
    int_list,
    one_thread,
    passed,
    prediction,
    tiny_model,
)


def _kind(value) -> str:
    return f"{type(value).__module__}.{type(value).__name__}".replace("builtins.", "")


def _config(n_layer: int, n_head: int, head_dim: int) -> GPTConfig:
    return GPTConfig.preset("tiny", n_layer=n_layer, n_head=n_head, n_embd=n_head * head_dim)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


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


def _gather_pool(i: int, num_blocks: int, nh: int, bs: int, hs: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(600 + i)
    return torch.randn(num_blocks, nh, bs, hs, generator=g)


def engine_read(pool_keys: torch.Tensor, table: list[int], length: int) -> torch.Tensor:
    """What the engine's PagedCache reads back for a sequence of `length` positions in `table`,
    (nh, length, hs): one pass that writes its last position (the very key already there) returns
    every position it attends to."""
    num_blocks, nh, bs, hs = pool_keys.shape
    pool = BlockPool(_config(1, nh, hs), num_blocks, bs, dtype=pool_keys.dtype)
    pool.keys[0].copy_(pool_keys)
    pool.values[0].copy_(pool_keys)
    last = pool_keys[table[(length - 1) // bs], :, (length - 1) % bs]     # (nh, hs)
    new = last[None, :, None].clone()                                    # (1, nh, 1, hs)
    cache = PagedCache(pool, [BlockTable(0, list(table), length - 1)])
    with torch.no_grad():
        keys, _ = cache.update(new, new, 0)                              # (1, nh, length, hs)
    return keys[0]


def _slots(pool_keys: torch.Tensor, where: list[tuple[int, int]]) -> torch.Tensor:
    """The keys at (block, slot) after (block, slot), as (nh, len(where), hs)."""
    return torch.stack([pool_keys[b, :, s] for b, s in where], dim=1)


POOL_ORDER = ("this is what you get with the blocks in the order of their ids (sorted, or as "
              "they sit in the pool): a block table lists a sequence's blocks in POSITION order, "
              "and its ids can come in any order (blocks are taken from wherever the free list "
              "had them); position p is in block table[p // block_size]")
NO_TABLE = ("this is what you get when you read block p // block_size of the POOL, as if the "
            "sequence held the pool's first blocks: p // block_size is an index into the TABLE, "
            "and table[p // block_size] is the block")
NO_PERMUTE = ("this is what you get when you reshape pool_keys[table] (blocks, nh, block_size, "
              "hs) straight to (nh, -1, hs): reshape keeps the memory order, so it mixes heads "
              "and blocks. Bring the head axis first (.transpose(0, 1) gives (nh, blocks, "
              "block_size, hs)), then merge blocks and slots, then cut to length")
SWAPPED = ("this is what you get with block and slot swapped: the block is table[p // "
           "block_size], the slot inside it p % block_size")


def _gather_mistakes(pool_keys: torch.Tensor, table: list[int],
                     length: int) -> list[tuple[torch.Tensor | None, str]]:
    _, nh, bs, hs = pool_keys.shape
    n = _ceil(length, bs)

    def attempt(make):
        try:
            return make()
        except (IndexError, RuntimeError):
            return None
    return [
        (attempt(lambda: _slots(pool_keys, [(sorted(table)[p // bs], p % bs)
                                            for p in range(length)])), POOL_ORDER),
        (attempt(lambda: _slots(pool_keys, [(p // bs, p % bs) for p in range(length)])),
         NO_TABLE),
        (attempt(lambda: pool_keys[table[:n]].reshape(nh, -1, hs)[:, :length]), NO_PERMUTE),
        (attempt(lambda: pool_keys[table].reshape(nh, -1, hs)[:, :length]), NO_PERMUTE),
        (attempt(lambda: _slots(pool_keys, [(table[p % bs], p // bs) for p in range(length)])),
         SWAPPED),
    ]


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


def _gather_crash_hint(error: Exception) -> str:
    if isinstance(error, IndexError):
        return ("an index out of range: position p is in block table[p // block_size] (the "
                "table's entries are the block ids; p // block_size indexes the table), at slot "
                "p % block_size (0 to block_size - 1), for p = 0 .. length - 1")
    return "your function raised on this input"


def _where_from(pool_keys: torch.Tensor, row: torch.Tensor) -> str:
    """Which (block, slot) of the pool holds the (nh, hs) `row`, in words."""
    num_blocks, _, bs, _ = pool_keys.shape
    for b in range(num_blocks):
        for s in range(bs):
            if torch.equal(pool_keys[b, :, s], row):
                return f"pool_keys[{b}, :, {s}]"
    return "keys found in no single slot of the pool (heads or slots mixed up?)"


@guarded
def check_gather_keys(gather_keys) -> None:
    """gather_keys(pool_keys, table, length) -> (nh, length, hs): position p's keys are
    pool_keys[table[p // block_size], :, p % block_size], as the engine's PagedCache reads them."""
    name = "gather_keys"
    for i, (label, num_blocks, nh, bs, hs, table, length) in enumerate(GATHER_CASES):
        pool_keys = _gather_pool(i, num_blocks, nh, bs, hs)
        case = (f"{label}: pool_keys of shape {tuple(pool_keys.shape)} (blocks of {bs}), "
                f"table={table}, length={length}")
        want = engine_read(pool_keys, table, length)
        given, given_table = pool_keys.clone(), list(table)
        with forbid(name, PagedCache.update, PagedCache._indices):
            got = call_hinted(name, case, _gather_crash_hint, gather_keys, given, given_table,
                               length)
        if not torch.equal(given, pool_keys) or given_table != table:
            fail(name, case, "pool_keys and table left as they were", "they changed",
                 "reading through a table writes nothing: no in-place operation on the pool "
                 "or the table")
        if not isinstance(got, torch.Tensor):
            fail(name, case, f"a tensor of shape {tuple(want.shape)}", _kind(got),
                 "return a torch tensor (nh, length, hs): torch.stack or torch.cat the keys, or "
                 "index pool_keys"
                 + (" (did you forget to return it?)" if got is None else ""))
        if tuple(got.shape) != tuple(want.shape):
            fail(name, case, f"shape {tuple(want.shape)} (nh, length, hs)",
                 f"shape {tuple(got.shape)}",
                 _gather_shape_hint(tuple(got.shape), nh, bs, hs, table, length))
        if got.dtype != want.dtype:
            fail(name, case, f"dtype {want.dtype}", f"dtype {got.dtype}",
                 "return the pool's keys as they are, in the pool's dtype")
        if not torch.equal(got, want):
            p = int((got != want).any(dim=2).any(dim=0).nonzero()[0])
            hint = next((h for wrong, h in _gather_mistakes(pool_keys, table, length)
                         if wrong is not None and wrong.shape == got.shape
                         and not torch.equal(wrong, want) and torch.equal(wrong, got)),
                        "position p's keys are pool_keys[table[p // block_size], :, p % "
                        "block_size]: every head's, in position order")
            fail(name, case, f"position {p}: pool_keys[{table[p // bs]}, :, {p % bs}]",
                 f"position {p}: {_where_from(pool_keys, got[:, p])}", hint)
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


def _hash_of(block: int) -> str:
    return block_hash("a finished prompt", [block])


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
    order = range(num_blocks) if order is None else order
    pool.free = deque(b for b in order if pool.ref[b] == 0)
    assert sorted(pool.free) == [b for b in range(num_blocks) if pool.ref[b] == 0], case[0]
    for b in hashed:
        pool.by_hash[_hash_of(b)], pool.hash_of[b] = b, _hash_of(b)
    return pool, tables, mine


def _read(pool: BlockPool, table: BlockTable, layer: int, values: bool) -> torch.Tensor:
    """(nh, length, hs): the table's K (or V) of one layer, read through its blocks."""
    src = (pool.values if values else pool.keys)[layer]
    bs = pool.page_size
    return _slots(src, [(table.blocks[p // bs], p % bs) for p in range(table.length)]) \
        if table.length else src[:0, :, 0].transpose(0, 1)


def _kv_differences(before: BlockPool, old: BlockTable, after: BlockPool,
                    new: BlockTable) -> list[tuple[int, bool]]:
    """(layer, values?) of every tensor whose positions read differently through `new` in `after`
    than through `old` in `before`."""
    return [(layer, values) for layer in range(len(before.keys)) for values in (False, True)
            if not torch.equal(_read(before, old, layer, values), _read(after, new, layer, values))]


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


def _reserve_crash_hint(table_was_empty: bool):
    def hint(error: Exception) -> str:
        if isinstance(error, IndexError) and table_was_empty:
            return ("a new request's table is empty (length 0): it has no last block to look "
                    "at. Only a block the table already holds, partly filled (table.length % "
                    "block_size != 0), can need a copy")
        if isinstance(error, MemoryError):
            return ("the pool ran out of free blocks: take only the blocks positions 0 .. "
                    "length + n_new - 1 need")
        return "your function raised on this input"
    return hint


def _check_reserve_case(name: str, case_id: int, case: tuple, reserve) -> None:
    label, bs, _, others, (blocks0, length), n_new, _, _ = case
    where = f"{label}: block_size={bs}, table.blocks={blocks0}, table.length={length}, " \
            f"n_new={n_new}"
    pool, tables, mine = reserve_pool(case, 660 + case_id)
    before = copy.deepcopy(pool)
    ref0, free0 = list(pool.ref), list(pool.free)
    want_pool, want = copy.deepcopy(pool), copy.deepcopy(mine)
    PagedCache(want_pool, [want]).reserve(n_new)  # the engine, on a copy
    with forbid(name, PagedCache.reserve, BlockPool.reserve, BlockPool.blocks_needed,
                BlockPool.copy_on_write):
        call_hinted(name, where, _reserve_crash_hint(not blocks0), reserve, pool, mine, n_new)
    got, n_want = mine.blocks, len(want.blocks)
    if mine.length != length:
        fail(name, where, f"table.length = {length}", f"table.length = {mine.length}",
             "reserve makes room and writes nothing: the length moves when the pass writes the "
             "K/V (PagedCache.update)")
    if len(set(got)) != len(got):
        fail(name, where, f"{n_want} distinct blocks", got, "a block appears twice in the table")
    # the blocks the table had: kept, except a shared partly filled block, copied
    for j, b0 in enumerate(blocks0):
        g = got[j] if j < len(got) else None
        if g is None:
            fail(name, where, f"table.blocks starting like {want.blocks[:len(blocks0)]}", got,
                 "reserve only adds blocks (or puts a copy in a shared block's place): the "
                 "table lost one")
        if want.blocks[j] != b0 and g == b0:
            fail(name, where, f"block {b0} replaced by a copy", got,
                 NO_COPY.format(length=length, block=b0, ref=ref0[b0]))
        if want.blocks[j] == b0 and g != b0:
            if length % bs and j == length // bs:
                hint = COPIED_UNSHARED.format(block=b0)
            elif j < _ceil(length, bs):
                hint = COPIED_FULL.format(block=b0, length=length)
            else:
                hint = "a block the table already holds for later positions stays where it is"
            fail(name, where, f"table.blocks[{j}] = {b0}", f"table.blocks[{j}] = {g}", hint)
    if len(got) != n_want:
        need = f"ceil(({length} + {n_new}) / {bs}) = {n_want}"
        if len(got) < n_want:
            hint = FLOOR if len(got) == max(len(blocks0), (length + n_new) // bs) else (
                f"too few blocks: the table must hold positions 0 .. {length + n_new - 1}")
        else:
            hint = PER_NEW if len(got) == len(blocks0) + _ceil(n_new, bs) else (
                f"more blocks than positions 0 .. {length + n_new - 1} need: a block taken "
                f"before it is needed is a block another request cannot use")
        fail(name, where, f"{n_want} blocks ({need})", f"{len(got)} blocks: {got}", hint)
    taken = [b for b in got if b not in blocks0]
    for b in taken:
        if ref0[b] > 0:
            fail(name, where, "new blocks taken from pool.free", f"block {b} (reference count "
                 f"{ref0[b]})", f"block {b} is held by another table: new blocks come from the "
                 f"free list (pool.allocate(owner))")
    if sorted(taken) != sorted(free0[:len(taken)]):
        fail(name, where, f"the first {len(taken)} free blocks {free0[:len(taken)]}",
             f"blocks {taken}", NOT_FROM_FRONT)
    # the pool's books: counts, free list, hashes
    holders = tables + [mine]
    counts = [sum(b in t.blocks for t in holders) for b in range(len(ref0))]
    if pool.ref != counts:
        b = next(b for b in range(len(counts)) if pool.ref[b] != counts[b])
        if b in blocks0 and b not in got:
            hint = NOT_RELEASED
        elif b in taken:
            hint = "a block just taken is held by this table alone: reference count 1"
        else:
            hint = "pool.ref[b] counts the tables that hold block b"
        fail(name, where, f"pool.ref[{b}] = {counts[b]}", f"pool.ref[{b}] = {pool.ref[b]}",
             hint)
    free = [b for b in free0 if b not in taken]
    if list(pool.free) != free:
        fail(name, where, f"pool.free = {free}", f"pool.free = {list(pool.free)}",
             "pool.free lists the blocks nobody holds, the longest free first: a block you take "
             "leaves it (pool.allocate does this), the others keep their order")
    for b in taken:
        if b in pool.hash_of or before.hash_of.get(b) in pool.by_hash:
            fail(name, where, f"block {b} no longer in pool.by_hash", "still there",
                 STILL_HASHED.format(block=b))
    kept = {h: b for h, b in before.by_hash.items() if b not in taken}
    if pool.by_hash != kept:
        fail(name, where, "the other hashes left alone", "pool.by_hash changed",
             "only a reallocated block loses its hash")
    # the K/V every table reads: the others' untouched, this one's the same through its copy
    for t in tables:
        if _kv_differences(before, t, pool, t):
            fail(name, where, f"table {t.owner}'s K/V unchanged", "changed",
                 "you wrote into a block another table reads: reserve only copies FROM a shared "
                 "block, into a block this table alone will hold")
    old = BlockTable(mine.owner, list(blocks0), length)
    diff = _kv_differences(before, old, pool, mine)
    if diff:
        layers = sorted({layer for layer, _ in diff})
        kinds = {values for _, values in diff}
        if kinds == {True}:
            hint = "you copied the keys but not the values: copy both, pool.keys and pool.values"
        elif kinds == {False}:
            hint = "you copied the values but not the keys: copy both, pool.keys and pool.values"
        elif 0 not in layers:
            hint = ("you copied layer 0 only: pool.keys and pool.values hold one tensor per "
                    "layer; copy the block in every layer")
        else:
            hint = ("the copy must hold the shared block's K/V: for every layer l, "
                    "pool.keys[l][new] = pool.keys[l][old], and the same for pool.values")
        fail(name, where, f"positions 0 .. {length - 1} read the same K/V through the new table",
             f"different K/V in layer(s) {layers}", hint)


@guarded
def check_reserve(reserve) -> None:
    """reserve(pool, table, n_new): the table gets room for n_new more positions, a shared
    partly filled block that will be written copied first, as the engine's PagedCache.reserve
    does."""
    name = "reserve"
    for i, case in enumerate(RESERVE_CASES):
        _check_reserve_case(name, i, case, reserve)
    passed(name, len(RESERVE_CASES))


# --- exercise 3: a prompt's cached prefix blocks -------------------------------------------------

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


def _matching_cases() -> list[tuple[str, list[int], int, dict[str, int]]]:
    """(what the case is about, prompt, block_size, by_hash)."""
    P, T, U, V, W, X = (_tokens(s, n) for s, n in ((1, 12), (2, 4), (3, 4), (4, 4), (5, 4),
                                                     (6, 8)))
    cached = published(4, [(P, [5, 2, 8])])
    hole = dict(cached)
    del hole[block_hash(block_hash("", P[:4]), P[4:8])]  # block 2 was reallocated
    shared, q1, q2 = _tokens(7, 200), _tokens(8, 20), _tokens(9, 30)
    return [
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


def engine_shared_prefix(prompt: list[int], bs: int, by_hash: dict[str, int]) -> list[int]:
    """The server's own answer: BlockPool.cached_prefix on a pool holding these hashes."""
    pool = BlockPool(_config(1, 1, 1), 1 + max(by_hash.values(), default=0), bs)
    pool.by_hash = dict(by_hash)
    return pool.cached_prefix(list(prompt))


def _match(prompt, bs, by_hash, n_blocks=None, chained=True, stop=True, cumulative=False):
    """A prefix match with one of the usual mistakes."""
    blocks, h = [], ""
    n = (len(prompt) - 1) // bs if n_blocks is None else n_blocks
    for i in range(max(n, 0)):
        tokens = prompt[i * bs:(i + 1) * bs]
        if cumulative:
            h = block_hash("", prompt[:(i + 1) * bs])
        else:
            h = block_hash(h if chained else "", tokens)
        if h in by_hash:
            blocks.append(by_hash[h])
        elif stop:
            break
    return blocks


UNCHAINED = ("this is what you get when you hash each block's tokens alone (block_hash('', "
             "tokens)): the same tokens after another beginning have other keys and values, "
             "since every token attends to all before it. Chain: pass the previous block's hash")
CONTINUED = ("this is what you get when you go on after a miss: the table would have a hole, "
             "a block whose K/V nobody computed for this prompt. The prefix ends at the first "
             "block not found")
NO_TOKEN_LEFT = ("this is what you get when you match every full block of a prompt that ends on "
                 "a block boundary: nothing would be left to compute, and the first new token is "
                 "read from the logits of the prompt's last token. Leave at least one token: "
                 "look at the first (len(prompt) - 1) // block_size blocks")
WHOLE_BLOCK_LEFT = ("this is what you get when you always leave the last full block: only one "
                    "token must be left, so a prompt that does not end on a block boundary can "
                    "share all its full blocks: (len(prompt) - 1) // block_size of them")
CUMULATIVE = ("this is what you get when you hash the whole prefix from the start with '' as the "
              "previous hash: the engine's hash is block_hash(hash of the previous block, this "
              "block's tokens), one block at a time")


def _matching_mistakes(prompt, bs, by_hash) -> list[tuple[list[int], str]]:
    return [
        (_match(prompt, bs, by_hash, chained=False), UNCHAINED),
        (_match(prompt, bs, by_hash, chained=False, stop=False), UNCHAINED),
        (_match(prompt, bs, by_hash, stop=False), CONTINUED),
        (_match(prompt, bs, by_hash, n_blocks=len(prompt) // bs), NO_TOKEN_LEFT),
        (_match(prompt, bs, by_hash, n_blocks=len(prompt) // bs, stop=False), NO_TOKEN_LEFT),
        (_match(prompt, bs, by_hash, n_blocks=len(prompt) // bs - 1), WHOLE_BLOCK_LEFT),
        (_match(prompt, bs, by_hash, cumulative=True), CUMULATIVE),
    ]


def _show_prompt(prompt: list[int]) -> str:
    return (f"{prompt}" if len(prompt) <= 16 else
            f"[{', '.join(map(str, prompt[:6]))}, ... {len(prompt) - 8} more ..., "
            f"{prompt[-2]}, {prompt[-1]}]") + f" ({len(prompt)} tokens)"


@guarded
def check_matching_blocks(matching_blocks) -> None:
    """matching_blocks(prompt, block_size, by_hash) -> the blocks holding the prompt's first full
    blocks, found by chained hashes, as the pool's cached_prefix finds them."""
    name = "matching_blocks"
    cases = _matching_cases()
    ruled_out: set[int] = set()  # mistakes an earlier case, which the function passed, tells apart
    for label, prompt, bs, by_hash in cases:
        case = f"{label}: prompt={_show_prompt(prompt)}, block_size={bs}"
        want = engine_shared_prefix(prompt, bs, by_hash)
        given_prompt, given = list(prompt), dict(by_hash)
        with forbid(name, BlockPool.cached_prefix):
            got = call_hinted(name, case, lambda e: "your function raised on this input",
                               matching_blocks, given_prompt, bs, given)
        if given != by_hash or given_prompt != prompt:
            fail(name, case, "prompt and by_hash left as they were", "changed",
                 "matching only looks blocks up: the pool's hashes change when blocks are "
                 "published or reallocated, not here")
        blocks = int_list(got)
        if blocks is None:
            if isinstance(got, (list, tuple)) and got and all(isinstance(x, str) for x in got):
                hint = ("these are hashes: return the blocks by_hash maps them to, "
                        "by_hash[h]")
            else:
                hint = ("return a list of block ids (ints), the blocks the new table starts with"
                        + (" (did you forget to return it?)" if got is None else ""))
            fail(name, case, want, got, hint)
        mistakes = _matching_mistakes(prompt, bs, by_hash)
        if blocks != want:
            hints = dict.fromkeys(h for i, (wrong, h) in enumerate(mistakes)
                                  if i not in ruled_out and wrong != want and wrong == blocks)
            hint = "; or ".join(hints) or (
                "walk the prompt's full blocks from the first: h = block_hash(h, tokens of block "
                "i), starting from h = '' (the empty string); while by_hash has h, the block is "
                "by_hash[h]; stop at the first miss, and leave at least one prompt token")
            if not blocks and want:
                hint = ("no block found: " + hint) if not hints else hint
            fail(name, case, want, blocks, hint)
        ruled_out |= {i for i, (wrong, _) in enumerate(mistakes) if wrong != want}
    passed(name, len(cases))


# --- exercise 4: the admission rule --------------------------------------------------------------

# (what the case is about, block_size, running requests' blocks, cached (prompt, blocks) with
# blocks no running request holds left free, the request's prompt, tokens it had produced before
# a preemption, free blocks beyond what the rule needs: 0 exactly enough, -1 one short, ...)
def _admission_cases() -> list[tuple]:
    C = _tokens(11, 14)
    D = _tokens(12, 10)
    E = _tokens(13, 12)
    return [
        ("a prompt whose first 3 blocks a running request holds", 4, [[0, 1, 2, 3]],
         [(C, [0, 1, 2, 3])], C[:12] + _tokens(21, 5), [], 0),
        ("a prompt whose first 3 blocks a running request holds", 4, [[0, 1, 2, 3]],
         [(C, [0, 1, 2, 3])], C[:12] + _tokens(21, 5), [], -1),
        ("a finished request's prompt blocks: free, but still holding its K/V", 4,
         [[0, 1], [2, 3]], [(C, [4, 5, 6, 7])], C[:12] + _tokens(22, 3), [], -1),
        ("a finished request's prompt blocks: free, but still holding its K/V", 4,
         [[0, 1], [2, 3]], [(C, [4, 5, 6, 7])], C[:12] + _tokens(22, 3), [], 0),
        ("shared blocks: the first held by a running request, the next two free but cached", 4,
         [[0, 1, 2]], [(C, [0, 3, 4, 5])], C[:12] + _tokens(23, 2), [], -1),
        ("shared blocks: the first held by a running request, the next two free but cached", 4,
         [[0, 1, 2]], [(C, [0, 3, 4, 5])], C[:12] + _tokens(23, 2), [], 0),
        ("two shared blocks that two running requests both hold (reference count 2)", 4,
         [[0, 1, 2], [0, 1, 3]], [(E, [0, 1, 2])], E[:8] + _tokens(24, 6), [], -1),
        ("two shared blocks that two running requests both hold (reference count 2)", 4,
         [[0, 1, 2], [0, 1, 3]], [(E, [0, 1, 2])], E[:8] + _tokens(24, 6), [], 0),
        ("a prompt shorter than a block, nobody running", 4, [], [], _tokens(25, 3), [], 0),
        ("a prompt shorter than a block, nobody running", 4, [], [], _tokens(25, 3), [], -1),
        ("9 tokens: 3 blocks, the last holding one token", 4, [[0, 1]], [], _tokens(26, 9), [],
         -1),
        ("9 tokens: 3 blocks, the last holding one token", 4, [[0, 1]], [], _tokens(26, 9), [],
         0),
        ("9 tokens: 3 blocks, the last holding one token", 4, [[0, 1]], [], _tokens(26, 9), [],
         -2),
        ("a preempted request: its prompt's blocks free but cached, and the 7 tokens it had "
         "produced", 4, [[0, 1, 2]], [(D, [3, 4, 5])], D, _tokens(27, 7), 0),
        ("a preempted request: its prompt's blocks free but cached, and the 7 tokens it had "
         "produced", 4, [[0, 1, 2]], [(D, [3, 4, 5])], D, _tokens(27, 7), -1),
        ("three running requests, a prompt ending on a block boundary", 4, [[0], [1], [2]], [],
         _tokens(28, 8), [], -1),
        ("three running requests, a prompt ending on a block boundary", 4, [[0], [1], [2]], [],
         _tokens(28, 8), [], 0),
        ("three running requests, a prompt ending on a block boundary", 4, [[0], [1], [2]], [],
         _tokens(28, 8), [], -3),
        ("a full pool", 4, [[0, 1, 2, 3]], [], _tokens(29, 5), [], -4),
        ("plenty of free blocks", 16, [[0, 1], [2]], [], _tokens(30, 40), [], 5),
    ]


def admission_state(case: tuple) -> tuple[BlockPool, list[int], list[int], int]:
    """The case's pool (just the books: reference counts, free list, hashes), the request's
    tokens (prompt + produced), the blocks its prompt shares, and how many requests run."""
    _, bs, running, cached, prompt, produced, slack = case
    seq = list(prompt) + list(produced)
    used = {b for blocks in running for b in blocks} | {b for _, bl in cached for b in bl}
    top = 1 + max(used, default=-1)
    ref = [sum(b in blocks for blocks in running) for b in range(top)]
    by_hash = published(bs, cached)
    held = [b for b in _shared_blocks(prompt, bs, by_hash) if ref[b] > 0]
    need = _ceil(len(seq), bs) - len(held) + 1 + len(running)  # the rule, for the edge
    extra = max(0, need + slack - ref.count(0))
    pool = BlockPool(_config(1, 1, 1), top + extra, bs)
    pool.ref = ref + [0] * extra
    pool.free = deque(b for b in range(top + extra) if pool.ref[b] == 0)
    pool.by_hash = dict(by_hash)
    pool.hash_of = {b: h for h, b in by_hash.items()}
    return pool, seq, _shared_blocks(prompt, bs, by_hash), len(running)


def _shared_blocks(prompt: list[int], bs: int, by_hash: dict[str, int]) -> list[int]:
    return engine_shared_prefix(prompt, bs, by_hash)


def engine_admits(case: tuple) -> bool:
    """The server's answer: its scheduler's admission rule on the case's pool, with
    len(running) requests running."""
    pool, seq, _, n_running = admission_state(case)
    prompt = list(case[4])
    s = Sequence(99, Request(prompt, 1), prompt, False)
    s.tokens = list(seq)
    scheduler = Scheduler(pool)
    scheduler.running = [object()] * n_running
    return scheduler.policy.fits(scheduler, s, scheduler.admission(s))


def _admission_numbers(pool: BlockPool, n_tokens: int, shared: list[int]) -> dict:
    bs = pool.page_size
    return dict(free=pool.n_free, ceil=_ceil(n_tokens, bs), floor=n_tokens // bs,
                held=sum(pool.ref[b] > 0 for b in shared), shared=len(shared),
                refs=sum(pool.ref[b] for b in shared))


# (name, rule, hint): each usual mistake as a rule, given the numbers and n_running
ADMISSION_MISTAKES = [
    ("no headroom", lambda n, r: n["free"] >= n["ceil"] - n["held"] + 1,
     "this is what you get without headroom for the running requests: each may need a new block "
     "at the next decode step (its next position starts a block), and a pool without one "
     "preempts a request the step after admitting this one; keep one free block per running "
     "request"),
    ("no headroom at all", lambda n, r: n["free"] >= n["ceil"] - n["held"],
     "this is what you get when the prompt's blocks alone must fit: every running request, and "
     "the newcomer after its prefill, may need a new block at the next decode step; keep one "
     "free block for each"),
    ("no +1", lambda n, r: n["free"] >= n["ceil"] - n["held"] + r,
     "this is what you get without a block of headroom for the newcomer itself: after its "
     "prefill its first new token goes at position n_tokens, which starts a new block when "
     "n_tokens ends on a block boundary; it is one more running request"),
    ("shared not subtracted", lambda n, r: n["free"] >= n["ceil"] + 1 + r,
     "this is what you get when the shared blocks cost free blocks: a shared block a running "
     "request holds (ref > 0) is reused as it is, and takes nothing from the free list"),
    ("free shared subtracted", lambda n, r: n["free"] >= n["ceil"] - n["shared"] + 1 + r,
     "this is what you get when every shared block is free of charge: a shared block nobody "
     "holds (ref 0: a finished request's, still cached) is on the free list, and sharing it "
     "takes it off; only the shared blocks with ref > 0 cost nothing"),
    ("refs summed", lambda n, r: n["free"] >= n["ceil"] - n["refs"] + 1 + r,
     "this is what you get when you subtract the shared blocks' reference counts: a block held "
     "by two requests is still one block; count the shared blocks with ref > 0, once each"),
    ("floor", lambda n, r: n["free"] >= n["floor"] - n["held"] + 1 + r,
     "this is what you get with n_tokens // block_size, which rounds down: a partly filled last "
     "block is a block too, ceil(n_tokens / block_size)"),
    ("strict", lambda n, r: n["free"] > n["ceil"] - n["held"] + 1 + r,
     "this is what you get with > instead of >=: exactly enough free blocks is enough"),
]


def _as_bool(value):
    if isinstance(value, bool):
        return value
    if type(value).__module__ == "numpy" and type(value).__name__ in ("bool_", "bool"):
        return bool(value)
    return None


@guarded
def check_can_admit(can_admit) -> None:
    """can_admit(pool, n_tokens, shared, n_running) -> the server's admission rule: True when the
    pool has free blocks for the request's tokens (shared blocks a running request holds cost
    none) and one block of headroom for it and for each running request."""
    name = "can_admit"
    cases = _admission_cases()
    answers, wanted, numbers, described = [], [], [], []
    for case in cases:
        label = case[0]
        pool, seq, shared, n_running = admission_state(case)
        want = engine_admits(case)
        refs = [pool.ref[b] for b in shared]
        where = (f"{label}: pool.page_size={pool.page_size}, pool.n_free={pool.n_free}, "
                 f"n_tokens={len(seq)}, shared={shared} (reference counts {refs}), "
                 f"n_running={n_running}")
        books = (list(pool.ref), list(pool.free), dict(pool.by_hash))
        with forbid(name, Scheduler.admission, FirstComeFirstServed.fits,
                    BlockPool.cached_prefix):
            got = call_hinted(name, where, lambda e: "your function raised on this input",
                               can_admit, pool, len(seq), list(shared), n_running)
        if (list(pool.ref), list(pool.free), dict(pool.by_hash)) != books:
            fail(name, where, "the pool left as it was", "the pool changed",
                 "can_admit only decides: taking the blocks is what the server does next, once "
                 "the request is admitted")
        value = _as_bool(got)
        if value is None:
            fail(name, where, want, got, f"return True or False (a bool), not {_kind(got)}"
                 + (" (did you forget to return it?)" if got is None else ""))
        answers.append(value)
        wanted.append(want)
        numbers.append((_admission_numbers(pool, len(seq), shared), n_running))
        described.append(where)
    if answers == wanted:
        passed(name, len(cases))
        return
    bad = next(i for i, (a, w) in enumerate(zip(answers, wanted)) if a != w)
    hint = next((h for _, rule, h in ADMISSION_MISTAKES
                 if [rule(n, r) for n, r in numbers] == answers), None)
    if hint is None:
        n, r = numbers[bad]
        hint = (f"here the request's {n['ceil']} block(s) less {n['held']} shared block(s) "
                f"held by running requests take {n['ceil'] - n['held']} free block(s), and "
                f"headroom is one block for it and one for each of the {r} running: "
                f"{n['ceil'] - n['held'] + 1 + r} needed, {n['free']} free")
    fail(name, described[bad], wanted[bad], answers[bad], hint)




# --- exercise 5 (predict, then measure): blocks in use when samples share a prompt ----------------

PEAK_SAMPLES, PEAK_NEW, PEAK_BLOCK = 4, 7, 4
PEAK_KEYS = [(10, True), (12, True), (12, False)]  # (prompt tokens, prefix caching)


def peak_blocks_in_use(pool: BlockPool) -> int:
    """The most blocks held at once (reference count above 0), replayed from the pool's log."""
    ref: dict[int, int] = {}
    peak = 0
    for what, block, _ in pool.log:
        if what == "allocate":
            ref[block] = 1
        elif what == "share":
            ref[block] = ref.get(block, 0) + 1
        elif what in ("free", "unshare"):
            ref[block] -= 1
        else:
            continue
        peak = max(peak, sum(v > 0 for v in ref.values()))
    return peak


def measure_peak(prompt_len: int, prefix_caching: bool) -> int:
    """PEAK_SAMPLES requests with the same prompt, served together in blocks of PEAK_BLOCK, on a
    tiny random model (no request stops early, so the blocks do not depend on its tokens)."""
    prompt = list(range(100, 100 + prompt_len))
    requests = [Request(list(prompt), PEAK_NEW) for _ in range(PEAK_SAMPLES)]
    with torch.inference_mode():
        outs = serve(_tiny_model(), requests, page_size=PEAK_BLOCK, prefix_caching=prefix_caching)
    return peak_blocks_in_use(outs.pool)


_MODELS: dict = {}


def _tiny_model():
    if "tiny" not in _MODELS:
        _MODELS["tiny"] = tiny_model(0)
    return _MODELS["tiny"]


def _peak_mistakes(prompt_len: int, prefix_caching: bool) -> list[tuple[int, str]]:
    n, bs = PEAK_SAMPLES, PEAK_BLOCK
    held = prompt_len + PEAK_NEW - 1
    own = _ceil(held, bs)
    full = prompt_len // bs
    shared = (prompt_len - 1) // bs if prefix_caching else 0
    out = [
        (n * _ceil(prompt_len + PEAK_NEW, bs) - (n - 1) * shared,
         "you gave the last new token K/V: it is produced by the last pass and never fed, so a "
         "request holds prompt + new - 1 positions"),
        (n * own, "you shared nothing: with prefix caching the samples after the first reuse the "
                  "prompt's full blocks (one copy, reference count 4)" if prefix_caching else
                  "right count per request, wrong total"),
        (n * _ceil(held, bs) - (n - 1) * _ceil(prompt_len, bs),
         "you shared the prompt's partly filled last block too: only FULL blocks are shared (a "
         "partly filled one is written by every sample, so each needs its own)"),
        (n * own - (n - 1) * full,
         "you shared every full block of the prompt: a prompt that ends on a block boundary "
         "shares one fewer, since at least one prompt token is left to compute (its logits give "
         "the first new token)"),
        (n * held // bs, "you rounded down: a partly filled block is a whole block"),
    ]
    if not prefix_caching:
        out.append((n * own - (n - 1) * ((prompt_len - 1) // bs),
                    "without prefix caching nothing is shared: every request computes and holds "
                    "its own prompt blocks"))
    return out


@one_thread
@guarded
def check_predict_peak_blocks(predict_peak_blocks) -> None:
    """predict_peak_blocks() -> {(prompt tokens, prefix caching): the most blocks in use at once}
    for 4 requests with the same prompt, 7 new tokens each, blocks of 4; measured with serve()."""
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
        if _int(got[key]) is None:
            fail(name, f"{case}: {key}", "an int", got[key], "blocks come whole: an int")
    measured = {key: measure_peak(*key) for key in PEAK_KEYS}
    for key in PEAK_KEYS:
        you = _int(got[key])
        if you != measured[key]:
            hints = dict.fromkeys(h for w, h in _peak_mistakes(*key)
                                  if w == you and w != measured[key])
            reason = "; or ".join(hints) or (
                "per request: the positions it holds at the end (prompt + new tokens - 1), in "
                "blocks of 4; then which of those blocks the requests hold together")
            prompt_len, caching = key
            fail(name, f"{case}: a {prompt_len}-token prompt, prefix caching "
                 f"{'on' if caching else 'off'}", measured[key], you,
                 f"you predicted {you} blocks; the engine used {measured[key]} at most: {reason}")
    print("  measured: " + "; ".join(
        f"{p}-token prompt, prefix caching {'on' if c else 'off'}: {measured[p, c]} blocks"
        for p, c in PEAK_KEYS))
    passed(name, len(PEAK_KEYS))


def _int(value):
    if isinstance(value, bool):
        return None
    return value if isinstance(value, int) else None


# --- exercise 6 (debug): giving blocks back on a rollback ----------------------------------------

class BuggyPagedCache(PagedCache):
    """The notebook's broken rollback, verbatim: it gives back the block that still holds the
    sequence's last positions whenever the new length is not a multiple of block_size."""

    def crop(self, max_length):
        t, bs = self.tables[0], self.pool.page_size
        t.length = max_length
        while len(t.blocks) * bs > max_length:        # a block past the end goes back
            self.pool.release(t.blocks.pop(), t.owner)


# (what the case is about, block_size, this table (blocks, length), the others' blocks, new
# length)
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
    used = set(blocks) | {b for o in others for b in o}
    num_blocks = max(used) + 3
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


def _crop_hint(got: BlockTable, want: BlockTable, pool, want_pool, blocks0) -> str:
    if len(got.blocks) < len(want.blocks):
        return CROP_SYMPTOM
    if len(got.blocks) > len(want.blocks):
        return ("a block that lies wholly past the new length holds nothing of the sequence any "
                "more: give it back (pool.release), or it is lost to every other request")
    if got.length != want.length:
        return "the table's length is the new length"
    return "give back the blocks past the end with pool.release(block, owner), last first"


@guarded
def check_crop(cache_class) -> None:
    """cache_class(pool, [table]).crop(n): a paged rollback, against the engine's PagedCache.crop
    on a copy of the same pool (table, reference counts, free list), then as the cache of a
    verify-and-rollback decode on a tiny model, against target-only greedy decoding."""
    name = "crop"
    if not (isinstance(cache_class, type) and issubclass(cache_class, PagedCache)):
        fail(name, "the class", "a subclass of PagedCache (of BuggyPagedCache)", cache_class,
             "pass the class itself, with its crop method fixed")
    same_as_buggy = 0
    for case in CROP_CASES:
        label, bs, (blocks0, length), others, n = case
        where = f"{label}: block_size={bs}, table.blocks={blocks0}, length {length} → {n}"
        pool, tables, mine = crop_pool(case)
        want_pool, want = copy.deepcopy(pool), copy.deepcopy(mine)
        PagedCache(want_pool, [want]).crop(n)
        buggy_pool, buggy = copy.deepcopy(pool), copy.deepcopy(mine)
        BuggyPagedCache(buggy_pool, [buggy]).crop(n)
        with forbid(name, PagedCache.crop, BlockPool.crop):
            call_hinted(name, where, lambda e: "your crop raised on this input",
                        lambda: cache_class(pool, [mine]).crop(n))
        state = (mine.blocks, mine.length, pool.ref, list(pool.free))
        wanted = (want.blocks, want.length, want_pool.ref, list(want_pool.free))
        same_as_buggy += state == (buggy.blocks, buggy.length, buggy_pool.ref,
                                   list(buggy_pool.free))
        if state[:2] != wanted[:2]:
            hint = _crop_hint(mine, want, pool, want_pool, blocks0)
            if state[:2] == (buggy.blocks, buggy.length):
                hint = "this is BuggyPagedCache's crop unchanged: " + CROP_SYMPTOM
            fail(name, where, f"table.blocks={want.blocks}, length {want.length}",
                 f"table.blocks={mine.blocks}, length {mine.length}", hint)
        if state[2:] != wanted[2:]:
            freed = [b for b in blocks0 if b not in mine.blocks]
            shared = [b for b in freed if want_pool.ref[b] > 0]
            hint = ("block {b} is shared (another sequence holds it too): giving it back drops "
                    "ONE reference; it is free only when nobody holds it. pool.release does "
                    "both".format(b=shared[0]) if shared and pool.ref[shared[0]] == 0 else
                    "give blocks back with pool.release(block, owner): it lowers the reference "
                    "count and puts the block on the free list when nobody holds it")
            fail(name, where, f"pool.ref={want_pool.ref}, pool.free={list(want_pool.free)}",
                 f"pool.ref={pool.ref}, pool.free={list(pool.free)}", hint)
    if same_as_buggy == len(CROP_CASES):
        fail(name, "every case", "a fixed crop", "BuggyPagedCache's results",
             "this is the buggy crop unchanged: " + CROP_SYMPTOM)
    _check_crop_in_decoding(name, cache_class)
    passed(name, len(CROP_CASES) + 1)


def _check_crop_in_decoding(name, cache_class) -> None:
    """Greedy decoding on a paged cache of the student's class, with wrong proposals verified and
    rolled back at lengths of every remainder: the output must be target-only greedy decoding."""
    model = _tiny_model()
    prompt, n_new, bs = [3, 17, 200, 41, 9, 77, 5], 24, 4
    pool = BlockPool(model.config, 40, bs)
    table = BlockTable(0)
    seq = list(prompt)

    def verifier(rows, cache):
        cache.reserve(len(rows))
        return model(torch.tensor([rows]), cache=cache)[0]
    case = "greedy decoding on a paged cache with your crop, every round rolled back"
    try:
        with torch.inference_mode():
            cache = cache_class(pool, [table])
            cache.reserve(len(prompt))
            seq.append(int(model(torch.tensor([prompt]), cache=cache)[0, -1].argmax()))
            step = 0
            while len(seq) - len(prompt) < n_new:
                # proposals unrelated to the text, so they are refused and the cache rolls back
                # behind a different remainder of the block size every round
                k = 1 + step % 3
                proposals = [(seq[-1] * 7 + i + step) % model.config.vocab_size
                             for i in range(k)]
                verify_and_commit(seq, proposals, cache, verifier,
                                  partial(accept_matching, sampling=SamplingParams(),
                                          first_position=len(seq)))
                step += 1
    except (NotImplementedError, CheckFailed):
        raise
    except Exception as e:  # noqa: BLE001 - a crash after a rollback is this exercise's symptom
        fail(name, case, "decoding to the end", f"{type(e).__name__}: {e} after "
             f"{len(seq) - len(prompt)} new tokens", "the table lost a block it still needed "
             "and the next pass found no slot for a position: " + CROP_SYMPTOM)
    new = seq[len(prompt):len(prompt) + n_new]
    alone = generate(model, prompt, n_new).tokens
    if new != alone:
        at = next(i for i, (a, b) in enumerate(zip(new, alone)) if a != b)
        fail(name, case, f"target-only greedy: {alone}", new,
             f"the text goes wrong at new token {at}: " + CROP_SYMPTOM)


# --- exercise 7 (design): a block size for a memory budget ----------------------------------------

BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)


def blocks_taken(lengths: list[int], block_size: int) -> int:
    """Blocks the engine's PagedCache.reserve takes for sequences of these lengths, one table
    each, in one pool."""
    need = sum(_ceil(n, block_size) for n in lengths)
    pool = BlockPool(_config(1, 1, 1), max(need, 1), block_size)
    tables = [BlockTable(i) for i in range(len(lengths))]
    for t, n in zip(tables, lengths):
        PagedCache(pool, [t]).reserve(n)
    return pool.num_blocks - pool.n_free


def reference_block_size(lengths: list[int], max_waste: float) -> int:
    held = sum(lengths)
    fits = [bs for bs in BLOCK_SIZES
            if blocks_taken(lengths, bs) * bs <= (1 + max_waste) * held]
    return max(fits)


def _snapshots() -> list[tuple[str, list[int]]]:
    """(what the snapshot is, the positions each running sequence holds)."""
    g = random.Random(6)
    chat = [g.randint(5, 40) for _ in range(64)]
    mixed = [g.randint(6, 80) + int(math.exp(g.uniform(math.log(4), math.log(127))))
             for _ in range(48)]
    documents = [g.randint(900, 2000) for _ in range(4)]
    return [("48 sequences of a mixed workload (prompts of 6-80 tokens, outputs of 4-127)", mixed),
            ("64 short chat turns of 5-40 tokens", chat),
            ("4 long documents of 900-2000 tokens", documents),
            ("sequences whose lengths are all multiples of 64", [64, 192, 320, 128])]


DESIGN_BUDGETS = (0.0, 0.05, 0.1, 0.25)


def _block_mistakes(lengths, max_waste) -> list[tuple[int, str]]:
    held = sum(lengths)

    def largest(ok):
        fits = [bs for bs in BLOCK_SIZES if ok(bs)]
        return max(fits) if fits else 1
    return [
        (1, "block size 1 never wastes a position (it is always within the budget), but a block "
            "per position is the slowest for the attention kernel, which reads a block at a "
            "time: the goal is the LARGEST block size within the budget"),
        (largest(lambda bs: sum(n // bs for n in lengths) * bs <= (1 + max_waste) * held),
         "you rounded the blocks down: a sequence's partly filled last block is a whole block"),
        (largest(lambda bs: blocks_taken(lengths, bs) * bs * (1 - max_waste) <= held),
         "the waste is measured against the positions HELD: reserved ≤ (1 + max_waste) × held"),
        (largest(lambda bs: blocks_taken(lengths, bs) * bs < (1 + max_waste) * held),
         "exactly on the budget is within it: ≤, not <"),
        (16, "16 is vLLM's default, not this workload's answer: measure the waste at each size"),
    ]


@guarded
def check_choose_block_size(choose_block_size) -> None:
    """choose_block_size(lengths, max_waste) -> the largest block size of BLOCK_SIZES whose blocks
    (as PagedCache.reserve takes them) hold at most (1 + max_waste) × the positions held."""
    name = "choose_block_size"
    n_cases = 0
    for label, lengths in _snapshots():
        held = sum(lengths)
        for max_waste in DESIGN_BUDGETS:
            case = f"{label}, max_waste={max_waste}"
            want = reference_block_size(lengths, max_waste)
            got = call_hinted(name, case, lambda e: "your function raised on this input",
                              choose_block_size, list(lengths), max_waste)
            if _int(got) is None or got not in BLOCK_SIZES:
                fail(name, case, want, got, f"return one of {BLOCK_SIZES}, as an int")
            if got != want:
                hints = dict.fromkeys(h for w, h in _block_mistakes(lengths, max_waste)
                                      if w == got and w != want)
                mine = blocks_taken(lengths, got) * got
                best = blocks_taken(lengths, want) * want
                fail(name, case, f"{want} ({best:,} positions reserved for {held:,} held, "
                     f"{100 * (best / held - 1):.1f}% waste)",
                     f"{got} ({mine:,} positions reserved, {100 * (mine / held - 1):.1f}% waste)",
                     "; or ".join(hints) or "for each block size: the blocks every sequence "
                     "needs, times the block size, against the positions held")
            n_cases += 1
    passed(name, n_cases)


__all__ = ["check_gather_keys", "check_reserve", "check_matching_blocks", "check_can_admit",
           "check_predict_peak_blocks", "check_crop", "check_choose_block_size", "CheckFailed"]
