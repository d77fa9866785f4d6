"""Chapter 09's checkers beyond their tables (tests/test_checks_table.py feeds every named
mistake): what a table cannot state: torch's own softmax refused however it is called, wrong
return types, arguments changed in place."""
import importlib.util
import math
import os
import re
from pathlib import Path

import pytest
import torch

from minikv.course.checks import CheckFailed, ch09
from minikv.course.notebooks import STUB_MESSAGE
from minikv.engine import flash


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


# --- exercise 6: the paged decode walk as a Triton kernel ---------------------------------------
# The right kernel and the usual wrong ones, each written as a Triton kernel (the right one with a
# line changed), run by the checker under Triton's interpreter as on a student's CPU (conftest.py
# sets TRITON_INTERPRET=1 where no CUDA GPU is; on a GPU they compile, and what only the
# interpreter sees is skipped). Skipped where Triton is not installed (requirements.txt brings it
# on Linux x86-64, so CI runs them).
RIGHT = '''
import triton
import triton.language as tl


@triton.jit
def walk_kernel(Q, Keys, Values, Tables, Lengths, Out, scale,
                stride_qb, stride_kb, stride_kh, stride_kp, stride_tb, stride_ob,
                GROUP: tl.constexpr, HS: tl.constexpr, PAGE: tl.constexpr):
    row, head = tl.program_id(0), tl.program_id(1)
    kv_head = head // GROUP
    dims = tl.arange(0, HS)
    slots = tl.arange(0, PAGE)
    q = tl.load(Q + row * stride_qb + head * HS + dims).to(tl.float32)
    length = tl.load(Lengths + row)
    m = tl.full([1], float("-inf"), tl.float32)
    d = tl.zeros([1], tl.float32)
    acc = tl.zeros([HS], tl.float32)
    for b in range(0, tl.cdiv(length, PAGE)):
        block = tl.load(Tables + row * stride_tb + b)
        at = block.to(tl.int64) * stride_kb + kv_head * stride_kh
        at = at + slots[:, None] * stride_kp + dims[None, :]
        live = b * PAGE + slots < length
        k = tl.load(Keys + at, mask=live[:, None], other=0.0).to(tl.float32)
        v = tl.load(Values + at, mask=live[:, None], other=0.0).to(tl.float32)
        s = tl.sum(k * q[None, :], axis=1) * scale
        s = tl.where(live, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s))
        rescale = tl.exp(m - m_new)
        p = tl.exp(s - m_new)
        d = d * rescale + tl.sum(p)
        acc = acc * rescale + tl.sum(p[:, None] * v, axis=0)
        m = m_new
    tl.store(Out + row * stride_ob + head * HS + dims, acc / d)
'''
# the whole row in one load (right values, refused all the same): positions 0..31 of the row
WHOLE_ROW = RIGHT.split("    for b in")[0] + '''
    pos = tl.arange(0, 32)
    live = pos < length
    block = tl.load(Tables + row * stride_tb + pos // PAGE, mask=live, other=0)
    at = block.to(tl.int64) * stride_kb + kv_head * stride_kh + (pos % PAGE) * stride_kp
    k = tl.load(Keys + at[:, None] + dims[None, :], mask=live[:, None], other=0.0)
    v = tl.load(Values + at[:, None] + dims[None, :], mask=live[:, None], other=0.0)
    s = tl.where(live, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
    p = tl.exp(s - tl.max(s))
    tl.store(Out + row * stride_ob + head * HS + dims, tl.sum(p[:, None] * v, axis=0) / tl.sum(p))
'''
# the right kernel with lines changed: (as written, as the mistake writes it), and its hint's key
WRONG = {
    "no_rescale": [("d = d * rescale", "d = d"), ("acc = acc * rescale", "acc = acc")],
    "acc_not_rescaled": [("acc = acc * rescale", "acc = acc")],
    "unscaled": [("axis=1) * scale", "axis=1)")],
    "storage_order": [("block = tl.load(Tables + row * stride_tb + b)", "block = b")],
    "scores_unmasked": [('s = tl.where(live, s, float("-inf"))', "s = s")],
    "stale": [("live = b * PAGE + slots < length", "live = slots < length")],
    "table": [("stride_tb + b)", "stride_tb + tl.cdiv(length, PAGE) - 1 - b)")],
    "out_of_bounds": [("block.to(tl.int64) * stride_kb", "block.to(tl.int64) * PAGE * stride_kb")],
    "raised": [("tl.sum(k * q[None, :], axis=1)", "tl.sum(k * q[:, None], axis=1)")],
    # triton imported before TRITON_INTERPRET=1: its helpers made for a GPU, as tl.zeros is here
    "imported_first": [("import triton.language as tl\n", "import triton.language as tl\n"
                        "from triton.runtime.jit import JITFunction\n\n"
                        "zeros_for_a_gpu = JITFunction(tl.zeros.fn)\n"),
                       ("acc = tl.zeros([HS]", "acc = zeros_for_a_gpu([HS]")],
}
W = ch09.H["walk_kernel"]
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# seen under the interpreter only (on a GPU: a read out of bounds is a crash, tl.zeros compiled)
LOADS_SEEN = ("stale", "table", "out_of_bounds", "imported_first")
interpreter_only = pytest.mark.skipif(not INTERPRETED, reason="the loads are seen under Triton's "
                                      "interpreter only")


def _kernel(source: str, where: Path, name: str):
    """The kernel in `source`, imported from a file (the interpreter reads its source)."""
    path = where / f"walk_{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"walk_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.walk_kernel


def _changed(changes) -> str:
    source = RIGHT
    for old, new in changes:
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    return source


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    pytest.importorskip("triton")
    where = tmp_path_factory.mktemp("kernels")
    found = {name: _kernel(_changed(changes), where, name) for name, changes in WRONG.items()}
    found["right"] = _kernel(RIGHT, where, "right")
    found["whole_row"] = _kernel(WHOLE_ROW, where, "whole_row")
    stub = f"        raise NotImplementedError({STUB_MESSAGE!r})\n        block = tl.load("
    found["stub"] = _kernel(RIGHT.replace("        block = tl.load(", stub), where, "stub")
    return found


def test_the_right_kernel_passes_and_the_random_state_stays(kernels, capsys):
    torch.manual_seed(0)
    before = torch.random.get_rng_state()
    ch09.check_walk_kernel(kernels["right"])
    said = f"✓ walk_kernel: all {len(ch09.WALK_LAYOUTS)} cases pass\n"
    assert capsys.readouterr().out == said + ("" if INTERPRETED else W["compiled"] + "\n")
    assert torch.equal(before, torch.random.get_rng_state())


@interpreter_only
def test_the_whole_row_in_one_load_is_refused_though_its_values_are_right(kernels):
    with pytest.raises(CheckFailed, match=r"one load of \d+ keys from [2-9] blocks") as info:
        ch09.check_walk_kernel(kernels["whole_row"])
    assert str(info.value).endswith(f"\n  hint: {W['whole_row']}")


@pytest.mark.parametrize("mistake", WRONG)
def test_every_wrong_kernel_is_named(kernels, mistake):
    if mistake in LOADS_SEEN and not INTERPRETED:
        pytest.skip("the loads are seen under Triton's interpreter only")
    with pytest.raises(CheckFailed) as info:
        ch09.check_walk_kernel(kernels[mistake])
    hint = re.escape(W[mistake]).replace(r"\{row\}", r"\d+").replace(r"\{head\}", r"\d+")
    hint = re.sub(r"\\\{\w+\\\}", ".+", hint)
    assert re.search(f"\n  hint: {hint}$", str(info.value)), str(info.value)


def test_a_stub_goes_through_and_a_plain_function_is_refused(kernels):
    with pytest.raises(NotImplementedError):
        ch09.check_walk_kernel(kernels["stub"])
    with pytest.raises(CheckFailed, match="decorate walk_kernel with @triton.jit"):
        ch09.check_walk_kernel(kernels["right"].fn)


def test_the_layouts_raise_the_max_after_the_first_block():
    """The no-rescale mistakes differ from the walk only where the max rises after a block:
    every layout has rows where it does, for every query head."""
    for layout in ch09.WALK_LAYOUTS:
        q, keys, values, tables, lengths = ch09.walk_layout(*layout)
        steps = []
        flash.walk(q[0], keys, values, tables[0], 0, lengths[0], keys.size(2), steps)
        assert len(steps) > 1 and bool((steps[-1].max > steps[0].max).all()), layout


def test_without_triton_the_check_says_it_skipped(monkeypatch, capsys):
    monkeypatch.setattr(ch09, "_triton", lambda: None)
    ch09.check_walk_kernel(lambda *args: None)
    assert "skipped, not graded: Triton is not installed" in capsys.readouterr().out


@pytest.mark.cuda
def test_on_a_gpu_the_compiled_kernel_is_graded_by_its_output(kernels, capsys):
    ch09.check_walk_kernel(kernels["right"])
    assert "compiled for this GPU" in capsys.readouterr().out
