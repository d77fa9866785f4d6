"""Chapter 06's checkers (a paged KV cache, prefix caching, admission), against the engine on the
CPU, leaving the caller's random state alone: reserve, predict_peak_blocks and crop (code);
gather_keys, matching_blocks, can_admit, choose_block_size, chunk_schedule and capture_sizes
(tables). The hints are in hints/ch06.toml."""
from __future__ import annotations

import copy
import functools
import math
import random
from collections import Counter, deque
from functools import partial

import torch

from ...engine import GPTConfig, Request, SamplingParams, generate, serve
from ...engine.paged import BlockPool, BlockTable, PagedCache, block_hash
from ...engine.scheduler import FirstComeFirstServed, Scheduler, Sequence
from ...engine.verify import accept_matching, verify_and_commit
from .. import checks as ck

H = ck.hints("ch06")
G, R, M, A, P, C, B, S, W = (H[k] for k in (
    "gather_keys", "reserve", "matching_blocks", "can_admit", "predict_peak_blocks", "crop",
    "choose_block_size", "chunk_schedule", "capture_sizes"))


def _config(n_layer: int, n_head: int, head_dim: int) -> GPTConfig:
    return GPTConfig.preset("tiny", n_layer=n_layer, n_head=n_head, n_embd=n_head * head_dim)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


_tiny_model = functools.cache(lambda: ck.tiny_model(0))


# --- exercise 1 (a table): a sequence's keys, read through its block table ----------------------
# (what the case is about, num_blocks, nh, block_size, hs, table, length); the first tells the
# mistakes apart
GATHER_CASES = [
    ("a table out of order, four blocks, the last partly filled", 8, 2, 4, 3, [5, 2, 7, 0], 14),
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


def numbered(num_blocks: int, nh: int, bs: int, hs: int) -> torch.Tensor:
    """A pool's keys whose every number says where it sits: [b, h, s, d] holds b·10⁶ + h·10⁴ +
    s·10² + d (exact in float32), so an answer shows which slots it read."""
    axes = [torch.arange(n).view([-1 if i == k else 1 for i in range(4)])
            for k, n in enumerate((num_blocks, nh, bs, hs))]
    return (axes[0] * 10**6 + axes[1] * 10**4 + axes[2] * 100 + axes[3]).float()


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


def _slots(keys: torch.Tensor) -> str:
    """An answer as the pool slots its positions hold, in runs: 'pool_keys[5, :, 0..3], ...'."""
    nh, _, hs = keys.shape
    runs: list[list] = []  # [block, first slot, last slot], or [None, positions]
    for row in keys.transpose(0, 1):
        v = float(row[0, 0])
        b, s = (int(v) // 10**6, int(v) // 100 % 100) if math.isfinite(v) and v >= 0 else (0, 0)
        if not torch.equal(row, numbered(b + 1, nh, s + 1, hs)[b, :, s]):
            b = None
        if runs and runs[-1][0] is None is b:
            runs[-1][1] += 1
        elif runs and b is not None and runs[-1][0] == b and runs[-1][2] + 1 == s:
            runs[-1][2] += 1
        else:
            runs.append([None, 1] if b is None else [b, s, s])
    return ", ".join(f"{r[1]} position(s) from no single slot" if r[0] is None else
                     f"pool_keys[{r[0]}, :, {r[1]}{'' if r[1] == r[2] else f'..{r[2]}'}]"
                     for r in runs)


def _gathered(got, pool_keys, table, length) -> torch.Tensor:
    """The contract: a (nh, length, hs) tensor in the pool's dtype."""
    _, nh, bs, hs = pool_keys.shape
    if not isinstance(got, torch.Tensor):
        raise ck.Refused(G["not_a_tensor"], f"a tensor of shape {(nh, length, hs)}")
    shape, n = tuple(got.shape), got.size(1) if got.dim() == 3 else -1
    hint = (G["positions_first"] if shape == (length, nh, hs) else
            G["batch_axis"] if shape == (1, nh, length, hs) else
            G["shape"] if got.dim() != 3 or (shape[0], shape[2]) != (nh, hs) else
            G["cut"].format(blocks=len(table), slots=n, length=length)
            if n == len(table) * bs and n > length else G["dropped"] if n == length // bs * bs
            else G["one_too_many"] if n == (length // bs + 1) * bs
            else G["per_row"].format(length=length, n=n))
    if shape != (nh, length, hs):
        raise ck.Refused(hint, f"shape {(nh, length, hs)} (nh, length, hs)")
    if got.dtype != pool_keys.dtype:
        raise ck.Refused(G["dtype"], f"dtype {pool_keys.dtype}")
    return got


GATHER = ck.Exercise(
    "gather_keys", cases=[(numbered(n, nh, bs, hs), ck.Labelled(label, table), length)
                          for label, n, nh, bs, hs, table, length in GATHER_CASES],
    describe=lambda keys, table, length: (f"{table.label}: pool_keys of shape "
                                          f"{tuple(keys.shape)} (blocks of {keys.size(2)}), "
                                          f"table={table}, length={length}"),
    reference=engine_read, solution=_read(lambda table, i, s: (table[i], slice(None), s)),
    returns=_gathered, same=torch.equal, show=_slots, forbid=(PagedCache.update, PagedCache._slots),
    mistakes=ck.named(
        G, sorted=_read(lambda table, i, s: (sorted(table)[i], slice(None), s)),
        pool_first=_read(lambda table, i, s: (i, slice(None), s)),
        reshape=lambda pool_keys, table, length: pool_keys[table].reshape(
            pool_keys.size(1), -1, pool_keys.size(3))[:, :length],
        swapped=_read(lambda table, i, s: (table[s], slice(None), i))),
    otherwise=G["otherwise"], unchanged=G["unchanged"],
    raised=ck.raised_as(IndexError, G["out_of_range"]))
check_gather_keys = GATHER.check

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


def _books(bs: int, num_blocks: int, tables: list[BlockTable], mine: BlockTable, order=None,
           layers: int = 1, seed: int = 0) -> BlockPool:
    """A pool whose books (reference counts, free list) are these tables', its K/V random."""
    pool = BlockPool(_config(layers, layers, 3), num_blocks, bs)
    g = torch.Generator().manual_seed(seed)
    for t in pool.keys + pool.values:
        t.copy_(torch.randn(t.shape, generator=g))
    pool.ref = [sum(b in t.blocks for t in tables + [mine]) for b in range(num_blocks)]
    pool.free = deque(b for b in (range(num_blocks) if order is None else order)
                      if pool.ref[b] == 0)
    return pool


def _kv_differences(before: BlockPool, old: BlockTable, after: BlockPool,
                    new: BlockTable) -> list[tuple[int, bool]]:
    """(layer, values?) of the tensors read differently through `new` than through `old`."""
    def read(pool, table, layer, values):
        src, bs = (pool.values if values else pool.keys)[layer], pool.page_size
        return [src[table.blocks[p // bs], :, p % bs] for p in range(table.length)]
    return [(layer, values) for layer in range(len(before.keys)) for values in (False, True)
            if not all(torch.equal(a, b) for a, b in zip(read(before, old, layer, values),
                                                         read(after, new, layer, values)))]


def _check_reserve_case(name: str, case_id: int, case: tuple, reserve) -> None:
    label, bs, num_blocks, others, (blocks0, length), n_new, order, hashed = case
    where = (f"{label}: block_size={bs}, table.blocks={blocks0}, table.length={length}, "
             f"n_new={n_new}")
    tables = [BlockTable(i, list(b), n) for i, (b, n) in enumerate(others)]
    mine = BlockTable(len(tables), list(blocks0), length)
    pool = _books(bs, num_blocks, tables, mine, order, layers=2, seed=660 + case_id)  # 2 heads
    for b in hashed:  # blocks that still hold a finished prompt's K/V
        h = block_hash("a finished prompt", [b])
        pool.by_hash[h], pool.hash_of[b] = b, h
    before, want = copy.deepcopy(pool), copy.deepcopy(mine)
    ref0, free0, last = list(pool.ref), list(pool.free), length + n_new - 1
    PagedCache(copy.deepcopy(pool), [want]).reserve(n_new)  # the engine, on a copy
    with ck.forbid(name, PagedCache.reserve, BlockPool.reserve, BlockPool.blocks_needed,
                   BlockPool.copy_on_write):
        ck.call_hinted(name, where, lambda e: R["empty_table"] if isinstance(e, IndexError) and not
                       blocks0 else R["pool_full"] if isinstance(e, MemoryError) else R["raised"],
                       reserve, pool, mine, n_new)
    got, n_want = mine.blocks, len(want.blocks)
    ck.expect(mine.length == length, name, where, f"table.length = {length}",
              f"table.length = {mine.length}", R["length"])
    ck.expect(len(set(got)) == len(got), name, where, f"{n_want} distinct blocks", got, R["twice"])
    # the blocks the table had: kept, except a shared partly filled block, copied
    for j, b0 in enumerate(blocks0):
        if j >= len(got):
            ck.fail(name, where, f"table.blocks starting like {want.blocks[:len(blocks0)]}", got,
                    R["lost"])
        if want.blocks[j] != b0 and got[j] == b0:
            ck.fail(name, where, f"block {b0} replaced by a copy", got,
                    R["no_copy"].format(length=length, block=b0, ref=ref0[b0]))
        if want.blocks[j] == b0 and got[j] != b0:
            ck.fail(name, where, f"table.blocks[{j}] = {b0}", f"table.blocks[{j}] = {got[j]}",
                    R["copied_unshared"].format(block=b0) if length % bs and j == length // bs else
                    R["copied_full"].format(block=b0, length=length) if j < _ceil(length, bs) else
                    R["moved"])
    if len(got) != n_want:
        ck.fail(name, where, f"{n_want} blocks (ceil(({length} + {n_new}) / {bs}) = {n_want})",
                f"{len(got)} blocks: {got}", (
                 R["floor"] if len(got) == max(len(blocks0), (length + n_new) // bs) else
                 R["too_few"].format(last=last)) if len(got) < n_want else R["per_new"]
                if len(got) == len(blocks0) + _ceil(n_new, bs) else R["too_many"].format(last=last))
    taken = [b for b in got if b not in blocks0]
    for b in taken:
        ck.expect(ref0[b] == 0, name, where, "new blocks taken from pool.free",
                  f"block {b} (reference count {ref0[b]})", R["held_elsewhere"].format(block=b))
    ck.expect(sorted(taken) == sorted(free0[:len(taken)]), name, where,
              f"the first {len(taken)} free blocks {free0[:len(taken)]}", f"blocks {taken}",
              R["not_from_front"])
    # the pool's books: counts, free list, hashes
    counts = [sum(b in t.blocks for t in tables + [mine]) for b in range(len(ref0))]
    for b in (b for b in range(len(counts)) if pool.ref[b] != counts[b]):
        ck.fail(name, where, f"pool.ref[{b}] = {counts[b]}", f"pool.ref[{b}] = {pool.ref[b]}",
                R["not_released"] if b in blocks0 and b not in got else
                R["new_ref"] if b in taken else R["ref"])
    free = [b for b in free0 if b not in taken]
    ck.expect(list(pool.free) == free, name, where, f"pool.free = {free}",
              f"pool.free = {list(pool.free)}", R["free_list"])
    for b in taken:
        ck.expect(b not in pool.hash_of and before.hash_of.get(b) not in pool.by_hash, name, where,
                  f"block {b} no longer in pool.by_hash", "still there",
                  R["still_hashed"].format(block=b))
    ck.expect(pool.by_hash == {h: b for h, b in before.by_hash.items() if b not in taken}, name,
              where, "the other hashes left alone", "pool.by_hash changed", R["other_hashes"])
    # the K/V every table reads: the others' untouched, this one's the same through its copy
    for t in tables:
        ck.expect(not _kv_differences(before, t, pool, t), name, where,
                  f"table {t.owner}'s K/V unchanged", "changed", R["wrote_shared"])
    diff = _kv_differences(before, BlockTable(mine.owner, list(blocks0), length), pool, mine)
    if diff:
        layers, values = sorted({layer for layer, _ in diff}), {v for _, v in diff}
        ck.fail(name, where, f"positions 0 .. {length - 1} read the same K/V through the new table",
                f"different K/V in layer(s) {layers}",
                R["keys_only"] if values == {True} else R["values_only"] if values == {False}
                else R["layer_0"] if 0 not in layers else R["no_kv"])


@ck.guarded
def check_reserve(reserve) -> None:
    """reserve(pool, table, n_new): room for n_new more positions, as PagedCache.reserve."""
    for i, case in enumerate(RESERVE_CASES):
        _check_reserve_case("reserve", i, case, reserve)
    ck.passed("reserve", len(RESERVE_CASES))


# --- exercise 3 (a table): a prompt's cached prefix blocks ----------------------------------------
def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def published(bs: int, prompts: list[tuple[list[int], list[int]]]) -> dict[str, int]:
    """by_hash after the engine published these (prompt, blocks), in order."""
    pool = BlockPool(_config(1, 1, 1), 1, bs)
    for prompt, blocks in prompts:
        pool.publish(list(prompt), BlockTable(0, list(blocks), len(prompt)))
    return pool.by_hash


def _matching_cases() -> list[tuple[ck.Labelled, int, dict[str, int]]]:
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
    return [(ck.Labelled(label, prompt), bs, by_hash) for label, prompt, bs, by_hash in cases]


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


def _block_ids(got, *case) -> list[int]:
    """The contract: a list of block ids (ints)."""
    if ck.int_list(got) is not None:
        return ck.int_list(got)
    hashes = isinstance(got, (list, tuple)) and got and all(isinstance(x, str) for x in got)
    raise ck.Refused(M["hashes"] if hashes else M["not_ids"])


def _show_prompt(prompt: list[int]) -> str:
    return (f"{prompt}" if len(prompt) <= 16 else
            f"[{', '.join(map(str, prompt[:6]))}, ... {len(prompt) - 8} more ..., "
            f"{prompt[-2]}, {prompt[-1]}]") + f" ({len(prompt)} tokens)"


def _matching_otherwise(answers) -> str:
    got, want = next((got, engine_shared_prefix(*case)) for case, got in answers
                     if got != engine_shared_prefix(*case))
    return (M["nothing_found"] if not got and want else "") + M["otherwise"]


MATCHING = ck.Exercise(
    "matching_blocks", cases=_matching_cases(),
    describe=lambda prompt, bs, by_hash: (f"{prompt.label}: prompt={_show_prompt(prompt)}, "
                                          f"block_size={bs}"),
    reference=engine_shared_prefix, solution=_match, returns=_block_ids,
    forbid=(BlockPool.cached_prefix,), unchanged=M["unchanged"], otherwise=_matching_otherwise,
    mistakes=ck.named(
        M, past_a_miss=partial(_match, stop=False),
        every_full_block=lambda prompt, bs, by_hash: _match(prompt, bs, by_hash, len(prompt) // bs),
        last_full_block=lambda prompt, bs, by_hash: _match(prompt, bs, by_hash,
                                                           len(prompt) // bs - 1),
        cumulative=partial(_match, cumulative=True), unchained=partial(_match, chained=False)))
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
    """can_admit's arguments for the case: (pool, n_tokens, shared, n_running)."""
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
    raise ck.Refused(A["not_a_bool"].format(kind=ck.type_name(got)))


def _admission_otherwise(answers) -> str:
    pool, n_tokens, shared, r = next(case for case, got in answers if got != engine_admits(*case))
    blocks, held = _ceil(n_tokens, pool.page_size), _held(pool, shared)
    return A["otherwise"].format(blocks=blocks, held=held, take=blocks - held, running=r,
                                 need=blocks - held + 1 + r, free=pool.n_free)


ADMISSION = ck.Exercise(
    "can_admit", cases=[admission_state(case) for case in _admission_cases()],
    describe=lambda pool, n_tokens, shared, n_running: (
        f"{pool.label}: pool.page_size={pool.page_size}, pool.n_free={pool.n_free}, "
        f"n_tokens={n_tokens}, shared={shared} (reference counts "
        f"{[pool.ref[b] for b in shared]}), n_running={n_running}"),
    reference=engine_admits, solution=_rule(), returns=_a_bool, unchanged=A["unchanged"],
    forbid=(Scheduler.admission, FirstComeFirstServed.fits, BlockPool.cached_prefix),
    mistakes=ck.named(
        A, ref_counts=_rule(held=lambda pool, shared: sum(pool.ref[b] for b in shared)),
        shared_cost=_rule(held=lambda pool, shared: 0),
        all_free=_rule(held=lambda pool, shared: len(shared)),
        floor=_rule(blocks=lambda n, bs: n // bs), no_running_headroom=_rule(headroom=lambda r: 1),
        no_own_headroom=_rule(headroom=lambda r: r), strict=_rule(strict=True),
        no_headroom=_rule(headroom=lambda r: 0)),
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


def _peak_mistakes(prompt_len: int, prefix_caching: bool) -> list[tuple[int, str]]:
    n, bs = PEAK_SAMPLES, PEAK_BLOCK
    own = _ceil(prompt_len + PEAK_NEW - 1, bs)
    shared = (prompt_len - 1) // bs if prefix_caching else 0
    return [(n * _ceil(prompt_len + PEAK_NEW, bs) - (n - 1) * shared, P["last_token"]),
            (n * own, P["shared_nothing"] if prefix_caching else P["wrong_total"]),
            (n * own - (n - 1) * _ceil(prompt_len, bs), P["partly_filled"]),
            (n * own - (n - 1) * (prompt_len // bs), P["every_full_block"]),
            (n * (prompt_len + PEAK_NEW - 1) // bs, P["floor"])] + (
        [] if prefix_caching else [(n * own - (n - 1) * ((prompt_len - 1) // bs),
                                    P["no_caching"])])


@ck.one_thread
@ck.guarded
def check_predict_peak_blocks(predict_peak_blocks) -> None:
    """predict_peak_blocks() -> {(prompt tokens, prefix caching): the most blocks in use}."""
    name = "predict_peak_blocks"
    case = (f"{PEAK_SAMPLES} requests with the same prompt, {PEAK_NEW} new tokens each, arriving "
            f"together, blocks of {PEAK_BLOCK}, a large pool")
    got = ck.predicted(name, case, ck.prediction(name, case, predict_peak_blocks, serve,
                                                 PagedCache.reserve, BlockPool.allocate),
                       PEAK_KEYS, P["not_a_dict"], P["not_an_int"])
    measured = {key: measure_peak(*key) for key in PEAK_KEYS}
    ck.as_measured(name, case, got, measured, lambda key: _peak_mistakes(*key), P["wrong"],
                   P["otherwise"], lambda key: (f"a {key[0]}-token prompt, prefix caching "
                                                f"{'on' if key[1] else 'off'}"))
    print("  measured: " + "; ".join(
        f"{p}-token prompt, prefix caching {'on' if c else 'off'}: {measured[p, c]} blocks"
        for p, c in PEAK_KEYS))
    ck.passed(name, len(PEAK_KEYS))


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


def _cropped(cache_class, case) -> tuple:
    """(table.blocks, length, pool.ref, pool.free) after cache_class's crop on the case."""
    _, bs, (blocks, length), others, n = case
    tables = [BlockTable(i + 1, list(o), len(o) * bs) for i, o in enumerate(others)]
    mine = BlockTable(0, list(blocks), length)
    pool = _books(bs, max(set(blocks) | {b for o in others for b in o}) + 3, tables, mine)
    cache_class(pool, [mine]).crop(n)
    return mine.blocks, mine.length, pool.ref, list(pool.free)


@ck.guarded
def check_crop(cache_class) -> None:
    """cache_class(pool, [table]).crop(n), against PagedCache.crop, then in a rollback decode."""
    name = "crop"
    if not (isinstance(cache_class, type) and issubclass(cache_class, PagedCache)):
        ck.fail(name, "the class", "a subclass of PagedCache (of BuggyPagedCache)", cache_class,
                C["not_a_class"])
    same_as_buggy = 0
    for case in CROP_CASES:
        label, bs, (blocks0, length), others, n = case
        where = f"{label}: block_size={bs}, table.blocks={blocks0}, length {length} → {n}"
        with ck.forbid(name, PagedCache.crop, BlockPool.crop):
            state = ck.call_hinted(name, where, lambda e: C["raised"], _cropped, cache_class, case)
        want, buggy = _cropped(PagedCache, case), _cropped(BuggyPagedCache, case)
        same_as_buggy += state == buggy
        if state[:2] != want[:2]:
            ck.fail(name, where, f"table.blocks={want[0]}, length {want[1]}",
                    f"table.blocks={state[0]}, length {state[1]}",
                    C["buggy"] + C["symptom"] if state[:2] == buggy[:2] else C["symptom"]
                    if len(state[0]) < len(want[0]) else C["kept"] if len(state[0]) > len(want[0])
                    else C["length"] if state[1] != want[1] else C["release"])
        if state[2:] != want[2:]:
            shared = [b for b in blocks0 if b not in state[0] and want[2][b] > 0]
            ck.fail(name, where, f"pool.ref={want[2]}, pool.free={want[3]}",
                    f"pool.ref={state[2]}, pool.free={state[3]}",
                    C["shared"].format(block=shared[0]) if shared and state[2][shared[0]] == 0
                    else C["books"])
    if same_as_buggy == len(CROP_CASES):
        ck.fail(name, "every case", "a fixed crop", "BuggyPagedCache's results",
                C["all_buggy"] + C["symptom"])
    _check_crop_in_decoding(name, cache_class)
    ck.passed(name, len(CROP_CASES) + 1)


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
    ck.call_hinted(name, case, lambda e: C["lost_block"] + C["symptom"], decode)
    new, alone = seq[len(prompt):len(prompt) + n_new], generate(model, prompt, n_new).tokens
    if new != alone:
        at = next(i for i, (a, b) in enumerate(zip(new, alone)) if a != b)
        ck.fail(name, case, f"target-only greedy: {alone}", new,
                C["text"].format(at=at) + C["symptom"])


# --- exercise 7 (design, a table): a block size for a memory budget ------------------------------
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
DESIGN_BUDGETS = (0.0, 0.05, 0.1, 0.25)


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


def _snapshots() -> list[ck.Labelled]:
    """The positions each running sequence holds, labelled with what the snapshot is."""
    g = random.Random(6)
    chat = [g.randint(5, 40) for _ in range(64)]
    mixed = [g.randint(6, 80) + int(math.exp(g.uniform(math.log(4), math.log(127))))
             for _ in range(48)]
    documents = [g.randint(900, 2000) for _ in range(4)]
    return [ck.Labelled("48 sequences of a mixed workload (prompts of 6-80 tokens, outputs of "
                      "4-127)", mixed), ck.Labelled("64 short chat turns of 5-40 tokens", chat),
            ck.Labelled("4 long documents of 900-2000 tokens", documents),
            ck.Labelled("sequences whose lengths are all multiples of 64", [64, 192, 320, 128])]


def _reserved(lengths, bs) -> str:
    held, taken = sum(lengths), blocks_taken(lengths, bs) * bs
    return f"{taken:,} positions reserved for {held:,} held, {100 * (taken / held - 1):.1f}% waste"


BLOCK_SIZE = ck.Exercise(
    "choose_block_size", cases=[(lengths, w) for lengths in _snapshots() for w in DESIGN_BUDGETS],
    describe=lambda lengths, max_waste: f"{lengths.label}, max_waste={max_waste}",
    reference=reference_block_size,
    explain=lambda lengths, w: _reserved(lengths, reference_block_size(lengths, w)),
    returns=ck.one_of(*BLOCK_SIZES, hint=B["not_a_size"].format(sizes=BLOCK_SIZES)),
    mistakes=ck.named(
        B, against_reserved=lambda lengths, w: _largest(
            lambda bs: blocks_taken(lengths, bs) * bs * (1 - w) <= sum(lengths)),
        strict=lambda lengths, w: _largest(
            lambda bs: blocks_taken(lengths, bs) * bs < (1 + w) * sum(lengths)),
        smallest=lambda lengths, w: 1,
        floor=lambda lengths, w: _largest(
            lambda bs: sum(n // bs for n in lengths) * bs <= (1 + w) * sum(lengths)),
        default=lambda lengths, w: 16),
    otherwise=B["otherwise"])
check_choose_block_size = BLOCK_SIZE.check

# --- exercise 8 (a table): chunked prefill's schedule, by hand -----------------------------------

SCHEDULE_NEW = 64  # new tokens per request: every finished prompt decodes to the end of the case


def _schedule_cases() -> list[tuple[ck.Labelled, int]]:
    """(prompt lengths, labelled, budget); budget > requests, so every schedule ends."""
    cases = [("three prompts, the first shorter than the budget", [5, 40, 12], 16),
             ("one long prompt alone", [30], 8),
             ("three prompts that each fill the budget exactly", [8, 8, 8], 9),
             ("a long prompt first, then short ones that wait for it", [64, 1, 1], 32),
             ("four prompts, a budget barely above the requests", [1, 2, 3, 4], 5),
             ("two prompts that fit in one step", [10, 10], 20),
             ("many decode rows eating into a small budget", [3, 50, 7, 20], 10),
             ("a budget of 6 for three prompts", [17, 33, 5], 6)]
    return [(ck.Labelled(label, lens), budget) for label, lens, budget in cases]


def engine_schedule(prompt_lens: list[int], budget: int) -> list[list[int]]:
    """The prompt tokens each request computed per step in a chunked serve(), from its trace."""
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
        raise ck.Refused(S["not_steps"])
    steps = [ck.int_list(step) for step in got]
    if any(step is None or len(step) != len(prompt_lens) for step in steps):
        raise ck.Refused(S["not_chunks"].format(n=len(prompt_lens)))
    return steps


SCHEDULE_CHUNKS = ck.Exercise(
    "chunk_schedule", cases=_schedule_cases(),
    describe=lambda lens, budget: f"{lens.label}: prompt_lens={list(lens)}, budget={budget}",
    reference=engine_schedule, solution=_schedule_rule(), returns=_a_schedule,
    forbid=(serve,), unchanged=S["unchanged"],
    mistakes=ck.named(S, whole_budget=_schedule_rule(decodes_first=False),
                      same_step=_schedule_rule(same_step=True),
                      newest_first=_schedule_rule(oldest_first=False),
                      even=_schedule_rule(even=True)),
    otherwise=lambda answers: S["otherwise"].format(budget=next(
        case for case, got in answers if got != engine_schedule(*case))[1]))
check_chunk_schedule = SCHEDULE_CHUNKS.check


# --- exercise 9 (a table): which batch sizes to record as CUDA graphs ---------------------------

def padding(batches: list[int], sizes) -> int:
    """Padding rows when each batch runs in the smallest recorded size that holds it."""
    return sum(min(s for s in sizes if s >= b) - b for b in batches)


class Recorded:
    """Recorded sizes, equal to another choice when they cost the workload as many padding rows
    (several choices can tie); shown with that cost."""

    def __init__(self, sizes: tuple, batches: list[int]):
        self.sizes, self.padding = tuple(sizes), padding(batches, sizes)

    def __eq__(self, other) -> bool:
        return isinstance(other, Recorded) and self.padding == other.padding

    def __repr__(self) -> str:
        return f"{self.sizes}, {self.padding:,} padding rows"


def _least_padding(batches: list[int], k: int, weigh=True) -> tuple:
    """The sizes (at most k, the largest batch among them) that pad the batches least: split the
    distinct batch sizes, sorted, into at most k runs, each run padded up to its largest."""
    values, count = sorted(set(batches)), Counter(batches) if weigh else Counter(set(batches))

    def cost(i: int, j: int) -> int:  # values[i..j] run in the graph for values[j]
        return sum(count[v] * (values[j] - v) for v in values[i:j + 1])
    # best[j]: (padding, sizes) for values[0..j], values[j] the largest size, m sizes at most
    best = [(cost(0, j), (values[j],)) for j in range(len(values))]
    for _ in range(k - 1):
        best = [min([best[j]] + [(best[i][0] + cost(i + 1, j), best[i][1] + (values[j],))
                                 for i in range(j)]) for j in range(len(values))]
    return best[-1][1]


def reference_capture_sizes(batches: list[int], k: int) -> Recorded:
    return Recorded(_least_padding(batches, k), batches)


def _powers_of_two(batches, k):  # the usual default, its largest k
    top = 1 << (max(batches) - 1).bit_length()
    return tuple(1 << i for i in range(top.bit_length()))[-k:]


def _most_frequent(batches, k):  # the k - 1 commonest batch sizes, and the largest
    common = [b for b, _ in Counter(batches).most_common() if b != max(batches)][:k - 1]
    return tuple(sorted(common + [max(batches)]))


def _one_at_a_time(batches, k):  # greedy: the largest, then the size that saves the most, ...
    sizes = {max(batches)}
    for _ in range(k - 1):
        options = sorted(set(batches) - sizes)
        if options:
            sizes.add(min(options, key=lambda s: (padding(batches, sizes | {s}), s)))
    return tuple(sorted(sizes))


def _evenly(batches, k):  # k sizes evenly spaced up to the largest
    return tuple(sorted({-(-max(batches) * i // k) for i in range(1, k + 1)}))


def _capture_cases() -> list[tuple[ck.Labelled, int]]:
    """Decode batch sizes, one a step, labelled; k the graphs a server may record."""
    g = random.Random(9)
    ramp = list(range(1, 17)) * 2 + list(range(16, 0, -1))
    steady = [min(48, max(1, round(g.gauss(30, 6)))) for _ in range(200)]
    bursty = [g.choice((1, 1, 1, 2, 2, 3)) for _ in range(150)] + [60, 61, 64, 58, 64] * 4
    drain = [24] * 40 + [23, 21, 18, 14, 9, 5, 3, 2, 1] * 3 + [1] * 30
    g, waves = random.Random(1), []
    for _ in range(4):  # a wave of n requests that run together, then finish a few at a time
        n = g.randint(2, 40)
        waves += [n] * g.randint(5, 40) + list(range(n, 0, -g.randint(1, 6)))
    return [(ck.Labelled(label, batches), k) for label, batches, k in [
        ("a server filling up to 16 rows and draining, twice", ramp, 4),
        ("a steady load of about 30 rows (200 steps)", steady, 4),
        ("mostly 1-3 rows, with bursts near 64", bursty, 3),
        ("24 rows for a long while, then the batch drains", drain, 3),
        ("four waves of requests, each draining a few at a time", waves, 4),
        ("a steady load, room for one graph only", steady, 1),
        ("fewer batch sizes than graphs", [4, 4, 9, 9, 9, 13], 5),
        ("one batch size throughout", [8] * 50, 2)]]


def _recorded(got, batches, k) -> Recorded:
    """The contract: a rising tuple of at most k batch sizes, the largest holding every batch."""
    sizes = ck.int_list(got)
    if sizes is None or not sizes:
        raise ck.Refused(W["not_sizes"])
    if any(s < 1 for s in sizes) or sizes != sorted(set(sizes)):
        raise ck.Refused(W["not_rising"])
    if len(sizes) > k:
        raise ck.Refused(W["too_many"].format(k=k))
    if sizes[-1] < max(batches):
        raise ck.Refused(W["too_small"].format(most=max(batches)))
    return Recorded(tuple(sizes), batches)


CAPTURE = ck.Exercise(
    "capture_sizes", cases=_capture_cases(),
    describe=lambda batches, k: f"{batches.label}, k={k}",
    reference=reference_capture_sizes, returns=_recorded, unchanged=W["unchanged"],
    solution=_least_padding,
    mistakes=ck.named(
        W, powers_of_two=_powers_of_two, most_frequent=_most_frequent,
        one_at_a_time=_one_at_a_time, evenly=_evenly,
        each_once=lambda batches, k: _least_padding(batches, k, weigh=False)),
    otherwise=W["otherwise"])
check_capture_sizes = CAPTURE.check

EXERCISES = (GATHER, MATCHING, ADMISSION, BLOCK_SIZE, SCHEDULE_CHUNKS, CAPTURE)
