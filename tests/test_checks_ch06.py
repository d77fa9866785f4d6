"""Chapter 06's checkers: solutions and other right ways pass, stubs go through, each wrong answer
gets its hint (the tables' named mistakes in test_checks_table.py); the cases are sound."""
import copy
import itertools
import re
from dataclasses import replace
from functools import partial

import numpy as np
import pytest
import torch

import minikv
from minikv.course.checks import CheckFailed, ch06
from minikv.engine import causal_attention
from minikv.engine.paged import BlockPool, PagedCache
from minikv.engine.scheduler import FirstComeFirstServed

from conftest import stub


def gather_keys(pool_keys, table, length):
    bs = pool_keys.size(2)
    return torch.stack([pool_keys[table[p // bs], :, p % bs] for p in range(length)], dim=1)


def merged(pool_keys, table, length, n_blocks=lambda length, bs: None, cut=True):
    """Also right (as it is): heads first, the blocks and slots merged, cut to length."""
    _, nh, bs, hs = pool_keys.shape
    keys = pool_keys[table[:n_blocks(length, bs)]].transpose(0, 1).reshape(nh, -1, hs)
    return keys[:, :length] if cut else keys


def _copy_kv(pool, old, new, layers=None, keys=True, values=True):
    for layer in range(len(pool.keys)) if layers is None else layers:
        for tensors in [pool.keys] * keys + [pool.values] * values:
            tensors[layer][new] = tensors[layer][old]


def _take(from_end=False, forget=True):
    """pool.allocate by hand (or from the wrong end, or keeping the block's hash)."""
    def take(pool, owner):
        block = pool.free.pop() if from_end else pool.free.popleft()
        if forget and block in pool.hash_of:
            del pool.by_hash[pool.hash_of.pop(block)]
        pool.ref[block] = 1
        return block
    return take


def _partly_filled_shared(pool, table):
    i = table.length // pool.page_size
    return [i] if table.length % pool.page_size and pool.ref[table.blocks[i]] > 1 else []


def reserve(pool, table, n_new, which=_partly_filled_shared, kv=_copy_kv, take=None,
            release=lambda pool, block, owner: pool.release(block, owner), copy_first=True,
            need=lambda table, n_new, bs: -(-(table.length + n_new) // bs)):
    """The solution, with any of its steps replaceable by a wrong one."""
    take = take or (lambda pool, owner: pool.allocate(owner))

    def copy_on_write():
        for i in which(pool, table):
            old, new = table.blocks[i], take(pool, table.owner)
            kv(pool, old, new)
            release(pool, old, table.owner)
            table.blocks[i] = new
    if copy_first:
        copy_on_write()
    for _ in range(need(table, n_new, pool.page_size) - len(table.blocks)):
        table.blocks.append(take(pool, table.owner))
    if not copy_first:
        copy_on_write()


def predict_peak_blocks():
    return {(10, True): 10, (12, True): 14, (12, False): 20}


def _peak(**changes):
    return lambda: {**predict_peak_blocks(), **{(int(k[1:3]), k[3:] != "off"): v
                                                for k, v in changes.items()}}


def _cropper(give_back=lambda pool, block, owner: pool.release(block, owner),
             past_the_end=lambda t, bs, n: (len(t.blocks) - 1) * bs >= n):
    class Crop(ch06.BuggyPagedCache):
        def crop(self, max_length):
            t, bs = self.tables[0], self.pool.page_size
            t.length = max_length
            while past_the_end(t, bs, max_length):
                give_back(self.pool, t.blocks.pop(), t.owner)
    return Crop


PagedCacheFixed = _cropper()
CODE = {ch06.check_reserve: reserve, ch06.check_predict_peak_blocks: predict_peak_blocks,
        ch06.check_crop: PagedCacheFixed}  # the tables' solutions: test_checks_table.py
RIGHT = [
    (ch06.check_gather_keys, merged),
    (ch06.check_reserve, partial(reserve, copy_first=False)),
    (ch06.check_reserve, partial(reserve, take=_take(), release=lambda pool, block, owner:
                                 pool.ref.__setitem__(block, pool.ref[block] - 1))),
    (ch06.check_matching_blocks, lambda prompt, bs, by_hash: tuple(
        np.int64(b) for b in ch06._match(prompt, bs, by_hash))),
    (ch06.check_can_admit, lambda pool, n_tokens, shared, n_running: np.bool_(
        pool.n_free - np.ceil(n_tokens / pool.page_size) + np.sum(np.array(pool.ref)[shared] > 0)
        > n_running)),
]
MISTAKES = {  # checker: [(wrong answer, a fragment of the hint it must get)]; the tables' named
    #            mistakes are fed by test_checks_table.py
    ch06.check_gather_keys: [
        (lambda k, table, n: gather_keys(k, table, len(table) * k.size(2) + 1),
         "an index out of range"),
        (partial(merged, cut=False), "cut to length"),
        (partial(merged, n_blocks=lambda length, bs: length // bs, cut=False),
         "dropped the partly filled"),
        (lambda k, table, n: gather_keys(k, table, n).transpose(0, 1), "positions first"),
        (lambda k, table, n: gather_keys(k, table, n)[None], "no batch axis"),
        (lambda k, table, n: list(gather_keys(k, table, n).unbind(1)), "return a torch tensor"),
        (lambda k, table, n: gather_keys(k, table, n).double(), "in the pool's dtype"),
        (lambda k, table, n: gather_keys(k, table.sort() or table, n), "writes nothing"),
        (ch06.engine_read, "called minikv's own minikv.engine.paged.PagedCache.update")],
    ch06.check_reserve: [(partial(reserve, **wrong), fragment) for wrong, fragment in [
        (dict(which=lambda pool, table: []), r"Copy it first \(copy-on-write\)"),
        (dict(which=lambda pool, table: [len(table.blocks) - 1] if table.blocks
              and pool.ref[table.blocks[-1]] > 1 else []), "is full: no position of it"),
        (dict(which=lambda pool, table: [i for i, b in enumerate(table.blocks)
                                         if pool.ref[b] > 1]), "is full: no position of it"),
        (dict(which=lambda pool, table: [table.length // pool.page_size]
              if table.length % pool.page_size else []), "held by this table alone"),
        (dict(need=lambda table, n_new, bs: (table.length + n_new) // bs), "which rounds down"),
        (dict(need=lambda table, n_new, bs: len(table.blocks) + -(-n_new // bs)),
         "empty slots come first"),
        (dict(release=lambda *args: None), "must drop by one"),
        (dict(kv=lambda *args: None), "the copy must hold the shared block's K/V"),
        (dict(kv=partial(_copy_kv, values=False)), "copied the keys but not the values"),
        (dict(kv=partial(_copy_kv, layers=[0])), "copied layer 0 only"),
        (dict(kv=lambda pool, old, new: _copy_kv(pool, new, old)), "you wrote into a block"),
        (dict(take=_take(from_end=True)), "front of pool.free"),
        (dict(take=_take(forget=False)), "still findable by its old hash"),
        (dict(which=lambda pool, table: [] if table.blocks[-1] < 0 else
              _partly_filled_shared(pool, table)), "it has no last block to look at"),
    ]] + [
        (lambda pool, table, n: (reserve(pool, table, n),
                                 setattr(table, "length", table.length + n)), "writes nothing"),
        (lambda pool, table, n: PagedCache(pool, [table]).reserve(n),
         "called minikv's own minikv.engine.paged.PagedCache.reserve"),
        (lambda pool, table, n: pool.copy_on_write(table.blocks[-1], table.owner),
         "called minikv's own minikv.engine.paged.BlockPool.copy_on_write")],
    ch06.check_matching_blocks: [
        (partial(ch06._match, chained=False, stop=False), "hash each block's tokens alone"),
        (lambda prompt, bs, by_hash: ch06._match(prompt, bs, by_hash, -(-len(prompt) // bs)),
         "Leave at least one token"),
        (lambda prompt, bs, by_hash: [], "no block found: walk the prompt's full blocks"),
        (lambda prompt, bs, by_hash: [h for h, b in by_hash.items()
                                      if b in ch06._match(prompt, bs, by_hash)],
         "these are hashes"),
        (lambda prompt, bs, by_hash: [by_hash.pop(h) for h in list(by_hash)[:1]],
         "matching only looks blocks up"),
        (ch06.engine_shared_prefix, "called minikv's own minikv.engine.paged.BlockPool.cached_")],
    ch06.check_can_admit: [
        (lambda *args: int(ch06._rule()(*args)), "return True or False"),
        (lambda *args: None, "did you forget to return it"),
        (lambda pool, *args: pool.allocate(99) > -1, "can_admit only decides"),
        (ch06.engine_admits, "called minikv's own minikv.engine.scheduler.Scheduler.admission")],
    ch06.check_predict_peak_blocks: [
        (_peak(p10=14), "never fed"), (_peak(p10=16), "you shared nothing"),
        (_peak(p10=7), "only FULL blocks are shared"), (_peak(p12=11), "shares one fewer"),
        (_peak(p12off=14), "nothing is shared"), (_peak(p12off=18), "you rounded down"),
        (_peak(p10=10.0), "blocks come whole"), (lambda: {10: 10, 12: 14}, "one prediction per"),
        (lambda: {(10, True): ch06.measure_peak(10, True), (12, True): 14, (12, False): 20},
         "a prediction is made before the measurement")],
    ch06.check_crop: [
        (ch06.BuggyPagedCache, "BuggyPagedCache's crop unchanged"),
        (_cropper(past_the_end=lambda *args: False), "give it back"),
        (_cropper(give_back=lambda *args: None), "give blocks back with pool.release"),
        (_cropper(give_back=lambda pool, block, owner: (pool.ref.__setitem__(block, 0),
                                                        pool.free.append(block))), "is shared"),
        (type("CropByTheEngine", (ch06.BuggyPagedCache,),
              {"crop": lambda self, n: PagedCache.crop(self, n)}), "called minikv's own"),
        (type("NotACache", (), {}), "a subclass of PagedCache")],
    ch06.check_choose_block_size: [
        (lambda lengths, w: str(ch06.reference_block_size(lengths, w)), "as an int")],
    ch06.check_capture_sizes: [
        (lambda batches, k: None, "return the recorded batch sizes as a tuple"),
        (lambda batches, k: [float(s) for s in ch06._least_padding(batches, k)], "tuple of ints"),
        (lambda batches, k: ch06._least_padding(batches, k)[::-1], "smallest first"),
        (lambda batches, k: (0,) + ch06._least_padding(batches, k), "positive sizes"),
        (lambda batches, k: tuple(sorted(set(batches))), "record at most k"),
        (lambda batches, k: ch06._least_padding(batches, k)[:-1] or (1,), "the largest batch"),
        (lambda batches, k: [batches.sort(), ch06._least_padding(batches, k)][1],
         "keep batches as it was given")],
    ch06.check_chunk_schedule: [
        (lambda lens, budget: None, "return a list of steps"),
        (lambda lens, budget: [sum(lens)], "each step must be a list of"),
        (lambda lens, budget: [list(lens)], "oldest first, each at most what it has left"),
        (lambda lens, budget: [ch06._schedule_rule()(lens, budget), lens.clear()][0],
         "keep prompt_lens as it was given"),
        (ch06.engine_schedule, "called minikv's own minikv.engine.serving.serve")],
}
WRONG = [(checker, wrong, fragment) for checker, pairs in MISTAKES.items()
         for wrong, fragment in pairs]


@pytest.mark.parametrize("checker, solution", CODE.items(), ids=lambda v: v.__name__)
def test_the_solution_passes_and_leaves_the_random_state(checker, solution, capsys):
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    checker(solution)
    assert torch.equal(before, torch.random.get_rng_state())
    assert re.search(r"✓ \w+: all \d+ cases pass\n$", capsys.readouterr().out)
    with pytest.raises(NotImplementedError):
        checker(type("Stub", (ch06.BuggyPagedCache,), {"crop": stub})
                if checker is ch06.check_crop else stub)


@pytest.mark.parametrize("checker, right", RIGHT, ids=lambda v: getattr(v, "__name__", ""))
def test_other_right_ways_pass(checker, right, capsys):
    checker(right)
    assert capsys.readouterr().out.startswith("✓ ")


@pytest.mark.parametrize("checker, wrong, fragment", WRONG, ids=[
    f"{c.__name__[6:]}-{i}" for i, (c, _, _) in enumerate(WRONG)])
def test_a_wrong_answer_is_rejected_with_its_mistake_named(checker, wrong, fragment):
    with pytest.raises(CheckFailed, match=fragment):
        checker(wrong)


# --- the checkers' cases are sound ----------------------------------------------------------------

def test_gather_reference_is_what_attention_reads():
    """engine_read is what a real decode pass through a PagedCache gives attention."""
    model = minikv.GPT(minikv.GPTConfig.preset("tiny")).eval()
    ids = torch.arange(1, 12)[None]                                       # 11 tokens
    pool = BlockPool(model.config, num_blocks=8, page_size=4)
    pool.free.rotate(3)                                # the table will not be blocks 0, 1, 2
    table = minikv.engine.paged.BlockTable(owner=0)
    cache, seen = PagedCache(pool, [table]), []
    with torch.no_grad():
        cache.reserve(10)
        model(ids[:, :10], cache=cache)
        cache.reserve(1)
        model(ids[:, 10:], cache=cache,
              attention=lambda q, k, v: (seen.append(k), causal_attention(q, k, v))[1])
    assert table.blocks == [5, 6, 7]
    assert torch.equal(ch06.engine_read(pool.keys[0], table.blocks, 11), seen[0][0])


def test_reserve_cases_free_lists_hold_every_free_block():
    for label, _, n, others, (blocks, _), _, order, _ in ch06.RESERVE_CASES:
        held = {b for table, _ in others for b in table} | set(blocks)
        assert order is None or sorted(order) == sorted(set(range(n)) - held), label


def test_admission_cases_sit_at_the_edges():
    """Every case has the free blocks it claims (exactly enough, one short, ...)."""
    for case, (pool, n_tokens, shared, n_running) in zip(ch06._admission_cases(),
                                                         ch06.ADMISSION.cases):
        need = -(-n_tokens // pool.page_size) - ch06._held(pool, shared) + 1 + n_running
        assert pool.n_free - need == case[-1], case[0]
        assert ch06.engine_admits(pool, n_tokens, shared, n_running) == (case[-1] >= 0)


def test_the_admission_rule_is_what_serve_applies(monkeypatch):
    """The solution's rule, on the pools of a real serve run, gives the server's decisions."""
    decisions, original = [], FirstComeFirstServed.fits

    def watch(self, sched, s, blocks, tokens):
        pool = copy.deepcopy(sched.pool)  # less the blocks this step's running rows will take
        for _ in range(sched.promised):
            pool.free.pop()
        mine = ch06._rule()(pool, len(s.tokens), sched.admission(s)[0].found,
                       len(sched.running))
        decisions.append((mine, original(self, sched, s, blocks, tokens)))
        return decisions[-1][1]
    monkeypatch.setattr(FirstComeFirstServed, "fits", watch)
    prefix = list(range(1, 14))
    requests = [minikv.Request(prefix + [20 + i] * (i % 3 + 1), 6 + 3 * i, arrival=i // 2)
                for i in range(8)]
    with torch.no_grad():
        minikv.serve(ch06._tiny_model(), requests, page_size=4, num_blocks=14)
    assert decisions and all(mine == got for mine, got in decisions), decisions
    assert {True, False} <= {got for _, got in decisions}


def test_the_decoding_check_catches_the_bug_on_its_own():
    """The rollback decode alone (no unit case) tells the buggy crop from the right one."""
    ch06._check_crop_in_decoding("crop", PagedCacheFixed)
    with pytest.raises(CheckFailed, match="the table lost a block it still needed"):
        ch06._check_crop_in_decoding("crop", ch06.BuggyPagedCache)


def test_block_size_answers_depend_on_the_workload():
    answers = {tuple(lengths): [ch06.reference_block_size(lengths, w) for w in
                                ch06.DESIGN_BUDGETS] for lengths in ch06._snapshots()}
    assert len({tuple(a) for a in answers.values()}) == len(answers)
    assert all(a == sorted(a) for a in answers.values())  # a larger budget, a larger block



def test_chunk_schedule_cases_are_what_the_engine_does():
    """The hand rule and the engine's chunked-prefill trace agree on every case, the cases cover a
    step where decode rows take part of the budget and one where a prompt gets nothing, and every
    named mistake changes some case's answer."""
    rule = ch06._schedule_rule()
    cases = ch06._schedule_cases()
    for lens, budget in cases:
        assert rule(lens, budget) == ch06.engine_schedule(lens, budget)
    schedules = [rule(lens, budget) for lens, budget in cases]
    assert any(sum(step) < budget and any(step) for (_, budget), sched in zip(cases, schedules)
               for step in sched[1:])
    assert any(0 in step for sched in schedules for step in sched)
    for hint, wrong in ch06.SCHEDULE_CHUNKS.mistakes.items():
        assert any(wrong(list(lens), budget) != sched
                   for (lens, budget), sched in zip(cases, schedules)), hint


def test_a_wrong_gather_shows_the_slots_it_read():
    """The message names the pool slots each answer's positions hold, in runs."""
    with pytest.raises(CheckFailed) as info:
        ch06.check_gather_keys(ch06.GATHER.mistakes[ch06.G["sorted"]])
    assert ("expected: 'pool_keys[5, :, 0..3], pool_keys[2, :, 0..3], pool_keys[7, :, 0..3], "
            "pool_keys[0, :, 0..1]'\n  got:      'pool_keys[0, :, 0..3], pool_keys[2, :, 0..3], "
            "pool_keys[5, :, 0..3], pool_keys[7, :, 0..1]'") in str(info.value)
    mixed = ch06._slots(ch06.GATHER.mistakes[ch06.G["reshape"]](*ch06.GATHER.cases[0]))
    assert "position(s) from no single slot" in mixed


def capture_by_trying_every_choice(batches, k):
    """Also right: every choice of at most k sizes among the batch sizes, the largest in each."""
    values = sorted(set(batches))
    choices = [c + (values[-1],) for m in range(k) for c in itertools.combinations(values[:-1], m)]
    return min(choices, key=lambda sizes: ch06.padding(batches, sizes))


def test_capture_sizes_a_brute_force_passes_and_the_cases_tell_the_mistakes_apart(capsys):
    """Where trying every choice is cheap it passes (and agrees with the reference); each named
    mistake pads more than the least on some case, and no two mistakes give the same answers."""
    small = [(b, k) for b, k in ch06.CAPTURE.cases if len(set(b)) <= 24]
    for batches, k in small:
        assert ch06.padding(batches, capture_by_trying_every_choice(batches, k)) == \
            ch06.reference_capture_sizes(batches, k).padding, batches.label
    exercise = replace(ch06.CAPTURE, cases=small)
    exercise.check(capture_by_trying_every_choice)
    assert capsys.readouterr().out.startswith("✓ capture_sizes")
    answers = {hint: tuple(ch06.padding(b, wrong(b, k)) for b, k in ch06.CAPTURE.cases)
               for hint, wrong in ch06.CAPTURE.mistakes.items()}
    best = tuple(ch06.reference_capture_sizes(b, k).padding for b, k in ch06.CAPTURE.cases)
    assert all(a != best and all(x >= y for x, y in zip(a, best)) for a in answers.values())
    assert len(set(answers.values())) == len(answers)
    assert ch06.padding([3, 5, 9], (4, 9)) == 1 + 4 + 0  # each in the smallest size holding it
    assert repr(ch06.Recorded((4, 9), [3, 5, 9])) == "(4, 9), 5 padding rows"
