"""Chapter 09's checkers beyond their tables (tests/test_checks_table.py feeds every named
mistake): what a table cannot state: torch's own softmax refused however it is called, wrong
return types, arguments changed in place."""
import math

import pytest
import torch

from minikv.course.checks import CheckFailed, ch09


@pytest.mark.parametrize("softmax", [
    lambda x: x.softmax(-1), lambda x: torch.softmax(x, -1),
    lambda x: torch.nn.functional.softmax(x, -1), lambda x: torch.exp(x - x.logsumexp(-1))])
def test_torch_softmax_is_refused_in_the_debug_exercise(softmax):
    def fixed(q, k, v, block_k):
        return softmax(q @ k.T / math.sqrt(q.shape[1])) @ v
    with pytest.raises(CheckFailed, match=r"called torch\.(softmax|logsumexp)\(\)"):
        ch09.check_tiled_attention_fixed(fixed)


def test_sdpa_is_refused():
    def fixed(q, k, v, block_k):
        return torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None])[0]
    with pytest.raises(CheckFailed, match="scaled_dot_product_attention"):
        ch09.check_tiled_attention_fixed(fixed)


def test_the_engines_merge_is_refused():
    from minikv.engine.flash import Partial, merge

    def merged(a, b):
        p = merge(*(Partial(o, torch.tensor([m]), torch.tensor([s])) for o, m, s in (a, b)))
        return p.out, float(p.max), float(p.sum)
    with pytest.raises(CheckFailed, match="minikv's own minikv.engine.flash.merge"):
        ch09.check_merge_partials(merged)


@pytest.mark.parametrize("wrong, says", [
    (lambda x, tile: ch09.running_stats_by_hand(x, tile)[-1], "return a list of"),
    (lambda x, tile: [m for m, _ in ch09.running_stats_by_hand(x, tile)], "each two numbers"),
    (lambda x, tile: [(True, 1.0)] * -(-len(x) // tile), "each two numbers"),
])
def test_running_stats_wrong_forms_are_refused(wrong, says):
    with pytest.raises(CheckFailed, match=says):
        ch09.check_running_stats(wrong)


def test_a_merge_that_writes_into_a_partial_is_caught():
    def in_place(a, b):
        out, m, s = ch09.merge_by_hand(a, b)
        a[0].copy_(out)
        return a[0], m, s
    with pytest.raises(CheckFailed, match="build a new output"):
        ch09.check_merge_partials(in_place)


def test_tiles_given_as_floats_are_refused():
    with pytest.raises(CheckFailed, match=r"three ints"):
        ch09.check_predict_tiles(lambda T, L, bq, bk: tuple(
            float(n) for n in ch09.predict_tiles_by_hand(T, L, bq, bk)))
