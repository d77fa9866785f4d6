"""Chapter 13's checkers accept the solutions (and other right ways), let a stub's
NotImplementedError through, and reject every plausible wrong answer with a hint that names the
mistake. shard_attention and choose_tp are checked from data (tests/test_checks_table.py feeds
them their own mistakes); the code checkers' mistakes are fed here from their own data (the
prediction's, ROW_MISTAKES), the rest are listed here."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import minikv
from minikv.course.checks import ch13
from minikv.course.parallel import Unmatched, in_threads
from minikv.engine.parallel import RowParallel, shard

from conftest import assert_mistake_named, assert_right_ways_pass, checker_id, stub

PREDICT, ROW = ch13.check_predict_cache_per_rank, ch13.check_row_parallel
RESTORE = ch13.check_restore_blocks


# --- right answers -------------------------------------------------------------------------------
def predict_llama_per_rank():
    return {tp: 32 * 2 * 128 * 2 * max(8 // tp, 1) for tp in (1, 2, 4, 8, 16)}


def cache_per_rank(model, world):
    return [minikv.kv_cache_bytes(shard(model, r, world).config, 1, dtype=model.dtype)
            for r in range(world)]


def cache_per_rank_by_heads(model, world):  # also right: counted from the config by hand
    c = model.config
    if c.kv_lora_rank is not None:
        per_layer = c.kv_lora_rank + c.qk_rope_head_dim
    else:
        per_layer = 2 * c.head_dim * max(c.kv_heads // world, 1)
    return [c.kv_layers * per_layer * 4] * world


class RowFixed(ch13.BuggyRowParallel):
    def forward(self, x):
        y = F.linear(x, self.weight)
        dist.all_reduce(y)
        return y if self.bias is None else y + self.bias


class RowBiasOnRankZero(ch13.BuggyRowParallel):  # also right: the bias once, before the sum
    def forward(self, x):
        bias = self.bias if self.bias is not None and dist.get_rank() == 0 else None
        y = F.linear(x, self.weight, bias)
        dist.all_reduce(y)
        return y


class RowBiasShared(ch13.BuggyRowParallel):  # also right: a world-th of the bias on each rank
    def forward(self, x):
        bias = None if self.bias is None else self.bias / dist.get_world_size()
        y = F.linear(x, self.weight, bias)
        dist.all_reduce(y)
        return y


# --- wrong answers -------------------------------------------------------------------------------
class RowOnlyRankZeroReduces(RowFixed):
    def forward(self, x):
        y = F.linear(x, self.weight)
        if dist.get_rank() == 0:
            dist.all_reduce(y)
        return y if self.bias is None else y + self.bias


class RowEngine(ch13.BuggyRowParallel):  # the engine's layer, reached through a method
    calls = 0

    def forward(self, x):
        return RowParallel.forward(self, x)


class RowTwiceHalved(RowFixed):  # right outputs, but two all-reduces a pass
    def forward(self, x):
        y = F.linear(x, self.weight)
        dist.all_reduce(y)
        dist.all_reduce(y)
        y = y / dist.get_world_size()
        return y if self.bias is None else y + self.bias


class RowFlat(RowFixed):
    def forward(self, x):
        return super().forward(x).flatten()


def restore_from_the_back(keys, values, there, pool_keys, pool_values, free, ps):
    """Also right: other fresh blocks (the newest free), one position at a time."""
    n = keys.shape[2]
    table = [free.pop() for _ in range(-(-n // ps))]
    for pool, src in ((pool_keys, keys), (pool_values, values)):
        for layer, x in zip(pool, src):
            for p in range(n):
                layer[table[p // ps], :, p % ps] = x[:, p]
    return table


def restore_whole_last_block(keys, values, there, pool_keys, pool_values, free, ps):
    """Wrong: the last chunk written as if it filled its block (a shape error when partial)."""
    table = [free.pop(0) for _ in range(-(-keys.shape[2] // ps))]
    for pool, src in ((pool_keys, keys), (pool_values, values)):
        for layer, x in zip(pool, src):
            for i, block in enumerate(table):
                layer[block] = x[:, i * ps:(i + 1) * ps]
    return table


def restore_and_clear(keys, values, there, pool_keys, pool_values, free, ps):
    for layer in pool_keys + pool_values:  # "a clean pool first": other requests' K/V gone
        layer.zero_()
    return ch13.restore_by_hand(keys, values, there, pool_keys, pool_values, free, ps)


def restore_in_the_tree(keys, values, there, pool_keys, pool_values, free, ps):
    """Wrong: the engine's RadixTree.restore does it (on a pool around these tensors)."""
    table, k, v, left = ch13.engine_restore(keys, values, pool_keys, pool_values, free, ps)
    for mine, theirs in zip(pool_keys + pool_values, k + v):
        mine.copy_(theirs)
    free[:] = left
    return table


def restore_used_blocks(keys, values, there, pool_keys, pool_values, free, ps):
    taken = [b for b in range(pool_keys[0].shape[0]) if b not in free]
    table = taken[-(-(-keys.shape[2] // ps)):]
    return ch13.restore_by_hand(keys, values, there, pool_keys, pool_values, list(table), ps)


def _llama(tp, value):
    return lambda: {**predict_llama_per_rank(), tp: value}


WRONG = {
    PREDICT: [((lambda: None, cache_per_rank), "did you forget"),
              ((lambda: {1: 131072}, cache_per_rank), "a dict"),
              ((lambda: {**predict_llama_per_rank(), 2: 65536.0}, cache_per_rank), "an int"),
              ((lambda: {tp: minikv.kv_cache_bytes(minikv.GPTConfig.preset("target"), 1)
                         for tp in (1, 2, 4, 8, 16)}, cache_per_rank),
               "a prediction is made before the measurement"),
              ((predict_llama_per_rank, lambda m, w: sum(cache_per_rank(m, w))),
               "one int per rank"),
              ((predict_llama_per_rank, lambda m, w: cache_per_rank(m, w)[:1]),
               "one int per rank"),
              ((predict_llama_per_rank, lambda m, w: [x + 4 for x in cache_per_rank(m, w)]),
               "each entry is kv_cache_bytes")] + [
        ((_llama(tp, w), cache_per_rank), hint)
        for tp in ch13.TPS for w, hint in ch13._llama_mistakes(tp)] + [
        ((predict_llama_per_rank, lambda m, w, hint=hint: [
            ch13._ours_mistakes(m, w)[hint][r] for r in range(w)]), hint)
        for hint in (ch13.P["ours_whole"], ch13.P["ours_divided"], ch13.P["ours_query"],
                     ch13.P["ours_total"])],
    ROW: [(ch13.BuggyRowParallel, "BuggyRowParallel unchanged"),
          (RowOnlyRankZeroReduces, "did not pair up"),
          (RowEngine, "called minikv's own minikv.engine.parallel.RowParallel.forward"),
          (RowTwiceHalved, "one all-reduce per forward pass"),
          (RowFlat, "shaped like the whole layer's"),
          (RowFixed(torch.nn.Linear(2, 2)), "pass the class itself")] + [
         (wrong, hint) for hint, wrong in ch13.ROW_MISTAKES.items()],
    RESTORE: [(lambda *a: None, "did you forget to return it"),
              (lambda k, v, t, pk, pv, f, ps: torch.tensor(ch13.restore_by_hand(
                  k, v, t, pk, pv, f, ps)).float(), "a list of the block ids"),
              (restore_whole_last_block, "a partial last block holds fewer"),
              (restore_and_clear, "write only into the blocks you took"),
              (restore_in_the_tree, "minikv's own minikv.engine.radix.RadixTree.restore"),
              (restore_used_blocks, "take fresh blocks from `free`")] + [
        (wrong, hint) for hint, wrong in ch13.RESTORE_MISTAKES.items()],
}
RIGHT = {PREDICT: [(predict_llama_per_rank, cache_per_rank),
                   (predict_llama_per_rank, cache_per_rank_by_heads)],
         ROW: [(RowFixed,), (RowBiasOnRankZero,), (RowBiasShared,)],
         RESTORE: [(ch13.restore_by_hand,), (restore_from_the_back,)]}
STUBS = {PREDICT: [(stub, cache_per_rank), (predict_llama_per_rank, stub)],
         ROW: [(type("Stub", (ch13.BuggyRowParallel,), {"forward": stub}),)],
         RESTORE: [(stub,)]}


@pytest.mark.parametrize("checker", RIGHT, ids=checker_id)
def test_right_ways_pass_leaving_the_random_state_and_a_stub_goes_through(checker, capsys):
    assert_right_ways_pass(checker, RIGHT[checker], STUBS[checker], capsys)


@pytest.mark.parametrize("checker, wrong, fragment",
                         [(c, w, f) for c, ws in WRONG.items() for w, f in ws], ids=checker_id)
def test_every_mistake_is_named(checker, wrong, fragment):
    assert_mistake_named(checker, wrong, fragment)


# --- the checkers' cases are sound ----------------------------------------------------------------
def test_the_build_reference_is_what_shard_holds():
    """attention_slices (the checker's reference) and by_hand (the solution's way) equal the
    layer `shard` builds, for every case's model, rank and world."""
    for name in ("target", "target-gqa2", "target-mqa"):
        model, _ = minikv.load_course_model(name, "cpu")
        cfg = model.config
        for world in (1, 2, 4, 8):
            for rank in range(world):
                part = shard(model, rank, world).transformer.h[2].attn
                attn = model.transformer.h[2].attn
                args = (attn.c_attn.weight, attn.c_proj.weight, cfg.n_head, cfg.kv_heads, rank,
                        world)
                for way in (ch13.attention_slices, ch13.by_hand):
                    rows, cols = way(*args)
                    assert torch.equal(rows, part.c_attn.weight), (name, world, rank)
                    assert torch.equal(cols, part.c_proj.weight), (name, world, rank)


def test_the_predictions_are_the_formulas():
    assert ch13.llama_per_rank() == predict_llama_per_rank()
    for tp in ch13.TPS:
        assert all(w != ch13.llama_per_rank()[tp] for w, _ in ch13._llama_mistakes(tp))
    for hint in (ch13.P["ours_whole"], ch13.P["ours_divided"], ch13.P["ours_query"],
                 ch13.P["ours_total"]):  # every usual mistake is wrong in some case
        assert any(ch13._ours_mistakes(m, w)[hint] != ch13._course_per_rank(name, w)
                   for name in ch13.OURS for m in [minikv.load_course_model(name, "cpu")[0]]
                   for w in ch13.WORLDS), hint


def test_the_simulated_group_sums_and_reports_unpaired_all_reduces():
    def rank_sum(rank, world):
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        return float(t), dist.get_rank(), dist.get_world_size()
    results, calls = in_threads(rank_sum, 3)
    assert results == [(6.0, r, 3) for r in range(3)] and calls == [1, 1, 1]

    def unpaired(rank, world):
        if rank == 1:
            dist.all_reduce(torch.zeros(1))
    with pytest.raises(Unmatched):
        in_threads(unpaired, 2, timeout=5.0)

    def fails(rank, world):
        if rank == 0:
            raise KeyError("rank 0")
        dist.all_reduce(torch.zeros(1))
    with pytest.raises(KeyError):
        in_threads(fails, 2, timeout=5.0)
    assert dist.all_reduce is torch.distributed.distributed_c10d.all_reduce  # put back


def test_the_buggy_layer_is_off_by_the_bias_times_the_other_ranks():
    """The bug's evidence, as the notebook shows it: right on one rank; on w ranks, the whole
    layer's output plus (w - 1) times the bias."""
    torch.manual_seed(0)
    whole, x = torch.nn.Linear(8, 3), torch.randn(1, 2, 8)
    for world in (1, 2, 4):
        outs, _ = ch13.run_row_parallel(ch13.BuggyRowParallel, whole, x, world)
        for out in outs:
            torch.testing.assert_close(out, whole(x) + (world - 1) * whole.bias)


def test_the_design_cases_tell_the_rules_apart():
    for hint, wrong in ch13.CHOOSE.mistakes.items():
        assert any(wrong(*case) != ch13.best_tp(*case) for case in ch13.CHOOSE.cases), hint
    assert any(ch13.best_tp(*case) is None for case in ch13.CHOOSE.cases)


def test_the_restore_reference_is_the_engines_and_the_cases_tell_the_mistakes_apart():
    """restore_by_hand (the solution's way) puts what RadixTree.restore puts, through its
    table; every case has a block that restore writes and others it must not."""
    for case in ch13.RESTORE_CASES:
        keys, values, there, pk, pv, free, ps = ch13._restore_case(case)
        n = keys.shape[2]
        want, wk, wv, wfree = ch13.engine_restore(keys, values, pk, pv, free, ps)
        got, gk, gv, gfree = ch13._restore_outcome(ch13.restore_by_hand, case)
        assert got == want and gfree == wfree, case[0]
        assert torch.equal(ch13._through(gk, got, n, ps), keys)
        assert torch.equal(ch13._through(gv, got, n, ps), values)
        assert set(there) - set(free), case[0]  # the worker's ids name blocks in use here
    for hint, wrong in ch13.RESTORE_MISTAKES.items():
        assert any(not ch13._same_outcome(ch13._restore_outcome(wrong, c),
                                          ch13._restore_outcome(ch13.restore_by_hand, c))
                   for c in ch13.RESTORE_CASES), hint


def test_the_break_even_cases_tell_the_rules_apart():
    for hint, wrong in ch13.PLAN.mistakes.items():
        assert any(not ch13._same_plan(wrong(*c), ch13.transfer_or_recompute(*c))
                   for c in ch13.PLAN.cases), hint
    choices = {ch13.transfer_or_recompute(*c)[1] for c in ch13.PLAN.cases}
    assert choices == {"transfer", "recompute"}
