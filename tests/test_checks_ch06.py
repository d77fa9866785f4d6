"""Chapter 06's checkers accept the solutions (and other right ways), let a stub's
NotImplementedError through, and reject every plausible wrong answer with a hint that names the
mistake; their cases are sound (the engine decides every expected answer, and every case is the
edge it claims to be), and they are quick and leave the caller's random state alone."""
import copy
import time

import numpy as np
import pytest
import torch

import minikv
from minikv.course.checks import CheckFailed, ch06
from minikv.engine import causal_attention
from minikv.engine.paged import BlockPool, PagedCache, block_hash
from minikv.engine.scheduler import FirstComeFirstServed, Scheduler, Sequence

from conftest import solution_check_cells, stub

# --- exercise 1: gather_keys ----------------------------------------------------------------------


def gather_keys(pool_keys, table, length):
    bs = pool_keys.size(2)
    return torch.stack([pool_keys[table[p // bs], :, p % bs] for p in range(length)], dim=1)


def gather_keys_vectorised(pool_keys, table, length):
    """Also right: the table's blocks, heads first, blocks and slots merged, cut to length."""
    _, nh, bs, hs = pool_keys.shape
    blocks = pool_keys[torch.tensor(table[:-(-length // bs)])]   # (n, nh, bs, hs)
    return blocks.transpose(0, 1).reshape(nh, -1, hs)[:, :length]


def gather_pool_order(pool_keys, table, length):
    return gather_keys(pool_keys, sorted(table), length)


def gather_no_table(pool_keys, table, length):
    bs = pool_keys.size(2)
    return torch.stack([pool_keys[p // bs, :, p % bs] for p in range(length)], dim=1)


def gather_reshape_no_permute(pool_keys, table, length):
    _, nh, _, hs = pool_keys.shape
    return pool_keys[table].reshape(nh, -1, hs)[:, :length]


def gather_swapped(pool_keys, table, length):
    bs = pool_keys.size(2)
    return torch.stack([pool_keys[table[p % bs], :, p // bs] for p in range(length)], dim=1)


def gather_no_cut(pool_keys, table, length):
    _, nh, _, hs = pool_keys.shape
    return pool_keys[table].transpose(0, 1).reshape(nh, -1, hs)


def gather_floor(pool_keys, table, length):
    _, nh, bs, hs = pool_keys.shape
    return pool_keys[table[:length // bs]].transpose(0, 1).reshape(nh, -1, hs)


def gather_positions_first(pool_keys, table, length):
    return gather_keys(pool_keys, table, length).transpose(0, 1)


def gather_batch_axis(pool_keys, table, length):
    return gather_keys(pool_keys, table, length)[None]


def gather_list(pool_keys, table, length):
    bs = pool_keys.size(2)
    return [pool_keys[table[p // bs], :, p % bs] for p in range(length)]


def gather_float64(pool_keys, table, length):
    return gather_keys(pool_keys, table, length).double()


def gather_in_place(pool_keys, table, length):
    table.sort()  # sorts the caller's table
    return gather_keys(pool_keys, table, length)


def gather_by_the_engine(pool_keys, table, length):
    return ch06.engine_read(pool_keys, table, length)


GATHER_WRONG = [
    (gather_pool_order, "in the order of their ids"),
    (gather_no_table, "block p // block_size of the POOL"),
    (gather_reshape_no_permute, "it mixes heads and blocks"),
    (gather_swapped, "an index out of range"),
    (gather_no_cut, "cut to length"),
    (gather_floor, "dropped the partly filled last block"),
    (gather_positions_first, "positions first"),
    (gather_batch_axis, "no batch axis"),
    (gather_list, "return a torch tensor"),
    (gather_float64, "in the pool's dtype"),
    (gather_in_place, "writes nothing"),
    (gather_by_the_engine, "called minikv's own minikv.engine.paged.PagedCache.update"),
]

# --- exercise 2: reserve --------------------------------------------------------------------------


def _copy_block(pool, old, new, layers=None, values=True, keys=True):
    n = len(pool.keys)
    for layer in range(n) if layers is None else layers:
        if keys:
            pool.keys[layer][new] = pool.keys[layer][old]
        if values:
            pool.values[layer][new] = pool.values[layer][old]


def reserve(pool, table, n_new, copy_on_write=None, add=None):
    """The solution, with either step replaceable by a wrong one."""
    bs = pool.page_size
    (copy_on_write or _copy_on_write)(pool, table)
    (add or _add_blocks)(pool, table, -(-(table.length + n_new) // bs))


def _copy_on_write(pool, table, copy=_copy_block, release=True):
    bs = pool.page_size
    if table.length % bs and pool.ref[table.blocks[table.length // bs]] > 1:
        i = table.length // bs
        old, new = table.blocks[i], pool.allocate(table.owner)
        copy(pool, old, new)
        if release:
            pool.release(old, table.owner)
        table.blocks[i] = new


def _add_blocks(pool, table, needed):
    while len(table.blocks) < needed:
        table.blocks.append(pool.allocate(table.owner))


def reserve_append_then_copy(pool, table, n_new):
    """Also right: the new blocks first, the copy after (other block ids, the same meaning)."""
    bs = pool.page_size
    _add_blocks(pool, table, -(-(table.length + n_new) // bs))
    _copy_on_write(pool, table)


def reserve_by_hand(pool, table, n_new):
    """Also right: the pool's books kept by hand instead of allocate/release."""
    bs = pool.page_size

    def take():
        block = pool.free.popleft()
        if block in pool.hash_of:
            del pool.by_hash[pool.hash_of.pop(block)]
        pool.ref[block] = 1
        return block
    i = table.length // bs
    if table.length % bs and pool.ref[table.blocks[i]] > 1:
        new = take()
        for t in pool.keys + pool.values:
            t[new].copy_(t[table.blocks[i]])
        pool.ref[table.blocks[i]] -= 1
        table.blocks[i] = new
    while len(table.blocks) * bs < table.length + n_new:
        table.blocks.append(take())


def reserve_no_copy(pool, table, n_new):
    reserve(pool, table, n_new, copy_on_write=lambda pool, table: None)


def reserve_copies_last_if_shared(pool, table, n_new):  # whether or not it is partly filled
    def cow(pool, table):
        if table.blocks and pool.ref[table.blocks[-1]] > 1:
            old, new = table.blocks[-1], pool.allocate(table.owner)
            _copy_block(pool, old, new)
            pool.release(old, table.owner)
            table.blocks[-1] = new
    reserve(pool, table, n_new, copy_on_write=cow)


def reserve_copies_every_shared(pool, table, n_new):
    def cow(pool, table):
        for i, old in enumerate(table.blocks):
            if pool.ref[old] > 1:
                new = pool.allocate(table.owner)
                _copy_block(pool, old, new)
                pool.release(old, table.owner)
                table.blocks[i] = new
    reserve(pool, table, n_new, copy_on_write=cow)


def reserve_copies_unshared(pool, table, n_new):
    def cow(pool, table):
        bs = pool.page_size
        if table.length % bs:
            i = table.length // bs
            old, new = table.blocks[i], pool.allocate(table.owner)
            _copy_block(pool, old, new)
            pool.release(old, table.owner)
            table.blocks[i] = new
    reserve(pool, table, n_new, copy_on_write=cow)


def reserve_floor(pool, table, n_new):
    _copy_on_write(pool, table)
    _add_blocks(pool, table, (table.length + n_new) // pool.page_size)


def reserve_per_new_token_block(pool, table, n_new):
    _copy_on_write(pool, table)
    for _ in range(-(-n_new // pool.page_size)):
        table.blocks.append(pool.allocate(table.owner))


def reserve_no_release(pool, table, n_new):
    reserve(pool, table, n_new,
            copy_on_write=lambda pool, table: _copy_on_write(pool, table, release=False))


def reserve_no_kv_copy(pool, table, n_new):
    reserve(pool, table, n_new, copy_on_write=lambda pool, table: _copy_on_write(
        pool, table, copy=lambda pool, old, new: None))


def reserve_keys_only(pool, table, n_new):
    reserve(pool, table, n_new, copy_on_write=lambda pool, table: _copy_on_write(
        pool, table, copy=lambda pool, old, new: _copy_block(pool, old, new, values=False)))


def reserve_layer_0_only(pool, table, n_new):
    reserve(pool, table, n_new, copy_on_write=lambda pool, table: _copy_on_write(
        pool, table, copy=lambda pool, old, new: _copy_block(pool, old, new, layers=[0])))


def reserve_copies_the_wrong_way(pool, table, n_new):  # new -> old: the shared block overwritten
    reserve(pool, table, n_new, copy_on_write=lambda pool, table: _copy_on_write(
        pool, table, copy=lambda pool, old, new: _copy_block(pool, new, old)))


def reserve_from_the_end(pool, table, n_new):
    def take():
        block = pool.free.pop()
        pool.ref[block] = 1
        if block in pool.hash_of:
            del pool.by_hash[pool.hash_of.pop(block)]
        return block
    bs = pool.page_size
    i = table.length // bs
    if table.length % bs and pool.ref[table.blocks[i]] > 1:
        new = take()
        _copy_block(pool, table.blocks[i], new)
        pool.ref[table.blocks[i]] -= 1
        table.blocks[i] = new
    while len(table.blocks) * bs < table.length + n_new:
        table.blocks.append(take())


def reserve_keeps_hashes(pool, table, n_new):
    def take():
        block = pool.free.popleft()
        pool.ref[block] = 1
        return block
    bs = pool.page_size
    i = table.length // bs
    if table.length % bs and pool.ref[table.blocks[i]] > 1:
        new = take()
        _copy_block(pool, table.blocks[i], new)
        pool.ref[table.blocks[i]] -= 1
        table.blocks[i] = new
    while len(table.blocks) * bs < table.length + n_new:
        table.blocks.append(take())


def reserve_moves_length(pool, table, n_new):
    reserve(pool, table, n_new)
    table.length += n_new


def reserve_last_block_unguarded(pool, table, n_new):
    last = table.blocks[-1]  # an empty table has none
    if table.length % pool.page_size and pool.ref[last] > 1:
        _copy_on_write(pool, table)
    _add_blocks(pool, table, -(-(table.length + n_new) // pool.page_size))


def reserve_by_the_engine(pool, table, n_new):
    PagedCache(pool, [table]).reserve(n_new)


def reserve_with_copy_on_write(pool, table, n_new):
    bs = pool.page_size
    if table.length % bs and pool.ref[table.blocks[table.length // bs]] > 1:
        i = table.length // bs
        table.blocks[i] = pool.copy_on_write(table.blocks[i], table.owner)
    _add_blocks(pool, table, -(-(table.length + n_new) // bs))


RESERVE_WRONG = [
    (reserve_no_copy, r"Copy it first \(copy-on-write\)"),
    (reserve_copies_last_if_shared, "is full: no position of it will be written"),
    (reserve_copies_every_shared, "is full: no position of it will be written"),
    (reserve_copies_unshared, "held by this table alone"),
    (reserve_floor, "which rounds down"),
    (reserve_per_new_token_block, "empty slots come first"),
    (reserve_no_release, "must drop by one"),
    (reserve_no_kv_copy, "the copy must hold the shared block's K/V"),
    (reserve_keys_only, "copied the keys but not the values"),
    (reserve_layer_0_only, "copied layer 0 only"),
    (reserve_copies_the_wrong_way, "you wrote into a block another table reads"),
    (reserve_from_the_end, "front of pool.free"),
    (reserve_keeps_hashes, "still findable by its old hash"),
    (reserve_moves_length, "writes nothing"),
    (reserve_last_block_unguarded, "it has no last block to look at"),
    (reserve_by_the_engine, "called minikv's own minikv.engine.paged.PagedCache.reserve"),
    (reserve_with_copy_on_write, "called minikv's own minikv.engine.paged.BlockPool.copy_on_write"),
]

# --- exercise 3: matching_blocks ------------------------------------------------------------------


def matching_blocks(prompt, block_size, by_hash):
    blocks, h = [], ""
    for i in range((len(prompt) - 1) // block_size):
        h = block_hash(h, prompt[i * block_size:(i + 1) * block_size])
        if h not in by_hash:
            break
        blocks.append(by_hash[h])
    return blocks


def matching_blocks_while(prompt, block_size, by_hash):
    """Also right: a while loop over token offsets, returning a tuple of numpy ints."""
    blocks, h, start = [], "", 0
    while start + block_size < len(prompt):
        h = block_hash(h, prompt[start:start + block_size])
        if h not in by_hash:
            break
        blocks.append(np.int64(by_hash[h]))
        start += block_size
    return tuple(blocks)


def _match(prompt, bs, by_hash, n=None, chained=True, stop=True, first="", whole=False):
    blocks, h = [], first
    for i in range((len(prompt) - 1) // bs if n is None else n(len(prompt), bs)):
        if whole:
            h = block_hash("", prompt[:(i + 1) * bs])
        else:
            h = block_hash(h if chained else "", prompt[i * bs:(i + 1) * bs])
        if h in by_hash:
            blocks.append(by_hash[h])
        elif stop:
            break
    return blocks


def matching_unchained(prompt, bs, by_hash):
    return _match(prompt, bs, by_hash, chained=False)


def matching_unchained_on(prompt, bs, by_hash):
    return _match(prompt, bs, by_hash, chained=False, stop=False)


def matching_goes_on_after_a_miss(prompt, bs, by_hash):
    return _match(prompt, bs, by_hash, stop=False)


def matching_every_full_block(prompt, bs, by_hash):
    return _match(prompt, bs, by_hash, n=lambda n, bs: n // bs)


def matching_partial_block_too(prompt, bs, by_hash):
    return _match(prompt, bs, by_hash, n=lambda n, bs: -(-n // bs))


def matching_leaves_a_whole_block(prompt, bs, by_hash):
    return _match(prompt, bs, by_hash, n=lambda n, bs: n // bs - 1)


def matching_whole_prefix_hashed(prompt, bs, by_hash):
    return _match(prompt, bs, by_hash, whole=True)


def matching_starts_from_none(prompt, bs, by_hash):
    return _match(prompt, bs, by_hash, first=None)


def matching_hashes(prompt, bs, by_hash):
    blocks, h = [], ""
    for i in range((len(prompt) - 1) // bs):
        h = block_hash(h, prompt[i * bs:(i + 1) * bs])
        if h not in by_hash:
            break
        blocks.append(h)
    return blocks


def matching_pops(prompt, bs, by_hash):
    found = matching_blocks(prompt, bs, by_hash)
    for h in [h for h, b in by_hash.items() if b in found]:
        del by_hash[h]  # "taken"
    return found


def matching_by_the_engine(prompt, bs, by_hash):
    return ch06.engine_shared_prefix(prompt, bs, by_hash)


MATCHING_WRONG = [
    (matching_unchained, "hash each block's tokens alone"),
    (matching_unchained_on, "hash each block's tokens alone"),
    (matching_goes_on_after_a_miss, "go on after a miss"),
    (matching_every_full_block, "Leave at least one token"),
    (matching_partial_block_too, "Leave at least one token"),
    (matching_leaves_a_whole_block, "always leave the last full block"),
    (matching_whole_prefix_hashed, "hash the whole prefix from the start"),
    (matching_starts_from_none, "starting from h = '' "),
    (matching_hashes, "these are hashes"),
    (matching_pops, "matching only looks blocks up"),
    (matching_by_the_engine, "called minikv's own minikv.engine.paged.BlockPool.cached_prefix"),
]

# --- exercise 4: can_admit ------------------------------------------------------------------------


def can_admit(pool, n_tokens, shared, n_running):
    bs = pool.page_size
    takes = -(-n_tokens // bs) - sum(1 for b in shared if pool.ref[b] > 0)
    return pool.n_free >= takes + 1 + n_running


def can_admit_numpy(pool, n_tokens, shared, n_running):
    """Also right: the free blocks left after taking its blocks, compared in numpy."""
    left = pool.n_free - (int(np.ceil(n_tokens / pool.page_size))
                          - int(np.sum(np.array(pool.ref)[shared] > 0)))
    return np.bool_(left > n_running)


def _rule(held, blocks=lambda n, bs: -(-n // bs), headroom=lambda r: 1 + r, strict=False):
    def can_admit(pool, n_tokens, shared, n_running):
        need = blocks(n_tokens, pool.page_size) - held(pool, shared) + headroom(n_running)
        return pool.n_free > need if strict else pool.n_free >= need
    return can_admit


def _held(pool, shared):
    return sum(pool.ref[b] > 0 for b in shared)


admit_no_headroom = _rule(_held, headroom=lambda r: 1)
admit_no_headroom_at_all = _rule(_held, headroom=lambda r: 0)
admit_forgets_the_newcomer = _rule(_held, headroom=lambda r: r)
admit_shared_cost_blocks = _rule(lambda pool, shared: 0)
admit_every_shared_block_free = _rule(lambda pool, shared: len(shared))
admit_subtracts_counts = _rule(lambda pool, shared: sum(pool.ref[b] for b in shared))
admit_floor = _rule(_held, blocks=lambda n, bs: n // bs)
admit_strict = _rule(_held, strict=True)


def admit_int(pool, n_tokens, shared, n_running):
    return int(can_admit(pool, n_tokens, shared, n_running))


def admit_forgets_to_return(pool, n_tokens, shared, n_running):
    can_admit(pool, n_tokens, shared, n_running)


def admit_takes_the_blocks(pool, n_tokens, shared, n_running):
    ok = can_admit(pool, n_tokens, shared, n_running)
    if ok:
        pool.allocate(99)
    return ok


def admit_by_the_engine(pool, n_tokens, shared, n_running):
    scheduler = Scheduler(copy.deepcopy(pool), prefix_caching=False)
    scheduler.running = [None] * n_running
    s = Sequence(0, minikv.Request([1] * n_tokens, 1), [1] * n_tokens, False)
    return scheduler.policy.fits(scheduler, s, scheduler.admission(s))


ADMIT_WRONG = [
    (admit_no_headroom, "without headroom for the running requests"),
    (admit_no_headroom_at_all, "the prompt's blocks alone must fit"),
    (admit_forgets_the_newcomer, "headroom for the newcomer itself"),
    (admit_shared_cost_blocks, "the shared blocks cost free blocks"),
    (admit_every_shared_block_free, "every shared block is free of charge"),
    (admit_subtracts_counts, "reference counts: a block held by two requests"),
    (admit_floor, "which rounds down"),
    (admit_strict, "> instead of >="),
    (admit_int, "return True or False"),
    (admit_forgets_to_return, "did you forget to return it"),
    (admit_takes_the_blocks, "can_admit only decides"),
    (admit_by_the_engine, "called minikv's own minikv.engine.scheduler.Scheduler.admission"),
]

# --- exercise 5 (predict, then measure): blocks in use when requests share a prompt -------------

def predict_peak_blocks():
    out = {}
    for prompt, caching in [(10, True), (12, True), (12, False)]:
        per_request = -(-(prompt + 7 - 1) // 4)
        shared = (prompt - 1) // 4 if caching else 0
        out[prompt, caching] = shared + 4 * (per_request - shared)
    return out


def _peak(**changes):
    keys = {"p10": (10, True), "p12": (12, True), "p12off": (12, False)}

    def predict():
        return {**predict_peak_blocks(), **{keys[k]: v for k, v in changes.items()}}
    predict.__name__ = "peak_" + "_".join(f"{k}_{v}" for k, v in changes.items())
    return predict


PEAK_WRONG = [
    (_peak(p10=14), "never fed"),
    (_peak(p10=16), "you shared nothing"),
    (_peak(p10=7), "only FULL blocks are shared"),
    (_peak(p12=11), "shares one fewer"),
    (_peak(p12off=14), "nothing is shared"),
    (_peak(p12off=18), "you rounded down"),
    (_peak(p10=10.0), "blocks come whole"),
    (lambda: {10: 10, 12: 14}, "one prediction per"),
    (lambda: {(10, True): ch06.measure_peak(10, True), (12, True): 14, (12, False): 20},
     "a prediction is made before the measurement"),
]


def test_peak_blocks_replayed_from_the_log_match_the_pool_steps():
    for prompt, caching in ch06.PEAK_KEYS:
        requests = [minikv.Request(list(range(100, 100 + prompt)), 7) for _ in range(4)]
        outs = minikv.serve(ch06._tiny_model(), requests, page_size=4, prefix_caching=caching,
                            trace=True)
        steps = max(sum(r > 0 for r in s.ref) for s in outs.pool_steps)
        assert ch06.peak_blocks_in_use(outs.pool) == steps == ch06.measure_peak(prompt, caching)


# --- exercise 6 (debug): a paged rollback ---------------------------------------------------------

class PagedCacheFixed(ch06.BuggyPagedCache):
    def crop(self, max_length):
        t, bs = self.tables[0], self.pool.page_size
        t.length = max_length
        while (len(t.blocks) - 1) * bs >= max_length:
            self.pool.release(t.blocks.pop(), t.owner)


class CropKeepsEverything(ch06.BuggyPagedCache):
    def crop(self, max_length):
        self.tables[0].length = max_length


class CropLeaks(ch06.BuggyPagedCache):  # drops the blocks from the table, never gives them back
    def crop(self, max_length):
        t, bs = self.tables[0], self.pool.page_size
        t.length = max_length
        while (len(t.blocks) - 1) * bs >= max_length:
            t.blocks.pop()


class CropFreesShared(ch06.BuggyPagedCache):  # frees a block whoever else holds it
    def crop(self, max_length):
        t, bs = self.tables[0], self.pool.page_size
        t.length = max_length
        while (len(t.blocks) - 1) * bs >= max_length:
            block = t.blocks.pop()
            self.pool.ref[block] = 0
            self.pool.free.append(block)


class CropByTheEngine(ch06.BuggyPagedCache):
    def crop(self, max_length):
        PagedCache.crop(self, max_length)


class CropNotACache:
    pass


CROP_WRONG = [
    (ch06.BuggyPagedCache, "BuggyPagedCache's crop unchanged"),
    (CropKeepsEverything, "give it back"),
    (CropLeaks, "give blocks back with pool.release"),
    (CropFreesShared, "is shared"),
    (CropByTheEngine, "called minikv's own"),
    (CropNotACache, "a subclass of PagedCache"),
]


def test_the_decoding_check_catches_the_bug_on_its_own():
    """The rollback decode alone (no unit case) tells the buggy crop from the right one."""
    ch06._check_crop_in_decoding("crop", PagedCacheFixed)
    with pytest.raises(CheckFailed, match="the table lost a block it still needed"):
        ch06._check_crop_in_decoding("crop", ch06.BuggyPagedCache)


# --- exercise 7 (design): a block size for a memory budget ----------------------------------------

def choose_block_size(lengths, max_waste):
    held = sum(lengths)
    best = 1
    for bs in (2, 4, 8, 16, 32, 64, 128):
        if sum(-(-n // bs) for n in lengths) * bs <= (1 + max_waste) * held:
            best = bs
    return best


def block_size_always_one(lengths, max_waste):
    return 1


def block_size_floor(lengths, max_waste):
    held = sum(lengths)
    return max(bs for bs in (1, 2, 4, 8, 16, 32, 64, 128)
               if sum(n // bs for n in lengths) * bs <= (1 + max_waste) * held)


def block_size_against_reserved(lengths, max_waste):
    held = sum(lengths)
    return max(bs for bs in (1, 2, 4, 8, 16, 32, 64, 128)
               if sum(-(-n // bs) for n in lengths) * bs * (1 - max_waste) <= held)


def block_size_strict(lengths, max_waste):
    held = sum(lengths)
    fits = [bs for bs in (1, 2, 4, 8, 16, 32, 64, 128)
            if sum(-(-n // bs) for n in lengths) * bs < (1 + max_waste) * held]
    return max(fits) if fits else 1


def block_size_vllm_default(lengths, max_waste):
    return 16


def block_size_as_string(lengths, max_waste):
    return str(choose_block_size(lengths, max_waste))


BLOCK_WRONG = [
    (block_size_always_one, "the LARGEST block size"),
    (block_size_floor, "rounded the blocks down"),
    (block_size_against_reserved, "against the positions HELD"),
    (block_size_strict, "≤, not <"),
    (block_size_vllm_default, "vLLM's default"),
    (block_size_as_string, "as an int"),
]


def test_block_size_answers_depend_on_the_workload():
    answers = {label: [ch06.reference_block_size(lengths, w) for w in ch06.DESIGN_BUDGETS]
               for label, lengths in ch06._snapshots()}
    assert len({tuple(a) for a in answers.values()}) == len(answers)
    assert all(a == sorted(a) for a in answers.values())  # a larger budget, a larger block


# --- all exercises --------------------------------------------------------------------------------

CHECKS = {
    "gather_keys": (ch06.check_gather_keys, gather_keys, GATHER_WRONG),
    "reserve": (ch06.check_reserve, reserve, RESERVE_WRONG),
    "matching_blocks": (ch06.check_matching_blocks, matching_blocks, MATCHING_WRONG),
    "can_admit": (ch06.check_can_admit, can_admit, ADMIT_WRONG),
    "predict_peak_blocks": (ch06.check_predict_peak_blocks, predict_peak_blocks, PEAK_WRONG),
    "crop": (ch06.check_crop, PagedCacheFixed, CROP_WRONG),
    "choose_block_size": (ch06.check_choose_block_size, choose_block_size, BLOCK_WRONG),
}


class StubCache(ch06.BuggyPagedCache):  # the crop exercise as students receive it
    crop = stub


@pytest.mark.parametrize("name", CHECKS)
def test_solution_passes(name, capsys):
    checker, solution, _ = CHECKS[name]
    checker(solution)
    assert f"✓ {name}: all " in capsys.readouterr().out


@pytest.mark.parametrize("checker, right", [
    (ch06.check_gather_keys, gather_keys_vectorised),
    (ch06.check_reserve, reserve_append_then_copy),
    (ch06.check_reserve, reserve_by_hand),
    (ch06.check_matching_blocks, matching_blocks_while),
    (ch06.check_can_admit, can_admit_numpy),
], ids=lambda v: getattr(v, "__name__", None))
def test_other_right_ways_pass(checker, right, capsys):
    checker(right)
    assert capsys.readouterr().out.startswith("✓ ")


@pytest.mark.parametrize("name", CHECKS)
def test_stub_raises_not_implemented(name):
    with pytest.raises(NotImplementedError):
        CHECKS[name][0](StubCache if name == "crop" else stub)


@pytest.mark.parametrize("name, wrong, fragment",
                         [(n, w, f) for n, (_, _, ws) in CHECKS.items() for w, f in ws],
                         ids=lambda v: getattr(v, "__name__", None) if callable(v) else
                         (v if v in CHECKS else "hint"))
def test_wrong_answer_rejected_with_its_mistake_named(name, wrong, fragment):
    with pytest.raises(CheckFailed, match=fragment):
        CHECKS[name][0](wrong)


def test_checkers_leave_the_random_state_alone():
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    for checker, solution, _ in CHECKS.values():
        checker(solution)
    assert torch.equal(before, torch.random.get_rng_state())


def test_checkers_are_fast():
    for checker, solution, _ in CHECKS.values():
        start = time.perf_counter()
        checker(solution)
        assert time.perf_counter() - start < 5, checker.__name__


# --- the checkers' cases are sound ----------------------------------------------------------------

def test_gather_reference_is_what_attention_reads():
    """engine_read is what a real decode pass through a PagedCache gives attention (a tiny model,
    a table of scattered blocks), and the keys a contiguous KVCache holds for the same tokens."""
    model = minikv.GPT(minikv.GPTConfig.preset("tiny")).eval()
    ids = torch.arange(1, 12)[None]                                       # 11 tokens
    pool = BlockPool(model.config, num_blocks=8, page_size=4)
    pool.free.rotate(3)                                # the table will not be blocks 0, 1, 2
    table = minikv.engine.paged.BlockTable(owner=0)
    cache, seen = PagedCache(pool, [table]), []

    def record(q, k, v):
        seen.append(k)
        return causal_attention(q, k, v)
    plain = minikv.KVCache.for_model(model, max_len=16)
    with torch.no_grad():
        cache.reserve(10)
        model(ids[:, :10], cache=cache)
        cache.reserve(1)
        model(ids[:, 10:], cache=cache, attention=record)                 # layer 0 first
        model(ids, cache=plain)
    assert table.blocks == [5, 6, 7]
    torch.testing.assert_close(ch06.engine_read(pool.keys[0], table.blocks, 11), seen[0][0],
                               rtol=0, atol=0)
    torch.testing.assert_close(seen[0][0], plain.keys[0][0, :, :11])
    assert torch.equal(gather_keys(pool.keys[0], table.blocks, 11), seen[0][0])


def test_gather_cases_cover_the_edges():
    cases = ch06.GATHER_CASES
    assert any(length % bs for _, _, _, bs, _, _, length in cases)
    assert any(length % bs == 0 and len(table) == length // bs
               for _, _, _, bs, _, table, length in cases)
    assert any(len(table) * bs > length + bs - 1 for _, _, _, bs, _, table, length in cases)
    assert any(table != sorted(table) for *_, table, _ in cases)
    assert {1, 16} <= {bs for _, _, _, bs, *_ in cases}


def test_reserve_cases_cover_copy_on_write_and_its_absence():
    """By the engine's own reserve: cases with and without a copy, with new blocks and without,
    an empty table, a hashed block reallocated, blocks of 1 and of 16."""
    kinds = set()
    for i, case in enumerate(ch06.RESERVE_CASES):
        pool, _, mine = ch06.reserve_pool(case, i)
        before = list(mine.blocks)
        hashed = dict(pool.hash_of)
        PagedCache(pool, [mine]).reserve(case[5])
        copied = any(a != b for a, b in zip(before, mine.blocks))
        kinds.add("copy" if copied else "no copy")
        kinds.add("new blocks" if len(mine.blocks) > len(before) else "no new block")
        if not before:
            kinds.add("empty table")
        if any(b in hashed and b not in pool.hash_of for b in mine.blocks):
            kinds.add("hash forgotten")
        if not copied and case[4][1] % case[1] == 0 and any(pool.ref[b] > 1 for b in before):
            kinds.add("full shared blocks kept")
    assert kinds >= {"copy", "no copy", "new blocks", "no new block", "empty table",
                     "hash forgotten", "full shared blocks kept"}
    assert {1, 4, 16} <= {case[1] for case in ch06.RESERVE_CASES}


def test_matching_every_mistake_is_caught_by_some_case():
    cases = ch06._matching_cases()
    for wrong, _ in MATCHING_WRONG[:8]:
        assert any(list(wrong(p, bs, h)) != ch06.engine_shared_prefix(p, bs, h)
                   for _, p, bs, h in cases), wrong.__name__
    for _, prompt, bs, by_hash in cases:  # the reference agrees with the solution everywhere
        assert matching_blocks(prompt, bs, by_hash) == ch06.engine_shared_prefix(prompt, bs,
                                                                                 by_hash)


def test_admission_cases_sit_at_the_edges_and_the_mistakes_differ():
    """Every case has the free blocks it claims (exactly enough, one short, ...), the engine
    says yes and no, and each usual mistake gives its own answers, unlike the right ones, so its
    hint is unambiguous."""
    cases = ch06._admission_cases()
    answers = []
    for case in cases:
        pool, seq, shared, n_running = ch06.admission_state(case)
        need = (-(-len(seq) // pool.page_size) - sum(pool.ref[b] > 0 for b in shared) + 1
                + n_running)
        assert pool.n_free - need == case[-1], case[0]
        answers.append(ch06.engine_admits(case))
        assert answers[-1] == (case[-1] >= 0)
    assert True in answers and False in answers
    vectors = {}
    for name, rule, _ in ch06.ADMISSION_MISTAKES:
        vector = []
        for case in cases:
            pool, seq, shared, n_running = ch06.admission_state(case)
            vector.append(rule(ch06._admission_numbers(pool, len(seq), shared), n_running))
        assert vector != answers, name
        vectors[name] = tuple(vector)
    assert len(set(vectors.values())) == len(vectors), vectors


def test_the_admission_rule_is_what_serve_applies(monkeypatch):
    """The solution's rule, on the pool a real serve run has each time a request comes up for
    admission, gives the server's own decision (a small pool, a shared prefix: some wait)."""
    model = minikv.GPT(minikv.GPTConfig.preset("tiny")).eval()
    decisions = []
    original = FirstComeFirstServed.fits

    def watch(self, sched, s, admission):
        mine = can_admit(copy.deepcopy(sched.pool), len(s.tokens), admission.shared,
                         len(sched.running))
        decisions.append((mine, original(self, sched, s, admission)))
        return decisions[-1][1]
    monkeypatch.setattr(FirstComeFirstServed, "fits", watch)
    prefix = list(range(1, 14))
    requests = [minikv.Request(prefix + [20 + i] * (i % 3 + 1), 6 + 3 * i, arrival=i // 2)
                for i in range(8)]
    with torch.no_grad():
        minikv.serve(model, requests, page_size=4, num_blocks=14)
    assert decisions and all(mine == got for mine, got in decisions), decisions
    assert {True, False} <= {got for _, got in decisions}


# --- the check cells cannot be silenced -----------------------------------------------------------

def test_a_patched_checker_does_not_silence_the_check_cell(monkeypatch):
    import minikv.course.checks as checks

    def silent(fn):
        print("✓ reserve: all 9 cases pass")
    monkeypatch.setattr(ch06, "check_reserve", silent)
    monkeypatch.setattr(ch06, "RESERVE_CASES", [])
    with pytest.raises(CheckFailed, match="copy-on-write"):
        checks.fresh("ch06").check_reserve(reserve_no_copy)


def test_check_cells_are_two_lines_after_their_exercise():
    cells = solution_check_cells("06_many_requests.ipynb", "ch06")
    for before, _, _, passed in cells:
        assert f"def {passed[0]}(" in before or f"class {passed[0]}(" in before
    assert [called for _, _, called, _ in cells] == [
        "gather_keys", "reserve", "matching_blocks", "can_admit", "predict_peak_blocks", "crop",
        "choose_block_size"]
