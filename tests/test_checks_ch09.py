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
    def fixed(m, d, acc, q, k_tile, v_tile):
        w = softmax(q @ k_tile.T / math.sqrt(q.shape[1]))
        return m, d, acc + w @ v_tile
    with pytest.raises(CheckFailed, match=r"called torch\.(softmax|logsumexp)\(\)"):
        ch09.check_tile_step_fixed(fixed)


def test_sdpa_is_refused():
    def fixed(m, d, acc, q, k_tile, v_tile):
        out = torch.nn.functional.scaled_dot_product_attention(q[None], k_tile[None],
                                                               v_tile[None])[0]
        return m, d, acc + out
    with pytest.raises(CheckFailed, match="scaled_dot_product_attention"):
        ch09.check_tile_step_fixed(fixed)


# --- the online softmax's checkers refuse what is not online ------------------------------------
# Each gets one tile and the running state, never the row; a solution that is not online can
# only get the row by remembering earlier calls' tiles. Two such, by name: the max of everything
# seen taken first (a global max), and each prefix's max and sum recomputed from scratch.

def _remembering(recompute):
    """A step that keeps every tile it was given (as if it could see the row so far)."""
    seen = []

    def step(*args):
        seen.append(args)
        return recompute(seen)
    return step


def _prefix_recomputed(seen):
    x = torch.cat([tile for _, _, tile in seen])
    m = float(x.max())
    return m, float(torch.exp(x - m).sum())


def _global_max_first_attention(seen):
    """Every key seen so far scored, the global max taken first, then one exp pass."""
    m, d, acc, q, _, _ = seen[-1]
    k, v = torch.cat([s[4] for s in seen]), torch.cat([s[5] for s in seen])
    s = q @ k.T / math.sqrt(q.shape[1])
    top = s.max(dim=1, keepdim=True).values
    p = torch.exp(s - top)
    return top, p.sum(dim=1, keepdim=True), p @ v


def test_a_prefix_recomputed_is_refused_by_the_online_step():
    with pytest.raises(CheckFailed, match="the step is not online"):
        ch09.check_online_step(_remembering(_prefix_recomputed))


def test_a_global_max_first_is_refused_by_the_tile_step():
    with pytest.raises(CheckFailed, match="the step is not online"):
        ch09.check_tile_step_fixed(_remembering(_global_max_first_attention))


def test_the_steps_see_one_tile_and_are_run_by_the_kernels_loop():
    """The steps, fed a row a tile at a time, are the engine's online softmax and attention."""
    x = torch.tensor([1.0, 3.0, 0.5, 7.0, 2.0, 9.0, -1.0, 4.0])
    m, d = ch09.run_steps(ch09.online_step_by_hand, x, 3)[-1]
    assert m == 9.0 and math.isclose(d, float(torch.exp(x - 9.0).sum()), rel_tol=1e-6)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 8, generator=g) for n in (3, 13, 13))
    want = torch.softmax(q @ k.T / math.sqrt(8), -1) @ v
    assert torch.allclose(ch09.attend_in_tiles(ch09.tile_step_by_hand, q, k, v, 4), want,
                          atol=1e-6)


def test_the_design_bytes_from_the_schedule_are_what_the_kernel_moves():
    for shape in ((16, 16), (64, 16), (32, 128), (256, 16)):
        assert ch09.scheduled_bytes(*shape, 32) == ch09.moved_bytes(*shape, 32)


@pytest.mark.parametrize("choice, says", [
    (lambda hs, budget: (128, 128), "count q and acc"),
    (lambda hs, budget: (128, 16), "the output so far"),
    (lambda hs, budget: (128, 32), "4 bytes a number, not 2"),
    (lambda hs, budget: (ch09.choose_tiles_by_hand(hs, budget)[0] // 2,) * 2, "square tiles"),
    (lambda hs, budget: (16, 64), "memory went to the key tile"),
    (lambda hs, budget: (32, 16), "a larger block_q fits"),
    (lambda hs, budget: (48, 16), "two ints from"),
])
def test_the_design_names_wrong_tile_choices(choice, says):
    with pytest.raises(CheckFailed, match=says):
        ch09.check_choose_tiles(choice)


def test_the_engines_merge_is_refused():
    from minikv.engine.flash import Partial, merge

    def merged(a, b):
        p = merge(*(Partial(o, torch.tensor([m]), torch.tensor([s])) for o, m, s in (a, b)))
        return p.out, float(p.max), float(p.sum)
    with pytest.raises(CheckFailed, match="minikv's own minikv.engine.flash.merge"):
        ch09.check_merge_partials(merged)


@pytest.mark.parametrize("wrong, says", [
    (lambda m, d, tile: ch09.online_step_by_hand(m, d, tile)[0], "the pair"),
    (lambda m, d, tile: [*ch09.online_step_by_hand(m, d, tile), 0.0], "the pair"),
    (lambda m, d, tile: (True, 1.0), "two numbers"),
])
def test_online_step_wrong_forms_are_refused(wrong, says):
    with pytest.raises(CheckFailed, match=says):
        ch09.check_online_step(wrong)


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
